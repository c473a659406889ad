"""Serving experiments: real `pdcluster serve` processes, the `pdcluster bench` load generator.

    python -m experiments.serving disagg-vs-colocated [--model smollm2] [--rates 0.1,0.2,0.3,0.4]
    python -m experiments.serving ladder [--rate 0.3] [--steps static,continuous,...]
    python -m experiments.serving vs-vllm [--rate 0.2]
    python -m experiments.serving bench-serve [--runs 3] [--servers pdcluster,vllm,...]

Each experiment starts its servers as subprocesses (`python -m commands.cli serve ... --grpc-port
0 --http-port 0`, read back from its ready line; vLLM's OpenAI server on a free port,
polled on `/v1/models`), always stops them (SIGINT, then SIGKILL to the process group), and writes
under `experiments/results/serving/<name>/` (`--out` moves the root): one folder per run with
the bench's `report.json` (plus a top-level `utilization` entry: per-worker busy, idle,
transfer_wait, FLOP and bandwidth utilization over the run, from the cumulative counters
in `Status` before and after it), the run's `trace.jsonl` and plots, each server's log, a
`summary.json`, a PNG and `table.md`, the markdown table also printed for
docs/benchmarks.md.

**disagg-vs-colocated.** The same two cores two ways: `--mode disaggregated --prefill 1
--decode 1` against `--mode colocated --decode 2`, `--torch-threads 1` both. The workload
mixes the two request shapes that interfere in a colocated engine: long prompts (1024–2048
tokens, 16–32 output tokens) and short prompts with long answers (64–128 prompt, 128–256
output), half each, Poisson arrivals at each rate of the sweep; every mode sees the same
requests at a given rate, and every rate new ones, so no run hits a prefix cached by an
earlier one. One server per mode serves the whole sweep.

The SLO comes from the colocated mode unloaded: a few requests of each class sent one at a
time (after a warm-up). The mix is bimodal, so a p50 over all of it would land between the
classes and fail one whole class even unloaded; instead each class's p50 is taken and the
slowest class sets the bar:

    TTFT SLO = ttft_factor (3) x max over classes of the unloaded p50 TTFT
    TPOT SLO = tpot_factor (2) x max over classes of the unloaded p50 TPOT

Why 3x and 2x (`--ttft-factor`, `--tpot-factor`): TTFT is mostly queueing once loaded; 3x
lets a long prompt wait behind about one other long prefill (the unloaded time itself plus
one more) with slack for the transfer, and no more: a TTFT that grows without bound with
the rate fails it. 2x TPOT tolerates a modestly bigger decode batch and catches what
stretches a short answer most: a prefill of another request in the same step (colocated),
the very interference disaggregation removes. (Where small-batch GEMM is slow, as on AVX2
CPUs under MKL, batching alone can also cost 2x; docs/benchmarks.md measures it.)
They are DistServe's style of SLO (a scale times the unloaded latency), tight enough to
separate the modes.
A single pair judges both classes (the bench's SLO is global), so the TTFT bar is lax for
short prompts; their TPOT is what the mix tests.

**ladder.** One workload (half shared-prefix requests: 4 system prompts of 768 tokens plus
32–128 own tokens, 64–128 output; a quarter long prompts; a quarter long answers), one
server per step, each step adding one technique: static batching -> continuous batching ->
+ a bounded admission queue (`--max-running`, `--max-queue`) -> + prefix caching -> +
disaggregation (1 prefill + 1 decode instead of 2 colocated) -> + an INT8 KV cache ->
+ speculative decoding (n-gram prompt lookup, 4 tokens), using `serve --policy
static|continuous`, `--no-prefix-caching`, `--kv-cache-dtype int8` and
`--speculative-config`. The SLO comes from the first step's server
unloaded, as above; each step reports throughput, goodput, TTFT/TPOT p90 and where its
workers' time went. Requests the bounded queue refuses (429 / RESOURCE_EXHAUSTED) count as
failed: they lower SLO attainment, and what they buy shows as the admitted requests'
latency and goodput.

**vs-vllm.** pdcluster (disaggregated 1+1) and vLLM's CPU build (`.venv-vllm`, made by
`experiments/setup_vllm_cpu.sh`) serve the same workload through the same OpenAI client
(`--backend openai`, streaming `/v1/completions`); one server at a time, since they share
the cores. The table gives pdcluster's metrics as ratios to vLLM's.

**bench-serve** (`make bench-serve`). The fixed protocol of the comparison with `vllm
serve`, each server at its own defaults: pdcluster 1P+1D (`serve`'s defaults: dtype auto,
one thread a worker, the SLO's TTFT bound ordering the workers' queues), pdcluster with
2 colocated workers (the same), vLLM-CPU at its defaults (bf16, even where the CPU
emulates it; 4 GiB of KV; chunked prefill) and vLLM at float32 (its better setting on
CPUs without native bf16). The long/short mix above at two loads, light (0.1 req/s) and
interfering (0.25 req/s: long prompts queue and, colocated, stretch the decodes), judged by
one fixed SLO, TTFT p90 10 s and TPOT p90 150 ms, the same for all. Each server serves
every run: `--runs` (3) runs of each load, run i of a load the same requests for every
server (new ones for each run and load, so no prefix is cached from an earlier one). The
table gives every run's goodput and attainment per server and the ratios pdcluster /
vLLM (defaults), pdcluster / vLLM fp32 and disaggregated / colocated, run by run.

`--model tiny --length-scale 0.25 --num-requests 4` is a quick plumbing check (the tiny
model's context is 1024 tokens).
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass, fields, replace
from pathlib import Path
from typing import Any, TypeVar

import numpy as np
from matplotlib.figure import Figure

from bench.loadgen import RequestRecord
from bench.report import compare_reports, fmt
from bench.run import RunSettings, Target, bench_run
from bench.serving_metrics import succeeded, tpot, ttft
from bench.traces import WorkloadSpec, arrival_times, make_workload
from commands.launch import pdcluster_serve
from experiments import REPO_ROOT, RESULTS
from experiments.runner import markdown_table, pct, vllm_serve
from protocol.defaults import MAX_QUEUE, MAX_RUNNING
from protocol.serving import Slo, TraceRequest
from protocol.status import UTILIZATION_KEYS

DEFAULT_OUT = RESULTS / "serving"
DEFAULT_VLLM_PYTHON = REPO_ROOT / ".venv-vllm" / "bin" / "python"
# Every rung runs float32 weights, whatever `--dtype auto` would pick on the machine.
COLOCATED = ("--mode", "colocated", "--decode", "2", "--torch-threads", "1",
             "--dtype", "float32")
DISAGGREGATED = ("--mode", "disaggregated", "--prefill", "1", "--decode", "1",
                 "--torch-threads", "1", "--dtype", "float32")
# `serve`'s own admission defaults: far above what these workloads ever hold.
UNBOUNDED_ADMISSION = ("--max-running", str(MAX_RUNNING), "--max-queue", str(MAX_QUEUE))
# The ladder's last rungs: the KV cache in int8, then n-gram drafting of 4 tokens a step.
INT8_KV = ("--kv-cache-dtype", "int8")
NGRAM = ("--speculative-config",
         '{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4}')
# Seed purposes, so warm-up, probe and measured runs never share prompts (or cached prefixes).
_WARMUP, _PROBE, _RUN = 0, 1, 2
T = TypeVar("T")


# ---- workloads ----

@dataclass(frozen=True)
class RequestClass:
    """One kind of request in a mix.

    Args:
        name: labels its requests in reports (`request_classes`).
        weight: its share of the requests (weights are normalized).
        spec: lengths and prefixes (its `seed` is replaced per run).
    """

    name: str
    weight: float
    spec: WorkloadSpec


def pd_mix(length_scale: float = 1.0, long_fraction: float = 0.5) -> list[RequestClass]:
    """The disagg-vs-colocated mix: long prompts with short answers, short with long answers.

    Args:
        length_scale: multiplies every token length (e.g. 0.25 to fit the tiny model).
        long_fraction: share of long-prompt requests.

    Returns:
        Two classes, `long-prompt` and `long-output`.
    """
    if not 0 <= long_fraction <= 1:
        raise ValueError(f"long_fraction must be in [0, 1], got {long_fraction}")
    return [
        RequestClass("long-prompt", long_fraction, WorkloadSpec(
            "long-prompt", _scaled((1024, 2048), length_scale), _scaled((16, 32), length_scale))),
        RequestClass("long-output", 1 - long_fraction, WorkloadSpec(
            "long-output", _scaled((64, 128), length_scale), _scaled((128, 256), length_scale))),
    ]


def ladder_mix(length_scale: float = 1.0) -> list[RequestClass]:
    """The ladder's mix: half shared-prefix requests, a quarter each long prompt, long answer.

    Args:
        length_scale: multiplies every token length.

    Returns:
        Three classes, `shared-prefix`, `long-prompt` and `long-output`.
    """
    prefix_len = _scaled((768, 768), length_scale)[0]
    return [
        RequestClass("shared-prefix", 0.5, WorkloadSpec(
            "shared-prefix", _scaled((32, 128), length_scale), _scaled((64, 128), length_scale),
            num_prefix_groups=4, prefix_len=prefix_len)),
        RequestClass("long-prompt", 0.25, WorkloadSpec(
            "long-prompt", _scaled((1024, 1536), length_scale), _scaled((16, 32), length_scale))),
        RequestClass("long-output", 0.25, WorkloadSpec(
            "long-output", _scaled((64, 128), length_scale), _scaled((128, 256), length_scale))),
    ]


def build_mix(classes: Sequence[RequestClass], timestamps: Sequence[float],
              seed: int) -> tuple[list[TraceRequest], list[str]]:
    """One request per arrival, its class drawn by weight, its content by `make_workload`.

    Args:
        classes: the mix.
        timestamps: non-decreasing arrival times in seconds.
        seed: seeds the class draw and every class's prompts.

    Returns:
        The requests in arrival order and each one's class name.
    """
    weights = np.asarray([c.weight for c in classes], dtype=np.float64)
    if not len(classes) or (weights < 0).any() or not weights.sum() > 0:
        raise ValueError("a mix needs at least one class and non-negative weights, not all 0")
    rng = np.random.default_rng(derive_seed(seed, len(classes)))
    drawn = rng.choice(len(classes), size=len(timestamps), p=weights / weights.sum())
    return _assemble(classes, [float(t) for t in timestamps], drawn.tolist(), seed)


def probe_mix(classes: Sequence[RequestClass], per_class: int,
              seed: int) -> tuple[list[TraceRequest], list[str]]:
    """`per_class` requests of every class (weight > 0), round robin, all due at once.

    Sent with a concurrency of 1 they measure each class unloaded.

    Args:
        classes: the mix.
        per_class: requests of each class.
        seed: seeds the prompts.

    Returns:
        The requests and each one's class name.
    """
    kinds = [i for i, c in enumerate(classes) if c.weight > 0]
    order = [kind for _ in range(per_class) for kind in kinds]
    return _assemble(classes, [0.0] * len(order), order, seed)


def derive_seed(*keys: int) -> int:
    """An independent 32-bit seed for a tuple of integers (run, purpose, class...)."""
    return int(np.random.SeedSequence(list(keys)).generate_state(1)[0])


def _assemble(classes: Sequence[RequestClass], timestamps: list[float], kinds: list[int],
              seed: int) -> tuple[list[TraceRequest], list[str]]:
    requests: list[TraceRequest | None] = [None] * len(kinds)
    for k, request_class in enumerate(classes):
        where = [i for i, kind in enumerate(kinds) if kind == k]
        if not where:
            continue
        # A seed per class: two classes from one seed would draw the same ids, so a short
        # prompt would be a prefix of a long one and hit the prefix cache.
        spec = replace(request_class.spec, seed=derive_seed(seed, k))
        for i, request in zip(where, make_workload(spec, [timestamps[i] for i in where]),
                              strict=True):
            requests[i] = request
    return [r for r in requests if r is not None], [classes[k].name for k in kinds]


def _scaled(bounds: tuple[int, int], scale: float) -> tuple[int, int]:
    if not scale > 0:
        raise ValueError(f"length_scale must be > 0, got {scale}")
    return max(1, round(bounds[0] * scale)), max(1, round(bounds[1] * scale))


# ---- SLO from an unloaded run ----

def report_records(report: dict[str, Any]) -> list[RequestRecord]:
    """The request records of a loaded `report.json`."""
    names = {f.name for f in fields(RequestRecord)}
    return [RequestRecord(**{k: v for k, v in r.items() if k in names})
            for r in report["requests"]]


def unloaded_latency(report: dict[str, Any]) -> dict[str, dict[str, float | None]]:
    """Per request class, the p50 TTFT and TPOT (ms) of an unloaded run's requests.

    Args:
        report: a run whose `config.request_classes` names each request's class (without
            it every request is one class, `all`).

    Returns:
        `{class: {"ttft_ms", "tpot_ms", "num_requests"}}`; `tpot_ms` is None when no request
        of the class had two output tokens.

    Raises:
        ValueError: a request failed, or none succeeded; an SLO from that would mean nothing.
    """
    records = report_records(report)
    failed = [r.index for r in records if not succeeded(r)]
    if failed or not records:
        raise ValueError(f"the unloaded run must succeed entirely to set an SLO; requests "
                         f"{failed or 'none'} failed (see {report.get('label')!r})")
    labels = report["config"].get("request_classes") or ["all"] * len(records)
    groups: dict[str, list[RequestRecord]] = {}
    for record in records:
        groups.setdefault(labels[record.index], []).append(record)
    latency: dict[str, dict[str, float | None]] = {}
    for name, group in groups.items():
        tpots = [t for r in group if (t := tpot(r)) is not None]
        latency[name] = {"ttft_ms": float(np.median([ttft(r) for r in group])) * 1e3,
                         "tpot_ms": float(np.median(tpots)) * 1e3 if tpots else None,
                         "num_requests": len(group)}
    return latency


def derive_slo(report: dict[str, Any], ttft_factor: float, tpot_factor: float) -> Slo:
    """The SLO: each factor times the slowest class's unloaded p50 (see the module docstring).

    Args:
        report: the unloaded run (see `unloaded_latency`).
        ttft_factor: TTFT SLO / unloaded p50 TTFT.
        tpot_factor: TPOT SLO / unloaded p50 TPOT.

    Returns:
        Per-request `ttft_ms` and `tpot_ms` bounds (no TPOT bound when no class has a TPOT).
    """
    if not ttft_factor > 0 or not tpot_factor > 0:
        raise ValueError(f"SLO factors must be > 0, got {ttft_factor} and {tpot_factor}")
    latency = unloaded_latency(report)
    ttft_ms = max(float(c["ttft_ms"] or 0.0) for c in latency.values())
    tpots = [c["tpot_ms"] for c in latency.values() if c["tpot_ms"] is not None]
    bounds = {"ttft_ms": ttft_factor * ttft_ms}
    if tpots:
        bounds["tpot_ms"] = tpot_factor * max(tpots)
    return Slo(bounds)


# ---- tables ----

# The SLO figures (`protocol.slo`, a bench summary's `figures`) the experiment tables show.
_FIGURES = ("goodput_rps", "attainment", "ttft_p50_ms", "ttft_p90_ms", "tpot_p50_ms",
            "tpot_p90_ms")


def run_metrics(summary: dict[str, Any]) -> dict[str, Any]:
    """The figures the experiment tables show, from a bench summary."""
    return {
        "completed": summary["completed"], "failed": summary["failed"],
        "request_throughput": summary["request_throughput"],
        "output_throughput": summary["output_throughput"],
        **{key: summary["figures"][key] for key in _FIGURES},
        "breakdown_ms": _breakdown_means(summary.get("breakdown")),
    }


def _breakdown_means(breakdown: dict[str, Any] | None) -> dict[str, float | None] | None:
    """The mean ms of each part of a run's time breakdown (None over the OpenAI API)."""
    return None if breakdown is None else {
        part: stats["mean"] for part, stats in breakdown["ms"].items()}


def ratio(value: float | None, base: float | None) -> float | None:
    """`value / base`, or None when either is missing or `base` is zero."""
    if value is None or base is None or base == 0:
        return None
    return value / base


def sweep_rows(colocated: Sequence[dict[str, Any]], disaggregated: Sequence[dict[str, Any]]
               ) -> list[dict[str, Any]]:
    """Pair the two modes' runs by rate; `goodput_ratio` is disaggregated / colocated.

    Args:
        colocated: `run_metrics` plus `rate` of each colocated run.
        disaggregated: the same for the disaggregated runs.

    Returns:
        One row per rate run by both modes, in the colocated sweep's order:
        `{"rate", "colocated", "disaggregated", "goodput_ratio"}`.
    """
    by_rate = {run["rate"]: run for run in disaggregated}
    rows = []
    for run in colocated:
        other = by_rate.get(run["rate"])
        if other is not None:
            rows.append({"rate": run["rate"], "colocated": run, "disaggregated": other,
                         "goodput_ratio": ratio(other["goodput_rps"], run["goodput_rps"])})
    return rows


def sweep_markdown(rows: Sequence[dict[str, Any]]) -> str:
    """The disagg-vs-colocated table (C: colocated, D: disaggregated)."""
    headers = ["rate (req/s)", "goodput C (req/s)", "goodput D (req/s)", "D / C",
               "SLO att. C", "SLO att. D", "TTFT p90 C / D (ms)", "TPOT p90 C / D (ms)",
               "out tok/s C / D"]
    lines = []
    for row in rows:
        c, d = row["colocated"], row["disaggregated"]
        lines.append([
            fmt(row["rate"]), fmt(c["goodput_rps"]), fmt(d["goodput_rps"]),
            fmt(row["goodput_ratio"], "x"), pct(c["attainment"]), pct(d["attainment"]),
            f"{fmt(c['ttft_p90_ms'])} / {fmt(d['ttft_p90_ms'])}",
            f"{fmt(c['tpot_p90_ms'])} / {fmt(d['tpot_p90_ms'])}",
            f"{fmt(c['output_throughput'])} / {fmt(d['output_throughput'])}"])
    return markdown_table(headers, lines)


def ladder_markdown(steps: Sequence[dict[str, Any]]) -> str:
    """The ladder table: one row per step, with its run's metrics and mean utilization."""
    headers = ["step", "req/s", "out tok/s", "goodput (req/s)", "goodput × prev",
               "SLO att.", "failed", "TTFT p90 (ms)", "TPOT p90 (ms)", "busy",
               "transfer wait", "idle", "FLOP util.", "BW util."]
    lines, previous = [], None
    for step in steps:
        m, util = step["metrics"], step.get("utilization_mean") or {}
        lines.append([
            step["title"], fmt(m["request_throughput"]), fmt(m["output_throughput"]),
            fmt(m["goodput_rps"]), fmt(ratio(m["goodput_rps"], previous), "x"),
            pct(m["attainment"]), str(m["failed"]), fmt(m["ttft_p90_ms"]),
            fmt(m["tpot_p90_ms"]), *(pct(util.get(k)) for k in UTILIZATION_KEYS)])
        previous = m["goodput_rps"]
    return markdown_table(headers, lines)


def comparison_markdown(rows: Sequence[dict[str, Any]], labels: Sequence[str]) -> str:
    """`bench.report.compare_reports` rows as a table: values and the ratio to the first.

    Rows with no value at all (goodput without an SLO) are left out.
    """
    headers = ["metric", *labels, f"{labels[-1]} / {labels[0]}"]
    lines = [[row["metric"], *(fmt(v) for v in row["values"]), fmt(row["ratios"][-1], "x")]
             for row in rows if any(v is not None for v in row["values"])]
    return markdown_table(headers, lines)



def warm_up(target: Target, classes: Sequence[RequestClass], settings: RunSettings,
            seed: int) -> None:
    """One request of each class, one at a time, not recorded (first-call costs)."""
    requests, labels = probe_mix(classes, 1, derive_seed(seed, _WARMUP))
    report = bench_run(target, requests, labels, label="warm-up", out=None, settings=settings,
                       max_concurrency=1)
    if report["summary"]["failed"]:
        errors = {r["error"] for r in report["requests"] if r["error"]}
        raise RuntimeError(f"warm-up requests failed: {errors}")


def unloaded_run(target: Target, classes: Sequence[RequestClass], per_class: int,
                 settings: RunSettings, seed: int, out: Path, label: str) -> dict[str, Any]:
    """`per_class` requests of each class, one at a time: the unloaded latencies."""
    requests, labels = probe_mix(classes, per_class, derive_seed(seed, _PROBE))
    return bench_run(target, requests, labels, label=label, out=out, settings=settings,
                     max_concurrency=1, extra_config={"rate": None, "unloaded": True})


def rate_run(target: Target, classes: Sequence[RequestClass], rate: float, num_requests: int,
             settings: RunSettings, seed: int, index: int, out: Path, label: str,
             slo: Slo | None) -> dict[str, Any]:
    """`num_requests` of the mix arriving Poisson at `rate`; run `index` picks the prompts."""
    run_seed = derive_seed(seed, _RUN, index)
    timestamps = arrival_times(num_requests, rate, "poisson", 1.0, run_seed)
    requests, labels = build_mix(classes, timestamps.tolist(), run_seed)
    return bench_run(target, requests, labels, label=label, out=out, settings=settings,
                     slo=slo, extra_config={"rate": rate, "num_requests": num_requests,
                                            "seed": seed, "run_index": index})


# ---- experiment 1: disaggregated vs colocated ----

def disagg_vs_colocated(args: argparse.Namespace) -> dict[str, Any]:
    """The rate sweep on both modes (see the module docstring).

    Returns:
        The summary written to summary.json.
    """
    root = args.out / "disagg-vs-colocated"
    classes = pd_mix(args.length_scale, args.long_fraction)
    settings = _settings(args, "disagg-vs-colocated")
    modes = {"colocated": [*COLOCATED, *args.serve_args],
             "disaggregated": [*DISAGGREGATED, *args.serve_args]}
    slo, slo_info = args.slo, {"given": args.slo is not None}
    results: dict[str, dict[str, Any]] = {}
    # Colocated first: its unloaded run sets the SLO both sweeps are judged by.
    for mode, flags in modes.items():
        runs: list[dict[str, Any]] = []
        results[mode] = {"serve_flags": flags, "unloaded": None, "runs": runs}
        with pdcluster_serve(args.model, flags, root / mode / "serve.log",
                             args.ready_timeout) as endpoints:
            target = Target("grpc", endpoints.grpc, endpoints.grpc)
            warm_up(target, classes, settings, args.seed)
            if args.num_unloaded:
                unloaded = unloaded_run(target, classes, args.num_unloaded, settings, args.seed,
                                        root / mode / "unloaded", f"{mode} unloaded")
                results[mode]["unloaded"] = unloaded_latency(unloaded)
                if slo is None:
                    slo = derive_slo(unloaded, args.ttft_factor, args.tpot_factor)
                    slo_info.update(from_mode=mode, ttft_factor=args.ttft_factor,
                                    tpot_factor=args.tpot_factor,
                                    unloaded_p50=results[mode]["unloaded"])
                    print(f"SLO: TTFT <= {fmt(slo.bound('ttft'))} ms, "
                          f"TPOT <= {fmt(slo.bound('tpot'))} ms", flush=True)
            for index, rate in enumerate(args.rates):
                report = rate_run(target, classes, rate, args.num_requests, settings,
                                  args.seed, index, root / mode / f"rate-{rate:g}",
                                  f"{mode} {rate:g} req/s", slo)
                runs.append({"rate": rate, "report": str(root / mode / f"rate-{rate:g}"),
                             **run_metrics(report["summary"]),
                             "utilization": report["utilization"]})
    rows = sweep_rows(results["colocated"]["runs"], results["disaggregated"]["runs"])
    summary = {"experiment": "disagg-vs-colocated", "model": args.model,
               "rates": args.rates, "num_requests": args.num_requests, "seed": args.seed,
               "length_scale": args.length_scale, "classes": _describe(classes),
               "slo": {**(slo.as_dict() if slo else {}), **slo_info}, "modes": results,
               "table": rows}
    plot_sweep(root / "goodput_vs_rate.png", results, slo)
    _finish(root, summary, sweep_markdown(rows))
    return summary


def plot_sweep(path: Path, results: dict[str, dict[str, Any]], slo: Slo | None) -> Path:
    """Goodput and SLO attainment against the offered rate, one line per mode.

    Args:
        path: the PNG.
        results: per mode, `{"runs": [{"rate", "goodput_rps", "attainment", ...}]}`.
        slo: shown in the title.

    Returns:
        `path`.
    """
    figure = Figure(figsize=(11, 4), layout="constrained")
    goodput_axes, attainment_axes = figure.subplots(1, 2)
    rates = sorted({run["rate"] for mode in results.values() for run in mode["runs"]})
    goodput_axes.plot(rates, rates, ":", color="gray", label="offered rate")
    for mode, result in results.items():
        runs = sorted(result["runs"], key=lambda run: run["rate"])
        x = [run["rate"] for run in runs]
        goodput_axes.plot(x, [run["goodput_rps"] or 0 for run in runs], "o-", label=mode)
        attainment_axes.plot(x, [run["attainment"] or 0 for run in runs], "o-", label=mode)
    goodput_axes.set(xlabel="offered rate (req/s)", ylabel="goodput (req/s)", ylim=(0, None))
    attainment_axes.set(xlabel="offered rate (req/s)", ylabel="SLO attainment", ylim=(0, 1.05))
    for axes in (goodput_axes, attainment_axes):
        axes.grid(alpha=0.3)
        axes.legend()
    if slo is not None:
        figure.suptitle(f"disaggregated vs colocated · SLO TTFT <= {fmt(slo.bound('ttft'))} "
                        f"ms, TPOT <= {fmt(slo.bound('tpot'))} ms")
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=100)
    return path


# ---- experiment 2: the ladder ----

@dataclass(frozen=True)
class LadderStep:
    """One rung: a name, its table title and the serve flags it runs with."""

    name: str
    title: str
    flags: tuple[str, ...]


def ladder_steps(max_running: int, max_queue: int) -> list[LadderStep]:
    """Static -> continuous -> + bounded admission -> + prefix caching -> + disaggregation
    -> + INT8 KV cache -> + speculative decoding.

    Args:
        max_running: the bounded steps' `--max-running`.
        max_queue: the bounded steps' `--max-queue`.

    Returns:
        The seven steps, in order.
    """
    static, continuous = ("--policy", "static"), ("--policy", "continuous")
    no_cache = ("--no-prefix-caching",)
    bounded = ("--max-running", str(max_running), "--max-queue", str(max_queue))
    return [
        LadderStep("static", "static batching",
                   (*COLOCATED, *static, *no_cache, *UNBOUNDED_ADMISSION)),
        LadderStep("continuous", "continuous batching",
                   (*COLOCATED, *continuous, *no_cache, *UNBOUNDED_ADMISSION)),
        LadderStep("admission", "+ bounded admission queue",
                   (*COLOCATED, *continuous, *no_cache, *bounded)),
        LadderStep("prefix-caching", "+ prefix caching", (*COLOCATED, *continuous, *bounded)),
        LadderStep("disaggregation", "+ disaggregation (1P + 1D)",
                   (*DISAGGREGATED, *continuous, *bounded)),
        LadderStep("int8-kv", "+ INT8 KV cache",
                   (*DISAGGREGATED, *continuous, *bounded, *INT8_KV)),
        LadderStep("speculative", "+ speculative decoding (n-gram, 4 tokens)",
                   (*DISAGGREGATED, *continuous, *bounded, *INT8_KV, *NGRAM)),
    ]


def ladder(args: argparse.Namespace) -> dict[str, Any]:
    """Each step's own server on the same workload (see the module docstring).

    Returns:
        The summary written to summary.json.
    """
    root = args.out / "ladder"
    classes = ladder_mix(args.length_scale)
    settings = _settings(args, "ladder")
    steps = _chosen(ladder_steps(args.max_running, args.max_queue), args.steps, "--steps")
    slo, slo_info = args.slo, {"given": args.slo is not None}
    results = []
    for step in steps:
        flags = [*step.flags, *args.serve_args]
        with pdcluster_serve(args.model, flags, root / step.name / "serve.log",
                             args.ready_timeout) as endpoints:
            target = Target("grpc", endpoints.grpc, endpoints.grpc)
            warm_up(target, classes, settings, args.seed)
            if slo is None:  # the first step's server, unloaded, sets the SLO for all
                unloaded = unloaded_run(target, classes, args.num_unloaded, settings,
                                        args.seed, root / step.name / "unloaded",
                                        f"{step.name} unloaded")
                slo = derive_slo(unloaded, args.ttft_factor, args.tpot_factor)
                slo_info.update(from_step=step.name, ttft_factor=args.ttft_factor,
                                tpot_factor=args.tpot_factor,
                                unloaded_p50=unloaded_latency(unloaded))
                print(f"SLO: TTFT <= {fmt(slo.bound('ttft'))} ms, "
                      f"TPOT <= {fmt(slo.bound('tpot'))} ms", flush=True)
            # Index 0 for every step: the same requests at the same times.
            report = rate_run(target, classes, args.rate, args.num_requests, settings,
                              args.seed, 0, root / step.name, step.title, slo)
        utilization = report["utilization"] or {}
        results.append({"name": step.name, "title": step.title, "serve_flags": flags,
                        "report": str(root / step.name),
                        "metrics": run_metrics(report["summary"]),
                        "utilization_mean": utilization.get("mean"),
                        "utilization_by_role": utilization.get("by_role")})
    summary = {"experiment": "ladder", "model": args.model, "rate": args.rate,
               "num_requests": args.num_requests, "seed": args.seed,
               "length_scale": args.length_scale, "classes": _describe(classes),
               "slo": {**(slo.as_dict() if slo else {}), **slo_info}, "steps": results}
    plot_ladder(root / "ladder.png", results)
    _finish(root, summary, ladder_markdown(results))
    return summary


def plot_ladder(path: Path, steps: Sequence[dict[str, Any]]) -> Path:
    """Throughput and goodput per step, and the workers' mean time breakdown per step.

    Args:
        path: the PNG.
        steps: the ladder's results (`title`, `metrics`, `utilization_mean`).

    Returns:
        `path`.
    """
    figure = Figure(figsize=(12, 4.2), layout="constrained")
    rate_axes, time_axes = figure.subplots(1, 2)
    x = np.arange(len(steps))
    titles = [step["title"] for step in steps]
    for offset, key, name in ((-0.2, "request_throughput", "throughput"),
                              (0.2, "goodput_rps", "goodput")):
        rate_axes.bar(x + offset, [step["metrics"][key] or 0 for step in steps], 0.4,
                      label=name)
    rate_axes.set(ylabel="requests/s", title="throughput and goodput")
    bottom = np.zeros(len(steps))
    for key in ("busy", "transfer_wait", "idle"):
        values = np.array([(step["utilization_mean"] or {}).get(key, 0.0) for step in steps])
        time_axes.bar(x, values, 0.6, bottom=bottom, label=key.replace("_", " "))
        bottom += values
    time_axes.set(ylabel="fraction of wall time (mean over workers)", ylim=(0, 1.05),
                  title="where the workers' time went")
    for axes in (rate_axes, time_axes):
        axes.set_xticks(x, titles, rotation=20, ha="right")
        axes.grid(alpha=0.3, axis="y")
        axes.legend()
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=100)
    return path


def _chosen(items: list[T], names: Sequence[str] | None, flag: str) -> list[T]:
    """The `items` (ladder steps, servers) whose `name` is in `names`, all when None.

    Raises:
        ValueError: a name none of them has, naming `flag` and the choices.
    """
    if not names:
        return items
    known = [item.name for item in items]
    unknown = [name for name in names if name not in known]
    if unknown:
        raise ValueError(f"{flag}: unknown {', '.join(unknown)}; choose from "
                         f"{', '.join(known)}")
    return [item for item, name in zip(items, known, strict=True) if name in names]


# ---- experiment 3: against vLLM ----

def vs_vllm(args: argparse.Namespace) -> dict[str, Any]:
    """The same workload through the OpenAI API of pdcluster and of vLLM-CPU.

    Returns:
        The summary written to summary.json.

    Raises:
        ValueError: vLLM's venv is missing.
    """
    if not args.vllm_python.is_file():
        raise ValueError(f"vs-vllm needs vLLM's CPU build in the venv of {args.vllm_python}; "
                         "create it with `make setup-vllm` (experiments/setup_vllm_cpu.sh) or "
                         "pass --vllm-python")
    from engine.model_loader import resolve_model_dir

    root = args.out / "vs-vllm"
    classes = pd_mix(args.length_scale, args.long_fraction)
    settings = _settings(args, "vs-vllm")
    model_dir = resolve_model_dir(args.model)
    flags = [*DISAGGREGATED, *args.serve_args]
    reports = {}
    with pdcluster_serve(args.model, flags, root / "pdcluster" / "serve.log",
                         args.ready_timeout) as endpoints:
        target = Target("openai", endpoints.http, endpoints.grpc)
        warm_up(target, classes, settings, args.seed)
        reports["pdcluster"] = rate_run(target, classes, args.rate, args.num_requests,
                                        settings, args.seed, 0, root / "pdcluster",
                                        "pdcluster", args.slo)
    with vllm_serve(args.vllm_python, model_dir, root / "vllm" / "serve.log",
                    args.vllm_kv_cache_gb, args.vllm_args, args.vllm_ready_timeout) as base_url:
        target = Target("openai", base_url)
        warm_up(target, classes, settings, args.seed)
        reports["vllm"] = rate_run(target, classes, args.rate, args.num_requests, settings,
                                   args.seed, 0, root / "vllm", "vLLM", args.slo)
    rows = compare_reports([reports["vllm"], reports["pdcluster"]])
    summary = {"experiment": "vs-vllm", "model": args.model, "model_dir": str(model_dir),
               "rate": args.rate, "num_requests": args.num_requests, "seed": args.seed,
               "length_scale": args.length_scale, "classes": _describe(classes),
               "slo": None if args.slo is None else args.slo.as_dict(),
               "pdcluster_flags": flags, "vllm_args": list(args.vllm_args),
               "reports": {name: str(root / name) for name in reports},
               "comparison": rows}
    plot_ratios(root / "vs_vllm.png", rows, "pdcluster / vLLM")
    _finish(root, summary, comparison_markdown(rows, ["vLLM", "pdcluster"]))
    return summary


def plot_ratios(path: Path, rows: Sequence[dict[str, Any]], title: str) -> Path:
    """Each metric's ratio to the baseline as a bar from 1, on a log axis.

    Args:
        path: the PNG.
        rows: `bench.report.compare_reports` rows (the last report against the first).
        title: the figure's title.

    Returns:
        `path`.
    """
    shown = [row for row in rows if row["ratios"][-1]]
    figure = Figure(figsize=(8, 0.4 * len(shown) + 1.5), layout="constrained")
    axes = figure.subplots()
    y = np.arange(len(shown))
    better = ["tab:green" if (row["ratios"][-1] >= 1) == row["higher_is_better"] else "tab:red"
              for row in shown]
    ratios = [row["ratios"][-1] for row in shown]
    # Bars grow from 1 (no difference) to the ratio, left or right.
    axes.barh(y, [r - 1 for r in ratios], left=1.0, color=better)
    for i, r in enumerate(ratios):
        axes.annotate(f"{r:.2f}x", (r, i), xytext=(4 if r >= 1 else -4, 0),
                      textcoords="offset points", va="center", ha="left" if r >= 1 else "right")
    axes.axvline(1.0, color="black", linewidth=1)
    axes.set_yticks(y, [row["metric"] for row in shown])
    axes.set_xscale("log")
    axes.margins(x=0.2)  # room for the labels
    axes.invert_yaxis()
    axes.set(xlabel="ratio (green: better than the baseline)", title=title)
    axes.grid(alpha=0.3, axis="x")
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=100)
    return path


# ---- experiment 4: the fixed comparison with `vllm serve` ----

BENCH_SERVE_SLO = "ttft_p90_ms=10000,tpot_p90_ms=150"
BENCH_SERVE_RATES = (0.1, 0.25)  # light, interfering


@dataclass(frozen=True)
class Server:
    """One server of `bench-serve`, at its own defaults.

    Args:
        name: its label in the tables.
        kind: `pdcluster` or `vllm`.
        flags: more `serve` flags (pdcluster) or `vllm serve` flags.
        dtype: vLLM's `--dtype`; None: its default.
    """

    name: str
    kind: str
    flags: tuple[str, ...] = ()
    dtype: str | None = None


def bench_serve_servers(slo: Slo) -> list[Server]:
    """The four servers `bench-serve` compares; pdcluster's are told the SLO (`--slo`), as
    an operator would, which orders their workers' queues."""
    told = ("--slo", slo.text())
    return [Server("pdcluster", "pdcluster", ("--prefill", "1", "--decode", "1", *told)),
            Server("pdcluster-colocated", "pdcluster",
                   ("--mode", "colocated", "--decode", "2", *told)),
            Server("vllm", "vllm"),
            Server("vllm-fp32", "vllm", dtype="float32")]


def bench_serve(args: argparse.Namespace) -> dict[str, Any]:
    """Every server through the same OpenAI client on the same runs (module docstring).

    Returns:
        The summary written to summary.json.

    Raises:
        ValueError: an unknown server name, or vLLM's venv missing for a vLLM server.
    """
    root = args.out / "bench-serve"
    servers = _chosen(bench_serve_servers(args.slo), args.servers, "--servers")
    if any(s.kind == "vllm" for s in servers) and not args.vllm_python.is_file():
        raise ValueError(f"bench-serve needs vLLM's CPU build in the venv of "
                         f"{args.vllm_python}: `make setup-vllm`, or leave the vLLM servers "
                         "out (--servers pdcluster,pdcluster-colocated)")
    from engine.hardware import cpu_paths
    from engine.model_loader import resolve_model_dir

    classes = pd_mix(args.length_scale, 0.5)
    settings = _settings(args, "bench-serve")
    runs: dict[str, list[dict[str, Any]]] = {}
    errors: dict[str, str] = {}
    for server in servers:
        runs[server.name] = []
        try:
            with _serving(server, args, root / server.name / "serve.log") as target:
                warm_up(target, classes, settings, args.seed)
                for run in range(args.runs):
                    for i, rate in enumerate(args.rates):
                        out = root / server.name / f"run-{run + 1}-rate-{rate:g}"
                        report = rate_run(target, classes, rate, args.num_requests, settings,
                                          args.seed, run * len(args.rates) + i, out,
                                          f"{server.name} run {run + 1} {rate:g} req/s",
                                          args.slo)
                        runs[server.name].append({"run": run + 1, "rate": rate,
                                                  "report": str(out),
                                                  **run_metrics(report["summary"])})
        except RuntimeError as e:  # a server that fails to start or to answer its warm-up
            errors[server.name] = str(e)
            print(f"{server.name}: {e}; the other servers go on", flush=True)
    rows = bench_serve_rows(runs)
    summary = {"experiment": "bench-serve", "model": args.model,
               "model_dir": str(resolve_model_dir(args.model)), "cpu": cpu_paths().describe(),
               "rates": list(args.rates), "runs": args.runs, "num_requests": args.num_requests,
               "seed": args.seed, "length_scale": args.length_scale,
               "classes": _describe(classes), "slo": args.slo.as_dict(),
               "servers": [asdict(s) for s in servers], "errors": errors, "results": runs,
               "table": rows}
    _finish(root, summary, bench_serve_markdown(rows, [s.name for s in servers]))
    return summary


@contextmanager
def _serving(server: Server, args: argparse.Namespace, log_path: Path) -> Iterator[Target]:
    """The server running, as the OpenAI client reaches it."""
    if server.kind == "vllm":
        from engine.model_loader import resolve_model_dir

        with vllm_serve(args.vllm_python, resolve_model_dir(args.model), log_path,
                        args.vllm_kv_cache_gb, server.flags, args.vllm_ready_timeout,
                        dtype=server.dtype) as base_url:
            yield Target("openai", base_url)
        return
    with pdcluster_serve(args.model, [*server.flags, *args.serve_args], log_path,
                         args.ready_timeout) as endpoints:
        yield Target("openai", endpoints.http, endpoints.grpc)


# (ratio name, numerator server, denominator server)
BENCH_SERVE_RATIOS = (("pdcluster / vLLM", "pdcluster", "vllm"),
                      ("pdcluster / vLLM fp32", "pdcluster", "vllm-fp32"),
                      ("disagg. / coloc.", "pdcluster", "pdcluster-colocated"))


def bench_serve_rows(runs: dict[str, list[dict[str, Any]]]) -> list[dict[str, Any]]:
    """One row per (rate, run): each server's figures and the goodput ratios of the servers
    that ran it (None where one is missing or the denominator's goodput is 0)."""
    keys = sorted({(r["rate"], r["run"]) for rs in runs.values() for r in rs})
    rows = []
    for rate, run in keys:
        figures = {name: next((r for r in rs if (r["rate"], r["run"]) == (rate, run)), None)
                   for name, rs in runs.items()}
        goodput = {name: None if f is None else f["goodput_rps"] for name, f in figures.items()}
        rows.append({"rate": rate, "run": run, "servers": figures,
                     "ratios": {label: ratio(goodput.get(a), goodput.get(b))
                                for label, a, b in BENCH_SERVE_RATIOS}})
    return rows


def bench_serve_markdown(rows: Sequence[dict[str, Any]], names: Sequence[str]) -> str:
    """Goodput (req/s) and SLO attainment of every server in every run, and the ratios."""
    ratios = [label for label, a, b in BENCH_SERVE_RATIOS if a in names and b in names]
    headers = ["req/s", "run", *(f"{n} goodput / att." for n in names), *ratios]
    lines = []
    for row in rows:
        cells = []
        for name in names:
            f = row["servers"].get(name)
            cells.append("-" if f is None else f"{fmt(f['goodput_rps'])} / {pct(f['attainment'])}")
        lines.append([fmt(row["rate"]), str(row["run"]), *cells,
                      *(fmt(row["ratios"][label], "x") for label in ratios)])
    return markdown_table(headers, lines)


# ---- shared ----

def _settings(args: argparse.Namespace, experiment: str) -> RunSettings:
    return RunSettings(args.request_timeout, {
        "experiment": experiment, "model": args.model, "length_scale": args.length_scale,
        "serve_args": list(args.serve_args)})


def _describe(classes: Sequence[RequestClass]) -> list[dict[str, Any]]:
    return [{"name": c.name, "weight": c.weight,
             **{k: v for k, v in asdict(c.spec).items() if k not in ("seed", "vocab_range")}}
            for c in classes]


def _finish(root: Path, summary: dict[str, Any], table: str) -> None:
    root.mkdir(parents=True, exist_ok=True)
    (root / "summary.json").write_text(json.dumps(summary, indent=1, default=str))
    (root / "table.md").write_text(table + "\n")
    print(f"\n{table}\n\nwrote {root}/summary.json, table.md and plots", flush=True)


def build_parser() -> argparse.ArgumentParser:
    """The `python -m experiments.serving` command line."""
    parser = argparse.ArgumentParser(
        prog="python -m experiments.serving", description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="experiment", required=True)
    common, slo = _common_flags(), _slo_flags()

    sweep = sub.add_parser("disagg-vs-colocated", parents=[common, slo],
                           help="goodput over a rate sweep, disaggregated 1P+1D vs colocated 2")
    sweep.add_argument("--rates", type=_rates, default=[0.1, 0.2, 0.3, 0.4],
                       help="offered rates in req/s, comma-separated (default 0.1,0.2,0.3,0.4)")
    sweep.add_argument("--long-fraction", type=float, default=0.5,
                       help="share of long-prompt requests (default 0.5)")
    sweep.set_defaults(func=disagg_vs_colocated)

    steps = sub.add_parser("ladder", parents=[common, slo],
                           help="static -> continuous -> admission -> prefix cache -> disagg")
    steps.add_argument("--rate", type=_positive, default=0.3, help="req/s (default 0.3)")
    steps.add_argument("--steps", type=lambda text: text.split(","), metavar="A,B",
                       help="run only these steps (static, continuous, admission, "
                            "prefix-caching, disaggregation, int8-kv, speculative)")
    steps.add_argument("--max-running", type=int, default=8,
                       help="bounded steps: serve --max-running (default 8)")
    steps.add_argument("--max-queue", type=int, default=8,
                       help="bounded steps: serve --max-queue (default 8)")
    steps.set_defaults(func=ladder)

    vllm = _vllm_flags()
    peer = sub.add_parser("vs-vllm", parents=[common, vllm],
                          help="pdcluster 1P+1D vs vLLM-CPU through the OpenAI API")
    peer.add_argument("--rate", type=_positive, default=0.2, help="req/s (default 0.2)")
    peer.add_argument("--long-fraction", type=float, default=0.5,
                      help="share of long-prompt requests (default 0.5)")
    peer.add_argument("--slo", type=Slo.parse, metavar="ttft=MS,tpot=MS",
                      help="objectives for goodput (default: none)")
    peer.set_defaults(func=vs_vllm)

    fixed = sub.add_parser("bench-serve", parents=[common, vllm],
                           help="the fixed comparison with vllm serve (make bench-serve)")
    fixed.add_argument("--servers", type=lambda text: text.split(","), metavar="A,B",
                       help="only these servers (pdcluster, pdcluster-colocated, vllm, "
                            "vllm-fp32; default all)")
    fixed.add_argument("--rates", type=_rates, default=list(BENCH_SERVE_RATES),
                       help="loads in req/s (default 0.1,0.25: light, interfering)")
    fixed.add_argument("--runs", type=_positive_int, default=3,
                       help="runs of each load on each server (default 3)")
    fixed.add_argument("--slo", type=Slo.parse, default=Slo.parse(BENCH_SERVE_SLO),
                       metavar="KEY=MS,...", help=f"the SLO (default {BENCH_SERVE_SLO})")
    fixed.set_defaults(func=bench_serve, num_requests=30)
    return parser


def _common_flags() -> argparse.ArgumentParser:
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--model", default="smollm2", help="serve --model (default smollm2)")
    common.add_argument("--num-requests", type=_positive_int, default=40,
                        help="requests per measured run (default 40; bench-serve 30)")
    common.add_argument("--seed", type=int, default=0, help="seeds prompts and arrivals")
    common.add_argument("--length-scale", type=_positive, default=1.0,
                        help="multiply every token length (0.25 fits the tiny model)")
    common.add_argument("--out", type=Path, default=DEFAULT_OUT,
                        help="results root (default experiments/results/serving)")
    common.add_argument("--serve-args", type=shlex.split, default=[], metavar="'FLAGS'",
                        help="more flags for every pdcluster serve, e.g. "
                             "'--max-num-batched-tokens 512'")
    common.add_argument("--ready-timeout", type=float, default=300.0,
                        help="seconds to wait for pdcluster serve (default 300)")
    common.add_argument("--request-timeout", type=float, default=600.0,
                        help="seconds before a request counts as failed (default 600)")
    return common


def _vllm_flags() -> argparse.ArgumentParser:
    vllm = argparse.ArgumentParser(add_help=False)
    vllm.add_argument("--vllm-python", type=Path, default=DEFAULT_VLLM_PYTHON,
                      help="python of vLLM's venv (default .venv-vllm/bin/python)")
    vllm.add_argument("--vllm-kv-cache-gb", type=float, default=4,
                      help="VLLM_CPU_KVCACHE_SPACE (default 4)")
    vllm.add_argument("--vllm-args", type=shlex.split, default=[], metavar="'FLAGS'",
                      help="more `vllm serve` flags (vs-vllm)")
    vllm.add_argument("--vllm-ready-timeout", type=float, default=600.0,
                      help="seconds to wait for vLLM to serve (default 600)")
    return vllm


def _slo_flags() -> argparse.ArgumentParser:
    slo = argparse.ArgumentParser(add_help=False)
    slo.add_argument("--slo", type=Slo.parse, metavar="ttft=MS,tpot=MS",
                     help="fixed objectives instead of ones derived from the unloaded run")
    slo.add_argument("--ttft-factor", type=_positive, default=3.0,
                     help="TTFT SLO = this x the unloaded p50 TTFT (default 3)")
    slo.add_argument("--tpot-factor", type=_positive, default=2.0,
                     help="TPOT SLO = this x the unloaded p50 TPOT (default 2)")
    slo.add_argument("--num-unloaded", type=int, default=3,
                     help="unloaded requests per class (default 3; 0 skips the unloaded "
                          "run, which needs --slo)")
    return slo


def _positive(text: str) -> float:
    value = float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be > 0, got {text}")
    return value


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {text}")
    return value


def _rates(text: str) -> list[float]:
    try:
        return [_positive(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected rates like 0.1,0.2, got {text!r}") from None


def main(argv: list[str] | None = None) -> int:
    """Run one experiment.

    Returns:
        0; 2 for flags that do not fit together or a missing peer; 1 when a server failed.
    """
    args = build_parser().parse_args(argv)
    if getattr(args, "num_unloaded", 1) < 1 and getattr(args, "slo", None) is None:
        print("error: --num-unloaded 0 needs --slo (there is no unloaded run to derive it "
              "from)", file=sys.stderr)
        return 2
    try:
        args.func(args)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except RuntimeError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
