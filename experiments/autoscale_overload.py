"""A chat-only overload served as an operator would: `serve --autoscale` from 1P+1D beside
the two fixed splits of its size, each against what the planner predicts for it.

    python -m experiments.autoscale_overload --profile P.json \
        [--out experiments/results/autoscale-overload] [--rate 1.6] [--requests 150]

The trace: `--requests` chat turns (prompts of 40-120 tokens, all under the default
local-prefill threshold of 256, so a prefill worker never computes one; answers of 80-120
tokens) arriving Poisson at `--rate`. The SLO: TTFT p90 12 s, TPOT p90 150 ms, 90 % of
requests. On 1P+1D the prefill worker idles while one decode worker carries every answer;
0P+2D has two. The measured profile is first scaled to the steps a 1P+1D server runs now
(`ServingCalibrator`, as the other serving experiments do: the VM drifts, and serving
workers step slower than a bare engine); the autoscaler is given that profile, and the
predictions are made with it.

Protocol (fixed before the first run): one run of each arm, in the order autoscale,
1P+1D, 0P+2D, each on a fresh server warmed up with four requests: `autoscale` is `pdcluster
serve --autoscale --max-workers 2` with its default interval, window and cooldown
(10/60/60 s) and `--min-prefill` 0, as an operator starts it; the fixed arms are `serve
--prefill P --decode D`. Measured per arm: goodput (requests meeting both bounds per
second of the run) and attainment, from the same bench client; for the autoscale arm, the
split it ended on and when it first moved. Predicted: `planner.plan.predict` on the trace
for each fixed split. Raw files go to `--out`; `summary.json` holds the figures.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import numpy as np

from bench.traces import arrival_times
from commands.serving_calibration import ServingCalibrator
from experiments import RESULTS
from experiments.autoscale_run import grpc_target, run_arm, server
from experiments.planner_accuracy import random_request
from experiments.runner import markdown_table
from planner.plan import PlanRequest, predict
from planner.profile import Profile
from planner.simulator import ClusterShape
from protocol.defaults import LOCAL_PREFILL_THRESHOLD
from protocol.serving import Slo, TraceRequest
from protocol.slo import ATTAINMENT, GOODPUT

CHAT = ((40, 120), (80, 120))
SLO = Slo({"ttft_p90_ms": 12000.0, "tpot_p90_ms": 150.0}, attainment=0.9)
SPLITS = {"1P+1D": (1, 1), "0P+2D": (0, 2)}
TRACE_SEED = 47


def trace(num: int, rate: float, seed: int = TRACE_SEED) -> list[TraceRequest]:
    """`num` chat turns arriving Poisson at `rate`."""
    rng = np.random.default_rng((seed, 1))
    return [random_request(rng, CHAT, t)
            for t in arrival_times(num, rate, "poisson", 1.0, seed)]


def shape(split: tuple[int, int]) -> ClusterShape:
    return ClusterShape("disaggregated", *split, local_prefill_threshold=LOCAL_PREFILL_THRESHOLD)


def predicted(profile: Profile, requests: list[TraceRequest]) -> dict[str, dict[str, Any]]:
    """The planner's figures for each fixed split on the trace at its rate."""
    request = PlanRequest(profile, profile, requests, SLO, max_workers=2,
                          find_max_rate=False, sweep_rates=False)
    return {name: predict(request, shape(split)) for name, split in SPLITS.items()}


def moves(timeline: list[dict[str, Any]]) -> tuple[str | None, float | None]:
    """The split the autoscale arm ended on (its last sample) and the first second its
    ready workers differed from 1P+1D."""
    samples = [s for s in timeline if "prefill" in s]
    if not samples:
        return None, None
    last = samples[-1]
    first = next((s["t"] for s in samples if (s["prefill"], s["decode"]) != (1, 1)), None)
    return f"{last['prefill']}P+{last['decode']}D", first


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--profile", type=Path, required=True)
    parser.add_argument("--out", type=Path, default=RESULTS / "autoscale-overload")
    parser.add_argument("--rate", type=float, default=1.6, help="arrivals per second")
    parser.add_argument("--requests", type=int, default=150)
    parser.add_argument("--arms", default="autoscale,1P+1D,0P+2D")
    args = parser.parse_args(argv)

    measured = Profile.load(args.profile)
    common = ["--mode", "disaggregated", "--torch-threads", str(measured.torch_threads),
              "--kv-cache-gb", f"{measured.kv_cache_gb:g}", "--transport", measured.transport]
    args.out.mkdir(parents=True, exist_ok=True)
    with server([*common, "--prefill", "1", "--decode", "1"], measured,
                args.out / "calibration" / "serve.log") as endpoints:
        profile, calibration = ServingCalibrator(measured, shape(SPLITS["1P+1D"]),
                                                 grpc_target(endpoints))()
    profile_path = args.out / "profile-calibrated.json"
    profile.save(profile_path)
    requests = trace(args.requests, args.rate)
    prediction = predicted(profile, requests)
    slo_flag = ",".join(f"{k}={v:g}" for k, v in SLO.bounds.items())
    arms = {"autoscale": [*common, "--prefill", "1", "--decode", "1", "--autoscale",
                          "--profile", str(profile_path), "--slo", slo_flag,
                          "--attainment", str(SLO.attainment), "--max-workers", "2"]}
    arms |= {name: [*common, "--prefill", str(p), "--decode", str(d)]
             for name, (p, d) in SPLITS.items()}
    run = {"slo": SLO, "phases": ["chat"] * len(requests), "requests": requests}
    results: dict[str, dict[str, Any]] = {}
    for name in args.arms.split(","):
        result = run_arm(name, arms[name], run, profile, args.out / name)
        figures = result["report"]["summary"]["figures"]
        results[name] = {"measured": {k: figures.get(k) for k in (GOODPUT, ATTAINMENT,
                                                                  "ttft_p90_ms",
                                                                  "tpot_p90_ms")},
                         "failed": result["report"]["summary"]["failed"]}
        if name == "autoscale":
            results[name]["ended_on"], results[name]["first_move_s"] = \
                moves(result["timeline"])
            results[name]["timeline"] = result["timeline"]
        print(f"{name}: {results[name]['measured']}", flush=True)
    rows = []
    for name, result in results.items():
        guess = prediction.get(name, {})
        rows.append([name, result.get("ended_on", name),
                     f"{result['measured'][GOODPUT]:.3f}",
                     "-" if not guess else f"{guess[GOODPUT]:.3f}",
                     f"{result['measured'][ATTAINMENT]:.0%}",
                     "-" if not guess else f"{guess[ATTAINMENT]:.0%}"])
    print(markdown_table(["arm", "split at the end", "goodput measured (req/s)",
                          "predicted", "attainment measured", "predicted"], rows))
    summary = {"slo": SLO.as_dict(), "rate": args.rate, "requests": args.requests,
               "seed": TRACE_SEED, "calibration": calibration,
               "predicted": {name: {k: p[k] for k in (GOODPUT, ATTAINMENT, "ttft_p90_ms",
                                                      "tpot_p90_ms")}
                             for name, p in prediction.items()},
               "arms": results}
    (args.out / "summary.json").write_text(json.dumps(summary, indent=1, default=str))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
