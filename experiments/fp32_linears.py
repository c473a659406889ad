"""The engine's two CPU fp32 linear kernels side by side on SmolLM2's weight shapes.

    python -m experiments.fp32_linears [--runs 3] [--out experiments/results/fp32_linears.json]

`BlasLinear` runs OpenBLAS (`np.matmul` on the `[in, out]` layout) and, with `small_rows`
(CPUs with AVX-512), oneDNN's fp32 GEMM on a prepacked copy for 2 to 16 rows. This
times both kernels on the same weights at the engine's thread counts (OpenBLAS on every
core, torch on the compute threads) at the row counts a step has: 1 (batch-1 decode), 2-16
(verify steps, small batches), 24-512 (batched decode, prefill chunks), for one decoder
layer's four linears and the tied LM head. Back-to-back calls keep OpenBLAS's threads
awake, which a step's calls (glue and attention in between) do not. Kernels
and row counts are interleaved within each run; a run's figure is the median of 7
timings. Every run is reported.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path
from typing import Any

import torch
from threadpoolctl import threadpool_limits
from torch import nn

from engine.hardware import cpu_features, cpu_paths
from engine.models.llama import BlasLinear
from experiments import RESULTS

# SmolLM2-135M: hidden 576, 9 query / 3 KV heads of 64, MLP 1536, vocabulary 49152.
LAYER = {"qkv": (576, 960), "o": (576, 576), "gate_up": (576, 3072), "down": (1536, 576)}
HEAD = (576, 49152)
ROWS = (1, 2, 3, 5, 8, 12, 16, 24, 32, 128, 512)


def _time(fn: Any, x: torch.Tensor, calls: int) -> float:
    fn(x)
    samples = []
    for _ in range(7):
        start = time.perf_counter()
        for _ in range(calls):
            fn(x)
        samples.append((time.perf_counter() - start) / calls)
    return statistics.median(samples) * 1e6


def run(runs: int, out: Path) -> dict[str, Any]:
    cpu = cpu_features()
    torch.set_num_threads(max(cpu.cores - 1, 1))
    threadpool_limits(cpu.cores, user_api="blas")
    gen = torch.Generator().manual_seed(0)
    paths: dict[str, dict[str, BlasLinear]] = {"openblas": {}, "onednn": {}}
    for name, (k, n) in {**LAYER, "lm_head": HEAD}.items():
        weight = torch.randn(n, k, generator=gen) * 0.02
        for path, small_rows in (("openblas", False), ("onednn", True)):
            linear = BlasLinear(nn.Parameter(weight.clone()), small_rows=small_rows)
            linear.SMALL_ROWS = max(ROWS)  # time oneDNN at every row count
            paths[path][name] = linear
    rows_out: list[dict[str, Any]] = []
    for run_index in range(runs):
        for rows in ROWS:
            row: dict[str, Any] = {"run": run_index, "rows": rows}
            order = list(paths) if (run_index + rows) % 2 == 0 else list(paths)[::-1]
            for path in order:
                layer = 0.0
                for name, (k, _) in LAYER.items():
                    x = torch.randn(rows, k, generator=gen)
                    layer += _time(paths[path][name], x, max(4, 2000 // rows))
                x = torch.randn(rows, HEAD[0], generator=gen)
                row[path] = {"layer_us": round(layer, 1),
                             "lm_head_us": round(_time(paths[path]["lm_head"], x,
                                                       max(2, 100 // rows)), 1)}
            for part in ("layer", "lm_head"):
                row[f"{part}_onednn_over_openblas"] = round(
                    row["onednn"][f"{part}_us"] / row["openblas"][f"{part}_us"], 3)
            rows_out.append(row)
            print(json.dumps(row), flush=True)
    summary = {}
    for rows in ROWS:
        mine = [r for r in rows_out if r["rows"] == rows]
        summary[str(rows)] = {
            key: [r[key] for r in mine]
            for key in ("layer_onednn_over_openblas", "lm_head_onednn_over_openblas")}
        one = [r for r in rows_out if r["rows"] == 1]
        summary[str(rows)]["layer_vs_one_row"] = {
            path: [round(r[path]["layer_us"] / o[path]["layer_us"], 2)
                   for r, o in zip(mine, one, strict=True)] for path in paths}
    report = {"cpu": cpu_paths().describe(), "torch_threads": torch.get_num_threads(),
              "blas_threads": cpu.cores, "torch": torch.__version__, "runs": runs,
              "rows": rows_out, "summary": summary}
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2))
    return report


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--out", type=Path, default=RESULTS / "fp32_linears.json")
    args = parser.parse_args()
    print(json.dumps(run(args.runs, args.out)["summary"], indent=1))


if __name__ == "__main__":
    main()
