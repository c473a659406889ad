"""How close the planner's predictions land: predicted vs measured per config, workload, load.

    python -m planner.accuracy run --profile P.json --config 1P+1D --out DIR [--calibrate]
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
load levels are 50 % and 80 % of the configuration's predicted maximum rate under that SLO.
Each point is predicted, and written, just before its trace is replayed (with
`--calibrate`, from the profile scaled to probe steps timed right then: `Calibrator`);
nothing measured while serving feeds a prediction. `table` prints the markdown table of
every `run` in DIR with the error summary.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
from collections.abc import Callable, Iterator, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np

from bench.runner import markdown_table
from bench.traces import DEFAULT_VOCAB_RANGE, TraceRequest, arrival_times
from engine import CacheConfig, LLMEngine, SchedulerConfig
from planner.plan import PlanRequest, SloSpec, max_rate, predict, shape_entry, simulate
from planner.profile import LinearModel, Profile, decode_features
from planner.profiler import _Sampler, decode_samples, prefill_samples
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
# A decode-heavy TPOT bound of 3x, not 2x: on this machine's BLAS a batch-2 decode step
# costs ~1.8x a batch-1 step, so a 2x bound is crossed as soon as two answers decode
# together and the point's maximum rate falls near zero (one worker: 0.09 req/s).
SLO_FACTORS = {"prefill-heavy": (3.0, 5.0), "decode-heavy": (3.0, 3.0)}


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


def predict_point(profile: Profile, shape: ClusterShape, name: str, level: float, num: int,
                  seed: int) -> tuple[dict[str, Any], list[SimRequest]]:
    """One (workload, level) point: its SLO, the configuration's maximum rate under it,
    the point's trace at `level` of that rate, and the predicted figures.

    Args:
        seed: the workload's; the point's trace is seeded by it and the level's index.

    Returns:
        The point (JSON-ready) and its trace.
    """
    slo = workload_slo(profile, shape, name, seed)
    shaped = workload(name, num, 1.0, seed + 1)
    top = max_rate(PlanRequest(profile, profile, shaped, slo), shape)
    rate = level * top
    requests = workload(name, num, rate, seed + 10 + LEVELS.index(level))
    predicted = predict(PlanRequest(profile, profile, requests, slo), shape)
    return {"workload": name, "level": level, "rate_rps": rate, "max_rate_rps": top,
            "slo": slo.bounds, "predicted": predicted}, requests


Calibrate = Callable[[], tuple[Profile, dict[str, Any]]]


def predicted_points(profile: Profile, shape: ClusterShape, num: int, seed: int,
                     calibrate: Calibrate | None = None,
                     workloads: Sequence[str] = tuple(WORKLOADS)
                     ) -> Iterator[tuple[dict[str, Any], list[SimRequest]]]:
    """Every (workload, level) point with its trace, each predicted only when it is taken
    from the iterator, that is just before it is replayed.

    With `calibrate` (a `Calibrator`), each point is predicted from the profile as
    calibrated at that moment, so its SLO, its maximum rate and hence its offered rate
    (a fraction of that maximum) follow the machine's speed then: the two levels of a
    workload can get rates that are not exactly 50:80. Its calibration record is the
    point's `calibration`. Nothing measured while serving feeds a prediction.
    """
    for w_index, name in enumerate(WORKLOADS):
        if name not in workloads:
            continue
        for level in LEVELS:
            scaled, calibration = calibrate() if calibrate else (profile, None)
            point, requests = predict_point(scaled, shape, name, level, num, seed + 100 * w_index)
            yield {**point, "calibration": calibration}, requests


# Probe steps: decode-only steps of each batch size at this context per sequence, and a
# prefill of this many new tokens.
PROBE_BATCHES, PROBE_CONTEXT, PROBE_PREFILL = (1, 2, 4, 8), 128, 128
_PROBE_DECODE_STEPS, _PROBE_PREFILL_REPEATS = 8, 5


class Calibrator:
    """Scales a profile to the machine's speed now, as often as asked, on one engine.

    A shared VM's speed drifts (measured here: a batch-8 decode step 40 % slower than 30
    minutes before, with nothing else running), so before each point the run times the
    probe steps (`PROBE_BATCHES`, `PROBE_PREFILL`) on an engine built as the profile's
    was and scales the profile's step models to them (`scale_to_probes`). The engine is
    built once and stays loaded between points (beside the idle server).

    Args:
        profile: the profile as measured; each call scales this one, not the last result.
    """

    def __init__(self, profile: Profile) -> None:
        self.profile = profile
        engine = LLMEngine(profile.model, profile.dtype,
                           cache=CacheConfig(block_size=profile.block_size,
                                             kv_cache_memory_gb=profile.kv_cache_gb),
                           scheduler=SchedulerConfig(max_num_batched_tokens=8192),
                           num_threads=profile.torch_threads)
        self._sampler = _Sampler(engine, np.random.default_rng(17))

    def probe(self) -> dict[str, list[dict[str, Any]]]:
        """Timed probe steps, as `planner.profiler` records samples: `{"decode": [...],
        "prefill": [...]}`."""
        decode = [(batch, PROBE_CONTEXT) for batch in PROBE_BATCHES]
        return {"decode": decode_samples(self._sampler, decode, _PROBE_DECODE_STEPS,
                                         _no_progress),
                "prefill": prefill_samples(self._sampler, [(PROBE_PREFILL, 0, 1)],
                                           _PROBE_PREFILL_REPEATS, _no_progress)}

    def __call__(self) -> tuple[Profile, dict[str, Any]]:
        """The profile scaled to probes timed now, and the calibration record."""
        return scale_to_probes(self.profile, self.probe())


def _no_progress() -> None:
    pass


def scale_to_probes(profile: Profile, probes: dict[str, list[dict[str, Any]]]
                    ) -> tuple[Profile, dict[str, Any]]:
    """The profile with its step models scaled to reproduce timed probe steps.

    Decode: the drift need not slow every batch size alike (measured here: a batch-4 step
    1.9x the profile's while a batch-1 step was 0.95x), so each probed batch size gets its
    own factor. The context term (the KV read) takes the largest probe's factor, measured
    over modelled; each probed batch's table entry then takes the factor that makes its
    probe exact, and the other entries the factor interpolated linearly between the probed
    sizes (the nearest probe's beyond them). Prefill: one factor, median measured over
    modelled. The transfer model, role factor and neighbour slowdown stay the profile's.

    Args:
        profile: the profile as measured, with a decode table (`bN` features) holding
            every probed batch size.
        probes: `Calibrator.probe`'s timed steps.

    Returns:
        The scaled profile and the record: `factors` (`decode_bN` per probed batch,
        `decode_context`, `prefill`), and per probe the median `measured_ms` and the
        profile's `profile_ms`.

    Raises:
        ValueError: the profile's decode model has no table entry for a probed batch.
    """
    features = profile.decode.features
    by_batch: dict[int, list[dict[str, Any]]] = {}
    for sample in probes["decode"]:
        by_batch.setdefault(len(sample["items"]), []).append(sample)
    missing = [b for b in by_batch if f"b{b}" not in features]
    if missing:
        raise ValueError(f"the profile's decode model ({', '.join(features)}) has no entry "
                         f"for batch {missing}: profile again with this version")
    measured, modelled, context = {}, {}, {}
    for batch, samples in sorted(by_batch.items()):
        parts = np.median([_decode_parts(profile.decode, s["items"]) for s in samples], axis=0)
        measured[batch] = float(np.median([s["y"] for s in samples]))
        modelled[batch], context[batch] = float(sum(parts)), float(parts[1])
    largest = max(by_batch)
    factors = {"decode_context": measured[largest] / modelled[largest]}
    for batch in sorted(by_batch):
        table = modelled[batch] - context[batch]
        rest = measured[batch] - factors["decode_context"] * context[batch]
        factors[f"decode_b{batch}"] = rest / table if table > 0 and rest > 0 \
            else factors["decode_context"]
    probed = sorted(by_batch)
    table_factor = [factors[f"decode_b{b}"] for b in probed]
    decode = LinearModel(features, tuple(
        c * (float(np.interp(int(f[1:]), probed, table_factor)) if f[0] == "b"
             else factors["decode_context"]) for f, c in zip(features, profile.decode.coef,
                                                               strict=True)))
    prefill_y = float(np.median([s["y"] for s in probes["prefill"]]))
    prefill_model = float(np.median([profile.step_time(s["items"]) for s in probes["prefill"]]))
    factors["prefill"] = prefill_y / prefill_model
    scaled = replace(profile, decode=decode, prefill=LinearModel(
        profile.prefill.features, tuple(c * factors["prefill"] for c in profile.prefill.coef)))
    record = {"factors": factors,
              "measured_ms": {**{f"decode_b{b}": round(1e3 * v, 2) for b, v in measured.items()},
                              "prefill": round(1e3 * prefill_y, 2)},
              "profile_ms": {**{f"decode_b{b}": round(1e3 * v, 2) for b, v in modelled.items()},
                             "prefill": round(1e3 * prefill_model, 2)}}
    return scaled, record


def _decode_parts(model: LinearModel, items: Sequence[Sequence[Any]]) -> tuple[float, float]:
    """A decode step's modelled seconds: (the batch table's part, the context part)."""
    x = decode_features([start + new for start, new, _ in items], model.features)
    table = sum(c * v for f, c, v in zip(model.features, model.coef, x, strict=True)
                if f[0] == "b")
    return table, model.predict(x) - table


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Predict and measure every point of one configuration; writes DIR/CONFIG.json."""
    profile = Profile.load(args.profile)
    shape = parse_config(args.config)
    calibrate = Calibrator(profile) if args.calibrate else None
    name = f"{args.config}-t{profile.torch_threads}"
    workloads = args.workloads.split(",")
    unknown = set(workloads) - set(WORKLOADS)
    if unknown:
        raise ValueError(f"--workloads: unknown {sorted(unknown)}; known: {list(WORKLOADS)}")
    file_name = name if set(workloads) == set(WORKLOADS) else f"{name}-{'-'.join(workloads)}"
    doc: dict[str, Any] = {"config": name, "profile": str(args.profile),
                           "calibrated": args.calibrate, "model": profile.model,
                           "threads": profile.torch_threads,
                           "num_requests": args.num_requests, "points": []}
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / f"{file_name}.json"

    def due() -> Iterator[tuple[str, list[TraceRequest], SloSpec]]:
        for point, requests in predicted_points(profile, shape, args.num_requests, args.seed,
                                                calibrate, workloads):
            doc["points"].append(point)
            path.write_text(json.dumps(doc, indent=1))  # the prediction, before the replay
            key = f"{point['workload']}-{point['level']:g}"
            print(f"{key}: {point['rate_rps']:.2f} req/s for {requests[-1].arrival:.0f} s; "
                  f"calibration {point['calibration']}", flush=True)
            yield key, trace_requests(requests), SloSpec(point["slo"])

    measured = run_config(shape_entry(shape, profile.torch_threads), profile, due(),
                          args.out / name)
    for point in doc["points"]:
        point["measured"] = measured[f"{point['workload']}-{point['level']:g}"]
        point["error"] = errors(point["predicted"], point["measured"])
    path.write_text(json.dumps(doc, indent=1))
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
    """Markdown: one row per measured point, predicted / measured (error), and the summary
    (a run that stopped early has points predicted but not measured: left out)."""
    headers = ["config", "workload", "load", "req/s", "TTFT p50 ms", "TTFT p90 ms",
               "TPOT p50 ms", "TPOT p90 ms", "attainment", "step ms"]
    rows, latency_errors, attainment_errors = [], [], []
    for doc in docs:
        for point in (p for p in doc["points"] if "measured" in p):
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
    r.add_argument("--workloads", default=",".join(WORKLOADS),
                   help="comma-separated subset of the workloads (each keeps its seed)")
    r.add_argument("--calibrate", action="store_true",
                   help="before each point, scale the profile to the machine's speed then "
                        "(see `Calibrator`)")
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
