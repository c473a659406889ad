"""int8 KV pages against fp32 (and bf16) KV on SmolLM2: quality, capacity, bytes, speed.

    python -m experiments.int8_kv [--runs 3] [--out experiments/results/int8_kv.json]

- Greedy agreement: fixed chats, 64 tokens each, fp32 weights with fp32 KV and with int8
  KV: the share of identical sequences and the mean tokens before the first divergence.
- Log-prob difference: a fixed text read token by token (a 16-token prefill, then one
  decode step per token, so the paged-decode kernel reads the pages), the log-prob of each
  next token with fp32 KV and with int8 KV: the mean and max absolute difference.
- Capacity: blocks at a 1 GiB budget for fp32, bf16 and int8 pages, and the sequences of
  1,024 tokens that fit.
- Bytes per transferred request: the pool's bytes per block (what the cluster ships and
  counts in `pdcluster:kv_transfer_request_bytes`) for a 1,024-token prompt.
- Decode step time: one model forward of a decode batch of 8 and 32 sequences, each with
  a 1,024-token context of random KV already in the pages (attention cost does not depend
  on the values), for fp32 weights with fp32 / int8 KV and bf16 weights with bf16 / int8
  KV; every configuration once per round, rounds interleaved, the median of the steps of
  each; per round the int8 step over the same-weights baseline.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from functools import partial
from pathlib import Path
from typing import Any

import torch

from engine import LLM, CacheConfig, LLMEngine, SamplingParams
from engine.attention import BatchLayout
from engine.attention.torch_backend import paged_decode
from engine.hardware import cpu_features, cpu_paths
from engine.kernels import cpu_kernels
from engine.kv_cache import KVCache
from engine.kv_quant import quantize
from experiments import RESULTS

CHATS = [
    "What is the capital of France?", "Write a haiku about the sea.",
    "Explain photosynthesis in one paragraph.", "List three prime numbers.",
    "Who wrote Hamlet?", "Translate 'good morning' into Spanish.",
    "What is 12 times 12?", "Give me a tip for learning to code.",
    "Describe a cat to someone who has never seen one.",
    "Why do leaves change colour in autumn?", "Name the planets of the solar system.",
    "How does a bicycle stay upright?", "Write a limerick about a programmer.",
    "What is the boiling point of water at sea level?",
    "Suggest a name for a bakery.", "Summarise the story of Cinderella in three sentences.",
]
TEXT = (
    "The river rose slowly through the night, and by morning the low fields along its banks "
    "had turned into a single sheet of brown water. Farmers who had lived in the valley for "
    "generations knew the signs: the heavy rain in the hills, the swollen streams, the "
    "sudden silence of the birds. They moved their animals to higher ground and carried "
    "what they could into the upper rooms of their houses. In the village, the old stone "
    "bridge held, as it had held for three hundred years, while the water pushed against "
    "its arches and carried branches, fences and once a small wooden boat beneath it. "
    "Children watched from the church steps as the men tied ropes between the trees. By "
    "the afternoon the rain had stopped, the clouds broke apart, and the sun came out over "
    "a landscape that nobody recognised. It would take weeks for the water to go down, and "
    "months before the fields could be planted again, but no one had been lost.")
CONTEXT = 1024
_FLAGS = {"avx2", "avx512f", "avx512_bf16", "amx_bf16", "amx_int8", "avx512_vnni", "fma"}
BLOCK = 16


def agreement(ours: list[list[int]], reference: list[list[int]]) -> dict[str, float]:
    """Identical sequences (share) and mean tokens before the first divergence."""
    before = [next((i for i, (a, b) in enumerate(zip(x, y, strict=True)) if a != b), len(x))
              for x, y in zip(ours, reference, strict=True)]
    return {"identical_share": sum(b == len(x) for b, x in zip(before, ours, strict=True))
            / len(ours), "mean_tokens_before_divergence": statistics.mean(before),
            "tokens_before_divergence": before, "max_tokens": len(ours[0])}


def greedy(max_tokens: int) -> dict[str, Any]:
    chats = [[{"role": "user", "content": c}] for c in CHATS]
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    tokens = {}
    for kv in ("auto", "int8"):
        llm = LLM("smollm2", kv_cache_dtype=kv, cache=CacheConfig(num_blocks=512))
        tokens[kv] = [o.outputs[0].token_ids for o in llm.chat(chats, params)]
        del llm
    return agreement(tokens["int8"], tokens["auto"])


def _step(engine: LLMEngine, ids: torch.Tensor, start: int, tables: torch.Tensor,
          lens: list[int]) -> torch.Tensor:
    """One forward over `ids` (a prefill chunk of one sequence from `start`, or one token per
    sequence); its logits or hidden states."""
    queries = len(ids) if len(lens) == 1 else 1
    positions = torch.arange(start, start + queries) if len(lens) == 1 else \
        torch.tensor(lens) - 1
    rows = torch.zeros(queries, dtype=torch.long) if len(lens) == 1 else \
        torch.arange(len(lens))
    slots = tables[rows, positions // BLOCK] * BLOCK + positions % BLOCK
    layout = BatchLayout([queries] * (1 if len(lens) == 1 else len(lens)), lens, tables, slots,
                         num_prefills=1 if queries > 1 else 0, block_size=BLOCK)
    engine.runner.attn.begin_step(layout)
    return engine.model(ids, positions, engine.kv_cache, engine.runner.attn)


@torch.inference_mode()
def forced_logprobs(engine: LLMEngine, ids: torch.Tensor, block_ids: list[int],
                    prefill: int = 16, chunk: int = 1) -> torch.Tensor:
    """Teacher-forced log-probs of `ids[1:]`: the first `prefill` tokens in one prefill
    step, then the rest `chunk` tokens a step, each of those queries read by the
    paged-decode kernel over every earlier token's KV in the pages (one decode step per
    token; a chunk up to the torch backend's `SHORT_QUERY` takes the same kernel, one query
    per token). A prefill attends its own keys as the pages hold them (int8: quantized).

    Args:
        engine: its model writes and reads the KV of `ids` in `block_ids` of its pool.
        ids: the token sequence.
        block_ids: at least `len(ids) / block_size` blocks the caller holds.
        prefill: tokens of the first step.
        chunk: tokens of each later step.

    Returns:
        `[len(ids) - 1]`: the log-prob of each token but the first given the ones before.
    """
    tables = torch.tensor(block_ids)[None, :]
    hidden = _step(engine, ids[:prefill], 0, tables, [prefill])
    logps = [engine.model.compute_logits(hidden).log_softmax(-1)]
    for pos in range(prefill, len(ids) - 1, chunk):
        piece = ids[pos:min(pos + chunk, len(ids) - 1)]
        hidden = _step(engine, piece, pos, tables, [pos + len(piece)])
        logps.append(engine.model.compute_logits(hidden).log_softmax(-1))
    logp = torch.cat(logps)[:len(ids) - 1]  # [N - 1, vocab]: predictions of tokens 1 .. N-1
    return logp.gather(1, ids[1:, None])[:, 0]


def logprob_difference() -> dict[str, float]:
    """Teacher-forced next-token log-probs of TEXT with fp32 and with int8 KV."""
    per_kv = {}
    for kv in ("auto", "int8"):
        engine = LLMEngine("smollm2", "float32", cache=CacheConfig(num_blocks=64,
                                                                   kv_cache_dtype=kv))
        ids = torch.tensor(engine.tokenizer.encode(TEXT))
        blocks = list(range(-(-len(ids) // BLOCK)))
        per_kv[kv] = forced_logprobs(engine, ids, blocks)[15:]  # tokens 16 .. N-1
        del engine
    diff = (per_kv["int8"] - per_kv["auto"]).abs()
    return {"tokens": len(diff), "mean_abs_logprob_diff": diff.mean().item(),
            "max_abs_logprob_diff": diff.max().item(),
            "mean_logprob_fp32_kv": per_kv["auto"].mean().item()}


def capacity(budget_gb: float = 1.0) -> dict[str, Any]:
    """Blocks and 1,024-token sequences at `budget_gb` per page format (SmolLM2's shape)."""
    args = (30, BLOCK, 3, 64)  # layers, block size, KV heads, head dim
    per_block = {"fp32": KVCache.bytes_per_block(*args, torch.float32),
                 "bf16": KVCache.bytes_per_block(*args, torch.bfloat16),
                 "int8": KVCache.bytes_per_block(*args, torch.float32, "int8")}
    blocks = {k: int(budget_gb * 2**30) // v for k, v in per_block.items()}
    seqs = {k: v // (CONTEXT // BLOCK) for k, v in blocks.items()}
    request_bytes = {k: v * (CONTEXT // BLOCK) for k, v in per_block.items()}
    return {"budget_gb": budget_gb, "bytes_per_block": per_block, "blocks": blocks,
            "sequences_of_1024_tokens": seqs,
            "seq_ratio_int8_vs_fp32": seqs["int8"] / seqs["fp32"],
            "seq_ratio_int8_vs_bf16": seqs["int8"] / seqs["bf16"],
            "bytes_per_1024_token_request": request_bytes,
            "bytes_ratio_int8_vs_fp32": request_bytes["int8"] / request_bytes["fp32"],
            "bytes_ratio_int8_vs_bf16": request_bytes["int8"] / request_bytes["bf16"]}


def _decode_engine(dtype: str, kv: str, batch: int) -> LLMEngine:
    # One compute thread (torch and BLAS): on a shared 2-core machine two OpenBLAS threads
    # made fp32 steps swing 5x between rounds.
    engine = LLMEngine("smollm2", dtype, num_threads=1, cache=CacheConfig(
        num_blocks=batch * CONTEXT // BLOCK + 1, kv_cache_dtype=kv, enable_prefix_caching=False))
    gen = torch.Generator().manual_seed(0)
    head_dim = engine.model_config.head_dim
    for layer in engine.kv_cache.layers:  # random K/V (int8 rows: random values and scales)
        values = torch.randn(*layer.shape[:-1], head_dim, generator=gen)
        layer.copy_(quantize(values) if engine.kv_cache.quantized else values)
    return engine


def _attention(engine: LLMEngine, q: torch.Tensor, tables: torch.Tensor,
               lens: torch.Tensor) -> None:
    """The decode attention of every layer over its pages, alone (the KV-reading part)."""
    for layer in engine.kv_cache.layers:
        paged_decode(q, layer, tables, lens)


def _median_s(fn: Any, steps: int) -> float:
    fn()  # warm
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


@torch.inference_mode()
def step_times(runs: int, steps: int = 6) -> dict[str, Any]:
    configs = [("float32", "auto"), ("float32", "int8"), ("bfloat16", "auto"),
               ("bfloat16", "int8")]
    out: dict[str, Any] = {}
    for batch in (8, 32):
        engines = {c: _decode_engine(*c, batch) for c in configs}
        blocks = CONTEXT // BLOCK
        tables = torch.arange(batch * blocks).view(batch, blocks)
        ids = torch.randint(100, 40000, (batch,), generator=torch.Generator().manual_seed(1))
        lens = [CONTEXT] * batch
        q = {dtype: torch.randn(batch, 9, 64, generator=torch.Generator().manual_seed(2)).to(
            getattr(torch, dtype)) for dtype in ("float32", "bfloat16")}
        rounds = []
        for _ in range(runs):
            step, attn = {}, {}
            for c, engine in engines.items():  # interleaved: each config once per round
                key = "/".join(c)
                step[key] = _median_s(partial(_step, engine, ids, 0, tables, lens), steps)
                attn[key] = _median_s(partial(_attention, engine, q[c[0]], tables,
                                              torch.tensor(lens)), steps)
            rounds.append({"step_ms": {k: v * 1e3 for k, v in step.items()},
                           "attention_ms": {k: v * 1e3 for k, v in attn.items()},
                           **{f"{part}_int8_over_{kv}_kv": t[f"{w}/int8"] / t[f"{w}/auto"]
                              for part, t in (("step", step), ("attention", attn))
                              for w, kv in (("float32", "fp32"), ("bfloat16", "bf16"))}})
        out[f"batch_{batch}"] = {"rounds": rounds, **{
            key: {"min": min(r[key] for r in rounds), "max": max(r[key] for r in rounds)}
            for key in rounds[0] if key.endswith("_kv")}}
        del engines
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=3, help="interleaved timing rounds")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--skip-speed", action="store_true")
    parser.add_argument("--skip-quality", action="store_true",
                        help="only capacity and the decode step")
    parser.add_argument("--out", type=Path, default=RESULTS / "int8_kv.json")
    args = parser.parse_args()
    cpu = cpu_features()
    report: dict[str, Any] = {
        "machine": {"cpu": cpu_paths().describe(), "flags": sorted(cpu.flags & _FLAGS),
                    "kernel_isa": cpu_kernels().isa(), "compute_threads": 1},
        "load_at_start": os.getloadavg()[0],
        "capacity": capacity()}
    if not args.skip_quality:
        report["logprob"] = logprob_difference()
        report["greedy"] = greedy(args.max_tokens)
    if not args.skip_speed:
        report["decode_step"] = step_times(args.runs)
    report["load_at_end"] = os.getloadavg()[0]
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2))
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
