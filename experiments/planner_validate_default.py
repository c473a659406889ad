"""The default `plan` path validated by serving (docs/benchmarks.md, "The default path,
served"): the unseen trace, and the summary of the `plan --validate` runs.

    python -m experiments.planner_validate_default trace [--seed 2028] --out T.jsonl
    pdcluster plan --profile docs/results/planner_profile_smollm2_xeon.json \\
        --trace T.jsonl --slo ... --max-workers 2 --validate --validate-configs 2 -o RUN.json
    python -m experiments.planner_validate_default summary RUN1.json ... --out S.json

`--validate` calibrates each served configuration through its server and compares the
measured figures with that configuration predicted again (`repredicted`; the default,
`--validate-calibration serving`); a run with `--validate-calibration bare` compares them
with the plan's prediction. The summary reads either: each served entry's `compared` says
which prediction its errors are of.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path
from typing import Any

import numpy as np

from planner.measure import VOCAB
from planner.plan import label

# The traces' seeds, each used by no other planner experiment (accuracy: 0-360;
# autoscale: 21-42): 2027 the earlier protocols', 2028 the current one's (docs/benchmarks.md).
SEEDS = (2027, 2028)
SEED = SEEDS[-1]
NUM_REQUESTS = 80
RATE_RPS = 0.5
LATENCY = ("ttft_p50_ms", "ttft_p90_ms", "tpot_p50_ms", "tpot_p90_ms")


def trace(num: int = NUM_REQUESTS, rate: float = RATE_RPS, seed: int = SEED
          ) -> list[dict[str, Any]]:
    """Poisson arrivals; 40 % documents (384-768 prompt tokens, 8-24 output), 60 % chat
    (32-128 prompt, 32-96 output); random token ids (no prefix hits)."""
    rng = np.random.default_rng(seed)
    times = np.cumsum(rng.exponential(1 / rate, num))
    times -= times[0]
    out = []
    for t in times:
        document = rng.random() < 0.4
        prompt = int(rng.integers(384, 769) if document else rng.integers(32, 129))
        output = int(rng.integers(8, 25) if document else rng.integers(32, 97))
        out.append({"timestamp": round(float(t), 4), "output_len": output,
                    "prompt_token_ids": rng.integers(*VOCAB, prompt).tolist()})
    return out


def load_averages(path: Path) -> list[float] | None:
    """The 1-minute load averages `uptime` wrote in RUN.load (before and after the run)."""
    if not path.exists():
        return None
    return [float(line.split("load average:")[1].split(",")[0])
            for line in path.read_text().splitlines() if "load average:" in line]


def pilot(path: Path) -> dict[str, Any]:
    """The plan without `--validate` the SLO was chosen from: its calibration and each
    configuration's predicted TPOT p90 and verdict."""
    doc = json.loads(path.read_text())
    return {"file": path.name, "slo": doc["slo"],
            "load_average_1min_before": (load_averages(path.with_suffix(".load")) or [None])[0],
            "calibration_factors": {k: round(v, 3) for k, v in
                                    doc["calibration"]["decode"]["factors"].items()},
            "configs": [{"config": label(c), "meets_slo": c["meets_slo"],
                         "tpot_p90_ms": c["predicted"]["tpot_p90_ms"]}
                        for c in doc["configs"]]}


def summary(paths: list[Path]) -> dict[str, Any]:
    """Per run and served configuration (`served_entry`): predicted, measured and error of
    the four latency figures and the mean step, whether it met the SLO as predicted and
    measured; the run's
    median and worst |error| over the four figures; the load average before and after
    (RUN.load beside RUN.json, when there)."""
    runs = []
    for path in paths:
        doc = json.loads(path.read_text())
        served = [c for c in doc["configs"] if "measured" in c]
        errs = [abs(c["error"][k]) for c in served for k in LATENCY
                if c["error"][k] is not None]
        runs.append({
            "file": path.name, "slo": doc["slo"], "rate_rps": doc["rate_rps"],
            "load_average_1min_before_after": load_averages(path.with_suffix(".load")),
            # one profile for both roles: the decode record holds the prompt-step factor too
            "calibration_factors": {k: round(v, 3) for k, v in
                                    doc["calibration"]["decode"]["factors"].items()}
            if doc["calibration"]["applied"] else None,
            "recommended": label(doc["recommended"]) if doc["recommended"] else None,
            "served": [served_entry(c) for c in served],
            "median_abs_error": statistics.median(errs) if errs else None,
            "worst_abs_error": max(errs) if errs else None})
    return {"runs": runs}


def served_entry(c: dict[str, Any]) -> dict[str, Any]:
    """One served configuration: the prediction its errors are of (`compared`: the
    re-prediction after serving calibration, or the plan's), the plan's beside it, the
    measured figures, and the SLO verdicts."""
    compared = "repredicted" if "repredicted" in c else "predicted"
    served = c.get("served_calibration")
    return {"config": label(c), "role": c["validation_role"], "compared": compared,
            "served_calibration_factors": {k: round(v, 3) for k, v in
                                           served["factors"].items()}
            if served and served["applied"] else None,
            "response_latency_ms": served.get("response_latency_ms") if served else None,
            "plan_meets_slo": c["meets_slo"],
            "predicted_meets_slo": c.get("repredicted_meets_slo", c["meets_slo"]),
            "measured_meets_slo": c["measured"]["meets_slo"],
            **{k: {"predicted": c[compared][k], "plan": c["predicted"][k],
                   "measured": c["measured"][k]} for k in ("attainment", "mean_step_ms")},
            **{k: {"predicted": c[compared][k], "plan": c["predicted"][k],
                   "measured": c["measured"][k], "error": c["error"][k]} for k in LATENCY}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    sub = parser.add_subparsers(dest="cmd", required=True)
    t = sub.add_parser("trace")
    t.add_argument("--out", type=Path, required=True)
    t.add_argument("--seed", type=int, choices=SEEDS, default=SEED)
    s = sub.add_parser("summary")
    s.add_argument("plans", type=Path, nargs="+")
    s.add_argument("--pilot", type=Path, default=None,
                   help="the plan without --validate the SLO was chosen from")
    s.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    if args.cmd == "trace":
        args.out.write_text("".join(json.dumps(r) + "\n" for r in trace(seed=args.seed)))
    else:
        doc = summary(args.plans)
        if args.pilot is not None:
            doc = {"pilot": pilot(args.pilot), **doc}
        args.out.write_text(json.dumps(doc, indent=1) + "\n")


if __name__ == "__main__":
    main()
