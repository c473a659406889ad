"""How close the planner's predictions land: predicted vs measured per config, workload, load.

    python -m experiments.planner_accuracy run --profile P.json --config 1P+1D \
        [--out experiments/results/planner_accuracy] [--calibrate engine|serving] \
        [--pilot-requests N]
    python -m experiments.planner_accuracy table [--out DIR] [--during] [--resimulate]

`run` serves one configuration (`1P+1D`: disaggregated; `2C`: colocated) once and replays
two workloads at two load levels on it: a prefill-heavy one (longer prompts, few output
tokens; prompts above the local-prefill threshold, so disaggregated configs prefill them
remotely) and a decode-heavy one (short prompts prefilled on the decode worker, longer
answers). Sizes suit SmolLM2 on one CPU core (a 128-token prompt takes about 0.4 s there).
Each point is its own seeded Poisson trace of `--num-requests` requests with
fresh random prompts (no prefix hits across points).

The SLO of each workload is DistServe-style: `SLO_FACTORS` times the configuration's
predicted unloaded p50 TTFT and TPOT (TTFT p90 and TPOT p90 bounds, attainment 0.9), set
at the workload's first point and held for the run. The load levels are 50 % and 80 % of
the configuration's predicted maximum rate under that SLO.
Each point is predicted, and written, just before its trace is replayed (with
`--calibrate`, from the profile scaled to probe steps timed right then:
`planner.calibrate.Calibrator` on a bare engine,
`commands.serving_calibration.ServingCalibrator` on the serving
workers, which also pools the steps of the workload's last replay, or of a pilot replay
before its first point);
nothing measured from a point's own trace feeds its prediction. After the replay each
point is also predicted from the machine's speed *during* it (`predict_during`: not a
forecast, the simulator's error apart from the machine's drift). `table` prints the
markdown table of every `run` in DIR with the error summary (`--during`: of those;
`--resimulate`: every point predicted again by this version's simulator from the
calibration the run kept).
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from bench.run import Target, status_snapshot
from bench.traces import arrival_times
from commands.serving_calibration import ServingCalibrator
from commands.validate import errors, run_config
from experiments import RESULTS
from experiments.runner import markdown_table
from planner.calibrate import Calibrator, replay_window, scale_to_steps, scaled_by_record
from planner.plan import PlanRequest, max_rate, predict, shape_entry, simulate
from planner.profile import Profile
from planner.simulator import ClusterShape
from protocol.serving import DEFAULT_VOCAB_RANGE, Slo, TraceRequest

# (prompt_len, output_len) ranges, inclusive.
WORKLOADS = {"prefill-heavy": ((80, 160), (8, 16)), "decode-heavy": ((16, 48), (24, 48))}
# Prompts of the prefill-heavy workload are all above it, the decode-heavy ones all below.
LOCAL_PREFILL_THRESHOLD = 64
LEVELS = (0.5, 0.8)
_PILOT_SEED = 50  # a pilot trace's seed, past the workload's own seed and its points'
_LATENCIES = ("ttft_p50_ms", "ttft_p90_ms", "tpot_p50_ms", "tpot_p90_ms")
DEFAULT_OUT = RESULTS / "planner_accuracy"


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


def random_request(rng: np.random.Generator, kind: tuple[tuple[int, int], tuple[int, int]],
                   arrival: float) -> TraceRequest:
    """A request of random tokens arriving at `arrival`, its prompt and output lengths drawn
    uniformly from `kind`'s (prompt tokens, output tokens) inclusive ranges (the prompt
    first, then the output length)."""
    (p_lo, p_hi), (o_lo, o_hi) = kind
    prompt = rng.integers(*DEFAULT_VOCAB_RANGE, int(rng.integers(p_lo, p_hi + 1)))
    output_len = int(rng.integers(o_lo, o_hi + 1))
    return TraceRequest(float(arrival), output_len, prompt.tolist())


def workload(name: str, num: int, rate: float, seed: int) -> list[TraceRequest]:
    """`num` requests of a workload arriving Poisson at `rate`."""
    rng = np.random.default_rng((seed, 7))
    times = arrival_times(num, rate, "poisson", 1.0, seed)
    return [random_request(rng, WORKLOADS[name], t) for t in times]


# SLO per workload: multiples of the predicted unloaded p50 TTFT and TPOT. A prefill-heavy
# workload (summaries, retrieval) cares about its first token more than its pace.
# The decode-heavy TPOT bound must not fall on a plateau of the step-time curve: on this
# machine's BLAS a decode step of batch 2, 3 or 4 all cost 2.6-3.1x a batch-1 step
# (measured: 77-97 ms against 28-32 ms), so a 2x bound is crossed as soon as two answers
# decode together (one worker's maximum rate: 0.09 req/s), and a 3x bound splits answers
# that decoded beside two others from those beside three: the measured attainment then
# moved 7-10 points with a 4-6 % drift in speed. 4x lies on the slope beyond batch 8.
SLO_FACTORS = {"prefill-heavy": (3.0, 5.0), "decode-heavy": (3.0, 4.0)}


def workload_slo(profile: Profile, shape: ClusterShape, name: str, seed: int) -> Slo:
    """`SLO_FACTORS` times the predicted unloaded p50 TTFT and TPOT (one request at a
    time)."""
    probe = workload(name, 20, 1e-3, seed)  # 1000 s apart: never two at once
    base = PlanRequest(profile, profile, probe, Slo({"ttft_p90_ms": 1e9}), 4,
                       find_max_rate=False)
    result = simulate(base, shape)
    ttft, tpot = float(np.median(result.ttft)), float(np.nanmedian(result.tpot))
    ttft_factor, tpot_factor = SLO_FACTORS[name]
    return Slo({"ttft_p90_ms": round(1e3 * ttft_factor * ttft, 1),
                "tpot_p90_ms": round(1e3 * tpot_factor * tpot, 1)})


def predict_point(profile: Profile, shape: ClusterShape, name: str, level: float, num: int,
                  seed: int, slo: Slo | None = None
                  ) -> tuple[dict[str, Any], list[TraceRequest]]:
    """One (workload, level) point: its SLO, the configuration's maximum rate under it,
    the point's trace at `level` of that rate, and the predicted figures.

    Args:
        seed: the workload's; the point's trace is seeded by it and the level's index.
        slo: the workload's SLO; None: `workload_slo` on this profile.

    Returns:
        The point (JSON-ready) and its trace.
    """
    slo = slo if slo is not None else workload_slo(profile, shape, name, seed)
    shaped = workload(name, num, 1.0, seed + 1)
    top = max_rate(PlanRequest(profile, profile, shaped, slo), shape)
    rate = level * top
    requests = workload(name, num, rate, seed + 10 + LEVELS.index(level))
    predicted = predict(PlanRequest(profile, profile, requests, slo), shape)
    return {"workload": name, "level": level, "rate_rps": rate, "max_rate_rps": top,
            "slo": slo.bounds, "predicted": predicted}, requests


Calibrate = Callable[[str], tuple[Profile, dict[str, Any]]]  # given the workload due


def predicted_points(profile: Profile, shape: ClusterShape, num: int, seed: int,
                     calibrate: Calibrate | None = None,
                     workloads: Sequence[str] = tuple(WORKLOADS)
                     ) -> Iterator[tuple[dict[str, Any], list[TraceRequest]]]:
    """Every (workload, level) point with its trace, each predicted only when it is taken
    from the iterator, that is just before it is replayed.

    With `calibrate` (a `Calibrator` or `ServingCalibrator`, given the point's workload),
    each point is predicted from the profile as calibrated at that moment, so its maximum
    rate and hence its offered rate (a fraction of that maximum) follow the machine's
    speed then: the two levels of a workload can get rates that are not exactly 50:80.
    A workload's SLO is set once, at its first point (from that calibration), and held
    for its other points, as an operator's would be. Its calibration record is the
    point's `calibration`. Nothing measured from a point's own replay feeds its prediction.
    """
    for w_index, name in enumerate(WORKLOADS):
        if name not in workloads:
            continue
        slo = None
        for level in LEVELS:
            scaled, calibration = calibrate(name) if calibrate else (profile, None)
            point, requests = predict_point(scaled, shape, name, level, num,
                                            seed + 100 * w_index, slo)
            slo = Slo(point["slo"])
            yield {**point, "calibration": calibration}, requests


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Predict and measure every point of one configuration; writes DIR/CONFIG.json."""
    profile = Profile.load(args.profile)
    shape = parse_config(args.config)
    engine_calibrator = Calibrator(profile) if args.calibrate == "engine" else None
    name = f"{args.config}-t{profile.torch_threads}"
    workloads = args.workloads.split(",")
    unknown = set(workloads) - set(WORKLOADS)
    if unknown:
        raise ValueError(f"--workloads: unknown {sorted(unknown)}; known: {list(WORKLOADS)}")
    file_name = name if set(workloads) == set(WORKLOADS) else f"{name}-{'-'.join(workloads)}"
    doc: dict[str, Any] = {"config": name, "profile": str(args.profile), "seed": args.seed,
                           "calibrated": args.calibrate, "model": profile.model,
                           "threads": profile.torch_threads,
                           "num_requests": args.num_requests,
                           "pilot_requests": args.pilot_requests, "points": []}
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / f"{file_name}.json"

    def pilot(scaled: Profile, name: str) -> list[TraceRequest]:
        """The first requests of a trace like the workload's first point's (its rate as
        the probe predicts it, the same length: a shorter trace has a higher maximum)."""
        w_index = list(WORKLOADS).index(name)
        return predict_point(scaled, shape, name, LEVELS[0], args.num_requests,
                             args.seed + 100 * w_index + _PILOT_SEED)[1][:args.pilot_requests]

    def due(target: Target) -> Iterator[tuple[str, list[TraceRequest], Slo]]:
        serving = ServingCalibrator(profile, shape, target,
                                    pilot if args.pilot_requests else None) \
            if args.calibrate == "serving" else None
        calibrate = serving or engine_calibrator
        for point, requests in predicted_points(profile, shape, args.num_requests, args.seed,
                                                calibrate, workloads):
            doc["points"].append(point)
            path.write_text(json.dumps(doc, indent=1))  # the prediction, before the replay
            key = f"{point['workload']}-{point['level']:g}"
            print(f"{key}: {point['rate_rps']:.2f} req/s for {requests[-1].timestamp:.0f} s; "
                  f"calibration {point['calibration']}", flush=True)
            before = status_snapshot(target.status_address)
            yield key, requests, Slo(point["slo"])
            after = status_snapshot(target.status_address)
            if serving:
                serving.remember(point["workload"], before, after)
            try:
                point["during"] = predict_during(profile, shape, point, requests, before,
                                                 after)
            except ValueError as e:  # no status: the point stands without it
                point["during"] = {"failed": str(e)}

    measured = run_config(shape_entry(shape, profile.torch_threads), profile, due,
                          args.out / name)
    for point in doc["points"]:
        point["measured"] = measured[f"{point['workload']}-{point['level']:g}"]
        point["error"] = errors(point["predicted"], point["measured"])
        if "predicted" in point["during"]:
            point["during"]["error"] = errors(point["during"]["predicted"], point["measured"])
    path.write_text(json.dumps(doc, indent=1))
    print(table([doc]))
    print(table([doc], during=True))
    return doc


def predict_during(profile: Profile, shape: ClusterShape, point: dict[str, Any],
                   requests: list[TraceRequest], before: dict[str, Any] | None,
                   after: dict[str, Any] | None) -> dict[str, Any]:
    """The point predicted again, after its replay, from the machine's speed *during* it.

    Not a forecast: it separates the simulator's error from the machine's drift. The
    profile is scaled (`scale_to_steps`) to the mean step of each shape the workers ran
    in the replay (their step totals before and after it, `replay_window`; no latency of
    the replay is used), and the same trace is simulated at the same rate.

    Returns:
        `{"predicted": figures, "calibration": scale_to_steps's record, "slowdown"}`.
    """
    window = replay_window(profile, before, after)
    scaled, record = scale_to_steps(profile, [window])
    predicted = predict(PlanRequest(scaled, scaled, requests, Slo(point["slo"])), shape)
    return {"predicted": predicted, "calibration": record, "slowdown": window[2]}


def resimulate(doc: dict[str, Any]) -> dict[str, Any]:
    """A run's measured points predicted again by this version's simulator: each point's
    trace (its seed and rate), SLO and calibration records (`scaled_by`, with their step
    spread) as the run kept them, so a change to the simulator is scored on runs already
    measured. The forecast's and the during-speed predictions and errors are replaced."""
    profile = Profile.load(Path(doc["profile"]))
    shape = parse_config(doc["config"].rsplit("-t", 1)[0])
    seed = doc.get("seed", 0)

    def again(point: dict[str, Any], record: dict[str, Any] | None,
              requests: list[TraceRequest]) -> dict[str, Any]:
        scaled = profile if record is None else scaled_by_record(profile, record)
        predicted = predict(PlanRequest(scaled, scaled, requests, Slo(point["slo"])), shape)
        return {"predicted": predicted, "error": errors(predicted, point["measured"])}

    points = []
    for point in (p for p in doc["points"] if "measured" in p):
        w_index = list(WORKLOADS).index(point["workload"])
        requests = workload(point["workload"], doc["num_requests"], point["rate_rps"],
                            seed + 100 * w_index + 10 + LEVELS.index(point["level"]))
        new = {**point, **again(point, point["calibration"], requests)}
        if "predicted" in point.get("during", {}):
            new["during"] = {**point["during"],
                             **again(point, point["during"]["calibration"], requests)}
        points.append(new)
    return {**doc, "points": points}


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


def table(docs: list[dict[str, Any]], during: bool = False) -> str:
    """Markdown: one row per measured point, predicted / measured (error), and the summary
    (a run that stopped early has points predicted but not measured: left out). With
    `during`, the predictions from the machine's speed during each point
    (`predict_during`; points without one are left out)."""
    headers = ["config", "workload", "load", "req/s", "TTFT p50 ms", "TTFT p90 ms",
               "TPOT p50 ms", "TPOT p90 ms", "attainment", "step ms"]
    rows, latency_errors, attainment_errors = [], [], []
    for doc in docs:
        for point in (p for p in doc["points"] if "measured" in p):
            if during:
                if "error" not in point.get("during", {}):
                    continue
                point = {**point, **point["during"]}
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
    r.add_argument("--calibrate", choices=("engine", "serving"),
                   help="before each point, scale the profile to probe steps timed then: "
                        "on a bare engine beside the server (`Calibrator`) or on the "
                        "serving workers (`ServingCalibrator`)")
    r.add_argument("--pilot-requests", type=int, default=0,
                   help="with --calibrate serving: before each workload's first point, "
                        "replay this many requests of it (own seed, not scored) and pool "
                        "their steps into its calibration; 0: no pilot")
    r.add_argument("--out", type=Path, default=DEFAULT_OUT,
                   help="where DIR/CONFIG.json and the runs go (default "
                        "experiments/results/planner_accuracy)")
    t = sub.add_parser("table", help="the markdown table of every run in --out")
    t.add_argument("--out", type=Path, default=DEFAULT_OUT,
                   help="the runs' folder (default experiments/results/planner_accuracy)")
    t.add_argument("--during", action="store_true",
                   help="the predictions from the machine's speed during each point")
    t.add_argument("--resimulate", action="store_true",
                   help="predict each measured point again with this version's simulator "
                        "from the calibration the run kept (`resimulate`)")
    args = parser.parse_args(argv)
    if args.command == "run":
        run(args)
    else:
        docs = [json.loads(p.read_text()) for p in sorted(args.out.glob("*.json"))]
        if args.resimulate:
            docs = [resimulate(doc) for doc in docs]
        print(table(docs, during=args.during))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
