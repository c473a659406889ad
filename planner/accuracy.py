"""How close the planner's predictions land: predicted vs measured per config, workload, load.

    python -m planner.accuracy run --profile P.json --config 1P+1D --out DIR
    python -m planner.accuracy table --out DIR

`run` serves one configuration (`1P+1D`: disaggregated; `2C`: colocated) once and replays
two workloads at two load levels on it: a prefill-heavy one (longer prompts, few output
tokens; prompts above the local-prefill threshold, so disaggregated configs prefill them
remotely) and a decode-heavy one (short prompts prefilled on the decode worker, longer
answers). Sizes suit SmolLM2 on one CPU core (a 128-token prompt takes about 0.4 s there).
Each point is its own seeded Poisson trace of `--num-requests` requests with
fresh random prompts (no prefix hits across points).

The SLO of each workload is DistServe-style: `SLO_FACTORS` times the configuration's
predicted unloaded p50 TTFT and TPOT (TTFT p90 and TPOT p90 bounds, attainment 0.9). The
load levels are 50 % and 80 % of the configuration's predicted maximum rate under that SLO. The
predictions are made (and written) before the server starts; nothing measured feeds back.
`table` prints the markdown table of every `run` in DIR with the error summary.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np

from bench.runner import markdown_table
from bench.traces import DEFAULT_VOCAB_RANGE, arrival_times
from planner.plan import PlanRequest, SloSpec, config_entry, max_rate, predict, simulate
from planner.profile import LinearModel, Profile
from planner.simulator import ClusterShape, SimRequest
from planner.validate import errors, run_config, trace_requests

# (prompt_len, output_len) ranges, inclusive.
WORKLOADS = {"prefill-heavy": ((80, 160), (8, 16)), "decode-heavy": ((16, 48), (24, 48))}
# Prompts of the prefill-heavy workload are all above it, the decode-heavy ones all below.
LOCAL_PREFILL_THRESHOLD = 64
LEVELS = (0.5, 0.8)
_LATENCIES = ("ttft_p50_ms", "ttft_p90_ms", "tpot_p50_ms", "tpot_p90_ms")


def parse_config(text: str) -> ClusterShape:
    """`1P+1D` or `2C`.

    Raises:
        ValueError: neither form.
    """
    if m := re.fullmatch(r"(\d+)P\+(\d+)D", text):
        return ClusterShape("disaggregated", int(m[1]), int(m[2]),
                            local_prefill_threshold=LOCAL_PREFILL_THRESHOLD)
    if m := re.fullmatch(r"(\d+)C", text):
        return ClusterShape("colocated", 0, int(m[1]))
    raise ValueError(f"config: expected like 1P+1D or 2C, got {text!r}")


def workload(name: str, num: int, rate: float, seed: int) -> list[SimRequest]:
    """`num` requests of a workload arriving Poisson at `rate`."""
    (p_lo, p_hi), (o_lo, o_hi) = WORKLOADS[name]
    rng = np.random.default_rng((seed, 7))
    times = arrival_times(num, rate, "poisson", 1.0, seed)
    return [SimRequest(float(t), rng.integers(*DEFAULT_VOCAB_RANGE,
                                              int(rng.integers(p_lo, p_hi + 1))).tolist(),
                       int(rng.integers(o_lo, o_hi + 1))) for t in times]


# SLO per workload: multiples of the predicted unloaded p50 TTFT and TPOT. A prefill-heavy
# workload (summaries, retrieval) cares about its first token more than its pace.
SLO_FACTORS = {"prefill-heavy": (3.0, 5.0), "decode-heavy": (3.0, 2.0)}


def workload_slo(profile: Profile, shape: ClusterShape, name: str, seed: int) -> SloSpec:
    """`SLO_FACTORS` times the predicted unloaded p50 TTFT and TPOT (one request at a
    time)."""
    probe = workload(name, 20, 1e-3, seed)  # 1000 s apart: never two at once
    base = PlanRequest(profile, profile, probe, SloSpec({"ttft_p90_ms": 1e9}), 4,
                       find_max_rate=False)
    result = simulate(base, shape)
    ttft, tpot = float(np.median(result.ttft)), float(np.nanmedian(result.tpot))
    ttft_factor, tpot_factor = SLO_FACTORS[name]
    return SloSpec({"ttft_p90_ms": round(1e3 * ttft_factor * ttft, 1),
                    "tpot_p90_ms": round(1e3 * tpot_factor * tpot, 1)})


def predict_points(profile: Profile, shape: ClusterShape, num: int, seed: int
                   ) -> list[dict[str, Any]]:
    """Every (workload, level) point with its trace and predicted figures."""
    points = []
    for w_index, name in enumerate(WORKLOADS):
        slo = workload_slo(profile, shape, name, seed + 100 * w_index)
        shaped = workload(name, num, 1.0, seed + 100 * w_index + 1)
        top = max_rate(PlanRequest(profile, profile, shaped, slo), shape)
        for l_index, level in enumerate(LEVELS):
            rate = level * top
            requests = workload(name, num, rate, seed + 100 * w_index + 10 + l_index)
            request = PlanRequest(profile, profile, requests, slo)
            points.append({"workload": name, "level": level, "rate_rps": rate,
                           "max_rate_rps": top, "slo": slo.bounds,
                           "predicted": predict(request, shape), "requests": requests})
    return points


# Reference steps of `calibrate`: decode (batch, context) and prefill new tokens.
_PROBE_DECODE, _PROBE_PREFILL = (4, 128), 128


def calibrate(profile: Profile) -> tuple[Profile, dict[str, float]]:
    """The profile scaled to the machine's speed right now.

    A shared VM's speed drifts (measured here: a batch-8 decode step 40 % slower than 30
    minutes before, with nothing else running), so a run times a few reference steps on an
    engine built as the profile's was, just before its server starts, and scales the
    decode and prefill models by measured / modelled. The models' shapes (how time grows
    with batch, context and tokens) stay the profile's.

    Returns:
        The scaled profile and the two factors.
    """
    from engine import CacheConfig, LLMEngine, SchedulerConfig
    from planner.profiler import _Sampler, decode_samples, prefill_samples

    engine = LLMEngine(profile.model, profile.dtype,
                       cache=CacheConfig(block_size=profile.block_size,
                                         kv_cache_memory_gb=profile.kv_cache_gb),
                       scheduler=SchedulerConfig(max_num_batched_tokens=8192),
                       num_threads=profile.torch_threads)
    sampler = _Sampler(engine, np.random.default_rng(17))
    batch, context = _PROBE_DECODE
    decode = [s["y"] for s in decode_samples(sampler, [_PROBE_DECODE], 8, lambda: None)]
    prefill = [s["y"] for s in prefill_samples(sampler, [(_PROBE_PREFILL, 0, 1)], 5,
                                               lambda: None)]
    factors = {
        "decode": float(np.median(decode)) / profile.step_time([(context, 1, False)] * batch),
        "prefill": float(np.median(prefill)) / profile.step_time([(0, _PROBE_PREFILL, True)])}
    del engine, sampler
    scaled = replace(profile, decode=_scaled(profile.decode, factors["decode"]),
                     prefill=_scaled(profile.prefill, factors["prefill"]))
    return scaled, factors


def _scaled(model: LinearModel, factor: float) -> LinearModel:
    return LinearModel(model.features, tuple(c * factor for c in model.coef))


def run(args: argparse.Namespace) -> dict[str, Any]:
    profile = Profile.load(args.profile)
    factors = None
    if args.calibrate:
        profile, factors = calibrate(profile)
        print(f"calibrated to this machine now: step models x {factors}", flush=True)
    shape = parse_config(args.config)
    points = predict_points(profile, shape, args.num_requests, args.seed)
    base = PlanRequest(profile, profile, points[0]["requests"], SloSpec({"ttft_p90_ms": 1}))
    config = config_entry(base, shape, points[0]["predicted"])
    name = f"{args.config}-t{profile.torch_threads}"
    total_s = sum(p["requests"][-1].arrival for p in points)
    print(f"{name}: {len(points)} points, about {total_s:.0f} s of arrivals", flush=True)
    runs = {f"{p['workload']}-{p['level']:g}": (trace_requests(p["requests"]),
                                               SloSpec(p["slo"])) for p in points}
    measured = run_config(config, profile, runs, args.out / name)
    for point, key in zip(points, runs, strict=True):
        point["measured"] = measured[key]
        point["error"] = errors(point["predicted"], measured[key])
        del point["requests"]
    doc = {"config": name, "profile": str(args.profile), "calibration": factors,
           "model": profile.model,
           "threads": profile.torch_threads, "num_requests": args.num_requests,
           "points": points}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"{name}.json").write_text(json.dumps(doc, indent=1))
    print(table([doc]))
    return doc


def _cell(point: dict[str, Any], key: str) -> str:
    p, m, e = point["predicted"][key], point["measured"][key], point["error"][key]
    if key == "attainment":
        return f"{p:.0%} / {m:.0%} ({e * 100:+.0f} pt)"
    if m is None or p is None or e is None:
        return "-"
    return f"{p:.0f} / {m:.0f} ({e:+.0%})"


def _step(point: dict[str, Any]) -> str:
    p, m = point["predicted"].get("mean_step_ms"), point["measured"].get("mean_step_ms")
    return "-" if p is None or m is None else f"{p:.0f} / {m:.0f}"


def table(docs: list[dict[str, Any]]) -> str:
    """Markdown: one row per point, predicted / measured (error), and the summary."""
    headers = ["config", "workload", "load", "req/s", "TTFT p50 ms", "TTFT p90 ms",
               "TPOT p50 ms", "TPOT p90 ms", "attainment", "step ms"]
    rows, latency_errors, attainment_errors = [], [], []
    for doc in docs:
        for point in doc["points"]:
            rows.append([doc["config"], point["workload"], f"{point['level']:.0%}",
                         f"{point['rate_rps']:.2f}",
                         *(_cell(point, key) for key in (*_LATENCIES, "attainment")),
                         _step(point)])
            latency_errors += [abs(point["error"][k]) for k in _LATENCIES
                               if point["error"][k] is not None]
            attainment_errors.append(abs(point["error"]["attainment"]))
    text = markdown_table(headers, rows)
    if latency_errors:
        text += (f"\n\n{len(rows)} points; latency figures: median absolute error "
                 f"{statistics.median(latency_errors):.1%}, worst {max(latency_errors):.1%}, "
                 f"{sum(e > 0.25 for e in latency_errors)} of {len(latency_errors)} over 25 %; "
                 f"attainment: worst difference {max(attainment_errors) * 100:.1f} points")
    return text


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    r = sub.add_parser("run", help="predict, then measure, one configuration")
    r.add_argument("--profile", type=Path, required=True)
    r.add_argument("--config", required=True, help="1P+1D or 2C")
    r.add_argument("--num-requests", type=int, default=100)
    r.add_argument("--seed", type=int, default=0)
    r.add_argument("--calibrate", action="store_true",
                   help="scale the profile to the machine's speed now (see `calibrate`)")
    r.add_argument("--out", type=Path, required=True)
    t = sub.add_parser("table", help="the markdown table of every run in --out")
    t.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)
    if args.command == "run":
        run(args)
    else:
        docs = [json.loads(p.read_text()) for p in sorted(args.out.glob("*.json"))]
        print(table(docs))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
