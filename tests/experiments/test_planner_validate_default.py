"""The default-path validation's summary reads plans validated either way: each served
entry's errors are of the prediction it names."""

from __future__ import annotations

import json
from pathlib import Path

from commands.validate import errors
from experiments.planner_validate_default import SEEDS, summary, trace

PLAN = {"ttft_p50_ms": 100.0, "ttft_p90_ms": 200.0, "tpot_p50_ms": 10.0, "tpot_p90_ms": 20.0,
        "attainment": 0.95, "goodput_rps": 0.5, "mean_step_ms": 9.0}


def entry(repredicted: dict | None) -> dict:
    c = {"mode": "colocated", "prefill": 0, "decode": 1, "validation_role": "recommended",
         "meets_slo": True, "predicted": PLAN,
         "measured": {**PLAN, "ttft_p90_ms": 250.0, "mean_step_ms": 12.0, "meets_slo": False}}
    if repredicted is not None:
        c |= {"repredicted": repredicted, "repredicted_meets_slo": False,
              "slo_verdict_changed": True,
              "served_calibration": {"applied": True, "factors": {"decode_b1": 1.23456},
                                     "response_latency_ms": 31.5}}
    c["error"] = errors(repredicted or PLAN, c["measured"])
    return c


def test_the_summary_reports_the_prediction_each_entry_was_compared_with(
        tmp_path: Path) -> None:
    again = {**PLAN, "ttft_p90_ms": 300.0, "mean_step_ms": 12.5}
    runs = []
    for name, c in (("bare.json", entry(None)), ("served.json", entry(again))):
        path = tmp_path / name
        path.write_text(json.dumps({"slo": {}, "rate_rps": 0.5, "recommended": c,
                                    "calibration": {"applied": False}, "configs": [c]}))
        runs.append(path)

    bare, served = (run["served"][0] for run in summary(runs)["runs"])

    assert bare["compared"] == "predicted" and bare["served_calibration_factors"] is None
    assert bare["ttft_p90_ms"] == {"predicted": 200.0, "plan": 200.0, "measured": 250.0,
                                   "error": -0.2}
    assert bare["predicted_meets_slo"] is True
    assert served["compared"] == "repredicted"
    assert served["served_calibration_factors"] == {"decode_b1": 1.235}
    assert served["response_latency_ms"] == 31.5 and bare["response_latency_ms"] is None
    assert served["ttft_p90_ms"] == {"predicted": 300.0, "plan": 200.0, "measured": 250.0,
                                     "error": 0.2}
    assert served["mean_step_ms"] == {"predicted": 12.5, "plan": 9.0, "measured": 12.0}
    assert served["plan_meets_slo"] is True and served["predicted_meets_slo"] is False


def test_the_trace_is_the_protocols() -> None:
    """Each protocol's trace: the same mix, another seed (the default is the newest)."""
    assert trace() == trace(seed=SEEDS[-1]) != trace(seed=SEEDS[0])
    requests = trace()
    assert len(requests) == 80 and requests[0]["timestamp"] == 0.0
    documents = [r for r in requests if len(r["prompt_token_ids"]) >= 384]
    assert all(8 <= r["output_len"] <= 24 for r in documents)
    assert 0.25 < len(documents) / len(requests) < 0.55
