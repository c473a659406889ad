"""The analytic planner for Llama-3-8B on an H100 against a published measurement.

    python -m experiments.planner_published [--requests-scale 0.25] [--out OUT.json]

The measurement: NVIDIA's TensorRT-LLM performance overview (`SOURCE`), Llama 3.1 8B FP8
on one H100 SXM 80GB (DGX H100), TP 1, `trtllm-bench throughput` (PyTorch backend, every
request queued at once, fixed input and output lengths, `--kv_cache_free_gpu_mem_fraction`
0.90 or 0.95), total output tokens per second at ten input/output lengths.

The prediction, per point: an analytic profile (`planner.analytic`; H100-SXM from
planner/data/accelerators.yaml, the shipped llama-3-8b config, fp8 weights and KV, TP 1,
a step budget of 8192 tokens, up to 2048 running requests: TensorRT-LLM's defaults) and
the planner's simulator serving one worker the same offline workload (random prompts, so
no prefix hits): output tokens over the time the last request finishes. Llama 3.1 8B has
Llama-3-8B's shapes (layers, widths, heads, vocabulary) and a 128k context; the shipped
config's 8k limit is raised to 128k so the 20000-token point fits.

The published runs use 1,000-30,000 requests a point; the simulation uses
`--requests-scale` of them (at least three full batches) to stay within minutes on two
cores: the offline throughput is a steady state, which a few batches reach.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from dataclasses import replace
from pathlib import Path

import numpy as np

from planner.analytic import StepModel, analytic_profile
from planner.measure import VOCAB
from planner.simulator import ClusterShape, Simulation
from planner.specs import load_accelerator, load_model_shape
from protocol.serving import TraceRequest

SOURCE = {
    "url": "https://github.com/NVIDIA/TensorRT-LLM/blob/"
           "00f37686aa854010d68bcbd0f4ab000221541ca6/docs/source/performance/perf-overview.md",
    "page": "https://nvidia.github.io/TensorRT-LLM/performance/perf-overview.html",
    "table": "Llama 3.1 8B, H100 TP1 (FP8): Total Output Throughput (tokens/sec)",
    "setup": "nvidia/Llama-3.1-8B-Instruct-FP8 (ModelOpt FP8 weights), 1 x H100 SXM 80GB "
             "(DGX H100), TP 1, TensorRT-LLM trtllm-bench throughput, PyTorch backend (the "
             "page's workflow since v0.19; it announces v1.0 data), CUDA graphs with padding "
             "up to batch 8192, every request queued at once, input and output lengths fixed "
             "(stdev 0), KV cache 0.90 or 0.95 of free memory; batch size, token budget and "
             "KV dtype left at their defaults (not stated)",
}
# (input length, output length, requests in the published run, output tokens/s)
POINTS = [(128, 128, 30000, 28312), (128, 2048, 3000, 22714), (128, 4096, 1500, 14325),
          (500, 2000, 3000, 17660), (1000, 1000, 3000, 15220), (1000, 2000, 1500, 13899),
          (2048, 128, 3000, 3450), (2048, 2048, 1500, 9305), (5000, 500, 1500, 3459),
          (20000, 2000, 1000, 1351)]
BUDGET, MAX_SEQS, CONTEXT = 8192, 2048, 131072


def predict(isl: int, osl: int, requests: int, seed: int = 0, model_name: str = "llama-3-8b",
            tp: int = 1) -> dict[str, float]:
    """The simulated offline output throughput of one analytic H100 worker of `tp` GPUs."""
    shape = replace(load_model_shape(model_name), max_position_embeddings=CONTEXT)
    model = StepModel(shape, load_accelerator("H100-SXM"), tp, "fp8", "fp8")
    profile = analytic_profile(model, max_model_len=CONTEXT, max_num_batched_tokens=BUDGET,
                               max_num_seqs=MAX_SEQS)
    fits = profile.num_blocks * profile.block_size // (isl + osl)
    num = max(requests, 3 * min(MAX_SEQS, fits))
    rng = np.random.default_rng(seed)
    trace = [TraceRequest(0.0, osl, rng.integers(*VOCAB, isl).tolist()) for _ in range(num)]
    start = time.process_time()
    result = Simulation(ClusterShape("colocated", 0, 1, BUDGET, MAX_SEQS), profile, profile,
                        seed).run(trace)
    duration = float(np.nanmax(result.finish))
    return {"simulated_requests": num, "kv_tokens": profile.num_blocks * profile.block_size,
            "batch_bound": int(min(MAX_SEQS, fits)),
            "decode_step_ms_at_bound": 1e3 * profile.step_time(
                [(isl + osl // 2, 1, False)] * int(min(MAX_SEQS, fits))),
            "output_tokens_per_s": num * osl / duration,
            "simulation_cpu_s": time.process_time() - start}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests-scale", type=float, default=0.25,
                        help="simulate this share of each published run's requests")
    parser.add_argument("--out", type=Path,
                        default=Path("docs/results/planner_vs_published.json"),
                        help="default docs/results/planner_vs_published.json")
    args = parser.parse_args(argv)
    rows = []
    for isl, osl, published_requests, published in POINTS:
        p = predict(isl, osl, int(published_requests * args.requests_scale))
        error = (p["output_tokens_per_s"] - published) / published
        rows.append({"input_len": isl, "output_len": osl,
                     "published_requests": published_requests,
                     "published_output_tokens_per_s": published, **p, "error": error})
        print(f"{isl}/{osl}: predicted {p['output_tokens_per_s']:,.0f} tok/s, published "
              f"{published:,} ({error:+.1%}; batch bound {p['batch_bound']}, "
              f"{p['simulated_requests']} requests, {p['simulation_cpu_s']:.0f} CPU s)",
              flush=True)
    errors = [abs(r["error"]) for r in rows]
    doc = {"source": SOURCE,
           "prediction": "analytic profile (H100-SXM, llama-3-8b shapes, fp8 weights and KV, "
                         f"TP 1, step budget {BUDGET}, at most {MAX_SEQS} running requests) "
                         "simulated offline on one colocated worker",
           "points": rows,
           "summary": {"median_abs_error": statistics.median(errors), "max_abs_error":
                       max(errors), "median_signed_error":
                       statistics.median(r["error"] for r in rows)}}
    args.out.write_text(json.dumps(doc, indent=1) + "\n")
    print(f"median |error| {doc['summary']['median_abs_error']:.1%}, worst "
          f"{doc['summary']['max_abs_error']:.1%}; wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
