"""Tensor parallelism on CPU, fp32, every size in one run: SmolLM2 at tensor_parallel_size
1 and 3 (its 9 query heads split into 3, not 2), and a SmolLM2-shaped model with 8 heads
of 72 and 2 KV heads (random weights, made once under experiments/results/) at 1 and 2.

    python -m experiments.tp_cpu [--reps 3] [--out experiments/results/tp_cpu.json]
    python -m experiments.tp_cpu --pages [--reps 3]  # private pages' mirror against shared

`--pages` runs the 8-head model at size 2 as a decode worker's engine (whose KV a
transport moves) twice: its ranks' KV heads in one shared pool, then in private pages
mirrored on rank 0 (one gather a layer each step: the GPU layout).

- Decode step: B requests (batch 1 and 8) with 32-token prompts prefilled, then 16 decode
  steps timed; the mean step. Each repetition starts fresh requests.
- Prefill: one 256-token prompt computed in one step (prefix caching off, a new prompt
  each repetition).

Each size runs on its defaults: size 1 with the engine's thread governor (every free
core), size 2 with one thread per rank (the cores divided by the ranks) over gloo.
Every repetition is reported, not only a summary.
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
import subprocess
import time
from pathlib import Path
from typing import Any

import torch

from engine import CacheConfig, LLMEngine, SamplingParams, SchedulerConfig
from engine.model_loader import resolve_model_dir
from experiments import RESULTS

DECODE_STEPS = 16
PROMPT = 32
PREFILL = 256


def _prompt(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(100, 49000) for _ in range(n)]


def _decode_step_s(engine: LLMEngine, batch: int, rng: random.Random) -> float:
    params = SamplingParams(temperature=0.0, max_tokens=DECODE_STEPS + 2, ignore_eos=True)
    ids = [f"d{batch}-{rng.random()}" for _ in range(batch)]
    for rid in ids:
        engine.add_request(rid, _prompt(rng, PROMPT), params)
    engine.step()  # the prompts
    start = time.perf_counter()
    for _ in range(DECODE_STEPS):
        engine.step()
    elapsed = (time.perf_counter() - start) / DECODE_STEPS
    for rid in ids:
        engine.abort_request(rid)
    return elapsed


def _prefill_s(engine: LLMEngine, rng: random.Random) -> float:
    rid = f"p-{rng.random()}"
    engine.add_request(rid, _prompt(rng, PREFILL), SamplingParams(max_tokens=1))
    start = time.perf_counter()
    engine.step()
    elapsed = time.perf_counter() - start
    engine.abort_request(rid)
    return elapsed


def eight_head_model() -> Path:
    """SmolLM2's shapes with 8 query heads of 72 (hidden 576 as SmolLM2's) and 2 KV
    heads, random weights, SmolLM2's tokenizer: a model that splits over 2 ranks."""
    from transformers import LlamaConfig, LlamaForCausalLM

    out = RESULTS / "smollm2-shaped-8-heads"
    if (out / "model.safetensors").is_file():
        return out
    smollm2 = resolve_model_dir("smollm2")
    config = LlamaConfig.from_pretrained(smollm2)
    config.num_attention_heads, config.num_key_value_heads, config.head_dim = 8, 2, 72
    torch.manual_seed(0)
    LlamaForCausalLM(config).float().save_pretrained(out)
    for f in smollm2.iterdir():
        if f.name.startswith("tokenizer") or f.name == "chat_template.jinja":
            shutil.copy(f, out / f.name)
    return out


def measure(model: str, size: int, reps: int, pages: str = "auto",
            role: str = "mixed") -> dict[str, Any]:
    """Every repetition of each measure at `size` ranks, in seconds."""
    rng = random.Random(size)
    with LLMEngine(model, "float32", tensor_parallel_size=size, tp_kv_pages=pages,
                   scheduler=SchedulerConfig(role=role),
                   cache=CacheConfig(num_blocks=256, enable_prefix_caching=False)) as engine:
        _decode_step_s(engine, 1, rng)  # warm-up
        _prefill_s(engine, rng)
        return {"model": Path(model).name, "tensor_parallel_size": size, "pages": pages,
                "role": role,
                "threads_per_rank": torch.get_num_threads(),
                "weight_bytes_per_rank": engine.weight_bytes_per_rank,
                "decode_b1_s": [_decode_step_s(engine, 1, rng) for _ in range(reps)],
                "decode_b8_s": [_decode_step_s(engine, 8, rng) for _ in range(reps)],
                "prefill_256_s": [_prefill_s(engine, rng) for _ in range(reps)]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--pages", action="store_true",
                        help="only the 8-head model at size 2, shared against private pages")
    parser.add_argument("--out", type=Path, default=RESULTS / "tp_cpu.json")
    args = parser.parse_args()
    cpu = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
    model = next((line.split(":", 1)[1].strip() for line in cpu.splitlines()
                  if line.startswith("Model name")), "unknown")
    eight = str(eight_head_model())
    runs = [(eight, 2, "shared", "decode"), (eight, 2, "private", "decode")] if args.pages \
        else [("smollm2", 1), ("smollm2", 3), (eight, 1), (eight, 2)]
    results = {"cpu": model, "runs": [measure(m, size, args.reps, *rest)
                                      for m, size, *rest in runs]}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=2))
    print(f"CPU: {model}")
    for run in results["runs"]:
        print(f"{run['model']}, tensor_parallel_size {run['tensor_parallel_size']} "
              f"({run['threads_per_rank']} torch threads per rank, {run['pages']} pages, "
              f"{run['role']}):")
        for key in ("decode_b1_s", "decode_b8_s", "prefill_256_s"):
            print(f"  {key}: " + ", ".join(f"{1000 * s:.1f} ms" for s in run[key]))


if __name__ == "__main__":
    main()
