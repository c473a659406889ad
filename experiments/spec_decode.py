"""Speculative decoding against plain decoding on SmolLM2, in one process on one engine.

    python -m experiments.spec_decode [--runs 3] [--max-tokens 32] [--batch1-prompts 1]
        [--self-draft-layers 28] [--dtype float32|bfloat16]
        [--out experiments/results/spec_decode.json]

Two workloads of chat prompts: `repetitive` (repeat, correct or lightly edit a given text,
where the answer copies the prompt and n-gram drafting shines) and `chat` (open questions
whose answers copy nothing). Each at batch 1 (the first `--batch1-prompts` prompts alone,
one after the other) and batch 8 (all together). Four modes on the same engine and
weights, switched with `LLMEngine.set_speculative_config`: plain, ngram (K = 4, lookup 1-3),
ngram_3 (K = 4, lookup 3, the bounds a config naming only prompt_lookup_max gets) and
self-draft (the first L layers of the target, K = 2). Runs are interleaved (every run
measures every mode of a cell back to back, the order rotating between runs) and all of
them are reported.

Per cell and mode: TPOT (first to last token of each request, over its tokens after the
first, averaged over requests) by the wall clock and by this process's CPU time (the
robust one on a shared machine), tokens per verify step and acceptance rate (from the
engine's counters), and TPOT relative to plain in the same run. Greedy output must be
identical to plain decoding in every run: the driver asserts it.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path
from typing import Any

from engine import LLM, CacheConfig, SamplingParams
from engine.hardware import cpu_paths
from engine.tokenizer import apply_chat_template
from experiments import RESULTS

TEXTS = [
    "The old lighthouse stood at the edge of the cliff for more than a hundred years. Every "
    "night its keeper climbed the narrow stairs, wound the clockwork and lit the lamp, so "
    "that the fishing boats could find their way home through fog and storm.",
    "To make bread, mix four cups of flour with a spoon of salt and a packet of yeast. Add "
    "warm water slowly and knead the dough for ten minutes, until it is smooth. Let it rise "
    "for an hour, shape the loaf, and bake it for forty minutes.",
    "Our team meeting is moved from Tuesday to Thursday at ten in the morning. Please bring "
    "the quarterly report, the updated budget and your notes on the new customer project. "
    "The meeting will take place in the large room on the second floor.",
    "Photosynthesis is the process by which green plants use sunlight, water and carbon "
    "dioxide to make glucose and oxygen. It takes place mainly in the leaves, inside small "
    "structures called chloroplasts, which contain the green pigment chlorophyll.",
]
TASKS = ["Repeat the following text exactly, word for word:",
         "Rewrite the following text, replacing every number written in words with digits:"]
CHATS = [
    "Write a short story about a robot who learns to paint.",
    "What are three good habits for staying healthy? Explain each briefly.",
    "Describe your ideal holiday in a few sentences.",
    "Why do cats purr? Give a short answer.",
    "Give me some ideas for a birthday party for a ten-year-old.",
    "Explain how a bicycle works to a child.",
    "What should I consider when buying a used car?",
    "Write a haiku about autumn and explain it.",
]
# Lookup 1-3 drafts on any repeated token; "ngram_3" (min = max = 3, what a config naming
# only prompt_lookup_max gets) only where the last three tokens occurred before.
NGRAM_3 = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3}
NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3,
         "prompt_lookup_min": 1}


def workloads(llm: LLM) -> dict[str, list[list[int]]]:
    def encode(text: str) -> list[int]:
        return apply_chat_template(llm.tokenizer, [{"role": "user", "content": text}])

    return {"repetitive": [encode(f"{task}\n\n{text}") for text in TEXTS for task in TASKS],
            "chat": [encode(c) for c in CHATS]}


def generate(llm: LLM, prompts: list[list[int]], max_tokens: int
             ) -> tuple[list[list[int]], list[float], list[float]]:
    """Greedy tokens and per-request TPOT, wall and CPU seconds (this process's CPU time:
    what other work on a shared machine takes away from the wall clock does not count), all
    prompts in one batch."""
    engine = llm.engine
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    tokens: dict[str, list[int]] = {}
    first: dict[str, tuple[float, float]] = {}
    last: dict[str, tuple[float, float]] = {}
    for i, prompt in enumerate(prompts):
        engine.add_request(f"x{i}", prompt, params)
        tokens[f"x{i}"] = []
    while engine.has_unfinished_requests():
        outputs = engine.step()
        now = (time.perf_counter(), time.process_time())
        for out in outputs:
            if out.new_token_ids and out.request_id not in first:
                first[out.request_id] = now
            tokens[out.request_id] += out.new_token_ids
            last[out.request_id] = now
    done = [r for r, t in tokens.items() if len(t) > 1]
    wall = [(last[r][0] - first[r][0]) / (len(tokens[r]) - 1) for r in done]
    cpu = [(last[r][1] - first[r][1]) / (len(tokens[r]) - 1) for r in done]
    return list(tokens.values()), wall, cpu


def measure(llm: LLM, prompts: list[list[int]], batch: int, max_tokens: int
            ) -> dict[str, Any]:
    """One mode on one cell: tokens, TPOT and the verification counters' change."""
    before = llm.engine.spec_counters.stats()
    outs, tpots, cpus = [], [], []
    for start in range(0, len(prompts), batch):
        o, t, c = generate(llm, prompts[start:start + batch], max_tokens)
        outs += o
        tpots += t
        cpus += c
    after = llm.engine.spec_counters.stats()
    delta = {k: after[k] - before[k] for k in ("spec_draft_tokens", "spec_accepted_tokens",
                                               "spec_emitted_tokens", "spec_verify_steps")}
    return {"tokens": outs, "tpot_ms": 1e3 * statistics.mean(tpots),
            "cpu_tpot_ms": 1e3 * statistics.mean(cpus),
            "acceptance_rate": delta["spec_accepted_tokens"] / delta["spec_draft_tokens"]
            if delta["spec_draft_tokens"] else None,
            "tokens_per_step": delta["spec_emitted_tokens"] / delta["spec_verify_steps"]
            if delta["spec_verify_steps"] else None}


def run(runs: int, max_tokens: int, self_layers: int, batch1_prompts: int, out: Path,
        dtype: str = "float32") -> dict[str, Any]:
    llm = LLM("smollm2", dtype=dtype, cache=CacheConfig(num_blocks=1024))
    modes = {"plain": None, "ngram": NGRAM, "ngram_3": NGRAM_3,
             "self_draft": {"method": "draft", "model": "self", "draft_layers": self_layers,
                            "num_speculative_tokens": 2}}
    cells: dict[str, list[dict[str, Any]]] = {}
    warmup = workloads(llm)["chat"][:2]
    for config in modes.values():  # first-call costs (allocator, kernels) out of the runs
        llm.engine.set_speculative_config(config)
        generate(llm, warmup, 8)
    for run_index in range(runs):
        shift = run_index % len(modes)
        order = list(modes)[shift:] + list(modes)[:shift]
        for name, prompts in workloads(llm).items():
            for batch in (1, 8):
                cell = prompts[:batch1_prompts] if batch == 1 else prompts
                results = {}
                for mode in order:
                    llm.engine.set_speculative_config(modes[mode])
                    results[mode] = measure(llm, cell, batch, max_tokens)
                llm.engine.set_speculative_config(None)
                plain = results["plain"]
                for mode, r in results.items():
                    if r["tokens"] != plain["tokens"]:
                        raise AssertionError(f"{name} batch {batch} run {run_index}: {mode} "
                                             f"greedy output differs from plain decoding")
                row = {"run": run_index, "order": order,
                       "output_tokens": sum(len(t) for t in plain["tokens"])}
                for mode, r in results.items():
                    row[mode] = {k: v for k, v in r.items() if k != "tokens"}
                    row[mode]["tpot_vs_plain"] = r["tpot_ms"] / plain["tpot_ms"]
                    row[mode]["cpu_tpot_vs_plain"] = r["cpu_tpot_ms"] / plain["cpu_tpot_ms"]
                cells.setdefault(f"{name}/batch{batch}", []).append(row)
                print(json.dumps({"cell": f"{name}/batch{batch}", **row}), flush=True)
        report = {"cpu": cpu_paths().describe(), "model": "smollm2", "dtype": dtype,
                  "max_tokens": max_tokens, "runs": run_index + 1, "greedy_identical": True,
                  "modes": {k: v for k, v in modes.items() if v is not None},
                  "batch1_prompts": batch1_prompts, "cells": cells,
                  "summary": summarize(cells)}
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(report, indent=2))  # after every run: a cut run keeps them
    return report


def summarize(cells: dict[str, list[dict[str, Any]]]) -> dict[str, Any]:
    """Per cell and speculative mode: TPOT vs plain (median, min, max over runs), tokens
    per step and acceptance rate (the same every run: greedy output is deterministic)."""
    out: dict[str, Any] = {}
    for cell, rows in cells.items():
        for mode in ("ngram", "ngram_3", "self_draft"):
            ratios = [r[mode]["tpot_vs_plain"] for r in rows]
            cpu = [r[mode]["cpu_tpot_vs_plain"] for r in rows]
            out.setdefault(cell, {})[mode] = {
                "tpot_vs_plain_median": round(statistics.median(ratios), 3),
                "tpot_vs_plain_range": [round(min(ratios), 3), round(max(ratios), 3)],
                "cpu_tpot_vs_plain_median": round(statistics.median(cpu), 3),
                "cpu_tpot_vs_plain_range": [round(min(cpu), 3), round(max(cpu), 3)],
                "tokens_per_step": rows[0][mode]["tokens_per_step"],
                "acceptance_rate": rows[0][mode]["acceptance_rate"]}
        out[cell]["plain_tpot_ms"] = [round(r["plain"]["tpot_ms"], 1) for r in rows]
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--self-draft-layers", type=int, default=28)
    parser.add_argument("--batch1-prompts", type=int, default=1,
                        help="prompts run alone, one after the other, in the batch-1 cells")
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    parser.add_argument("--out", type=Path, default=RESULTS / "spec_decode.json")
    args = parser.parse_args()
    report = run(args.runs, args.max_tokens, args.self_draft_layers, args.batch1_prompts,
                 args.out, args.dtype)
    print(json.dumps(report["summary"], indent=2))


if __name__ == "__main__":
    main()
