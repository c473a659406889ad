"""bf16 against fp32 on this CPU: the engine's speed, and greedy agreement with `transformers`.

    python -m experiments.dtype_check [--max-tokens 32] [--out experiments/results/dtype_check.json]

Prompts: the SmolLM2 oracle chats of the exact-token tests plus 8 random-token prompts.
Agreement is counted two ways: prompts whose greedy tokens are identical, and generated
tokens equal before the first divergence (over all generated tokens). Speed: the decode step
at batch 1 and 8, and a 4 x 512 prefill, for each dtype in the same run.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

import torch

from engine.hardware import cpu_paths
from engine.tokenizer import apply_chat_template, load_tokenizer
from experiments import RESULTS
from experiments.engine_bench import PdclusterRunner, decode_step_s, default_model_dir
from experiments.hf_peer import generate_static
from experiments.workloads import BenchRequest, Workload, uniform, w_mixed

CHATS = [
    "What is the capital of France?",
    "Write a short poem about the sea and the wind at night.",
    "Explain in two sentences why the sky is blue during the day.",
    "List three fruits that are red and one that is yellow.",
]


def agreement(ours: list[list[int]], theirs: list[list[int]]) -> dict[str, float]:
    """Identical sequences, and the share of tokens equal before each first divergence."""
    same_prefix = 0
    for a, b in zip(ours, theirs, strict=True):
        diverged = [i for i, (x, y) in enumerate(zip(a, b, strict=True)) if x != y]
        same_prefix += diverged[0] if diverged else len(a)
    return {"identical": sum(a == b for a, b in zip(ours, theirs, strict=True)) / len(ours),
            "tokens_before_divergence": same_prefix / sum(len(a) for a in ours)}


def hf_tokens(model_dir: Path, dtype: torch.dtype, workload: Workload) -> list[list[int]]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).eval()
    requests = [{"prompt_token_ids": r.prompt_token_ids, "max_tokens": r.max_tokens}
                for r in workload.requests]
    with torch.inference_mode():
        return generate_static(model, requests, batch_size=1, pad_token_id=0)


def speed(runner: PdclusterRunner, vocab_size: int) -> dict[str, float]:
    def generate(w: Workload) -> float:
        return runner.generate(w)[0]

    prefill = min(generate(uniform(4, 512, 1, vocab_size, seed)) for seed in (300, 301))
    return {f"decode_step_ms_batch{b}": 1e3 * decode_step_s(generate, b, 16, 32, vocab_size)
            for b in (1, 8)} | {"prefill_4x512_s": prefill}


def run(max_tokens: int) -> dict[str, Any]:
    model_dir = default_model_dir()
    tokenizer = load_tokenizer(model_dir)
    vocab_size = json.loads((model_dir / "config.json").read_text())["vocab_size"]
    prompts = [apply_chat_template(tokenizer, [{"role": "user", "content": c}]) for c in CHATS]
    prompts += [r.prompt_token_ids for r in w_mixed(8, vocab_size, seed=5,
                                                    prompt_len=(16, 128)).requests]
    workload = Workload("oracle", 0, [BenchRequest(p, max_tokens) for p in prompts])
    hf = {str(d).removeprefix("torch."): hf_tokens(model_dir, d, workload)
          for d in (torch.float32, torch.bfloat16)}
    report: dict[str, Any] = {"cpu": cpu_paths().describe(), "max_tokens": max_tokens,
                              "num_prompts": len(prompts)}
    for dtype in ("float32", "bfloat16"):
        runner = PdclusterRunner(model_dir, dtype)
        _, ours = runner.generate(workload)
        report[dtype] = {"speed": speed(runner, vocab_size),
                         **{f"vs_hf_{d}": agreement(ours, t) for d, t in hf.items()}}
        del runner
    return report


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--out", type=Path, default=RESULTS / "dtype_check.json",
                        help="default experiments/results/dtype_check.json")
    args = parser.parse_args()
    start = time.perf_counter()
    report = run(args.max_tokens)
    report["wall_s"] = time.perf_counter() - start
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
