"""The pure parts of `plan --validate`: which configs are served and in what role, serve
flags, errors."""

from __future__ import annotations

import json

import pytest

from cluster.validate import errors, role, serve_flags, served_configs
from planner.plan import PlanRequest, label, plan
from planner.report import print_validation
from protocol.serving import Slo
from tests.planner.synthetic import synthetic_profile
from tests.planner.test_frontier import REQUESTS
from tests.planner.test_plan import PROFILE


def config(mode: str, prefill: int, decode: int, attainment: float = 0.5,
           meets: bool = True) -> dict:
    return {"mode": mode, "prefill": prefill, "decode": decode, "threads_per_worker": 2,
            "max_num_batched_tokens": 512, "local_prefill_threshold": 64, "meets_slo": meets,
            "predicted": {"attainment": attainment}}


def test_the_recommended_and_the_closest_rejected_config_are_always_served() -> None:
    """2P+1D recommended; of the others only 2 colocated misses the SLO, and it is far (four
    workers moved and the mode): it is served second whatever the count, then the nearest."""
    configs = [config("disaggregated", 1, 1), config("disaggregated", 2, 1),
               config("disaggregated", 1, 2), config("disaggregated", 3, 1),
               config("colocated", 0, 2, meets=False), config("colocated", 0, 3)]
    doc = {"configs": configs, "recommended": configs[1]}
    assert served_configs(doc, 3) == [configs[1], configs[4], configs[0]]
    assert served_configs(doc, 1) == [configs[1], configs[4]]
    assert [role(doc, c) for c in served_configs(doc, 4)] == [
        "recommended", "rejected", "other", "other"]
    # Nothing rejected: the recommended one and its nearest neighbours.
    configs[4]["meets_slo"] = True
    assert served_configs(doc, 2) == [configs[1], configs[0]]
    # Nothing recommended: the best attainments, all rejected.
    nothing = {"configs": [config("colocated", 0, 1, 0.2, False),
                           config("colocated", 0, 2, 0.7, False)], "recommended": None}
    assert served_configs(nothing, 1) == [nothing["configs"][1]]
    assert role(nothing, nothing["configs"][1]) == "rejected"


def test_a_plan_file_serves_its_pick_and_the_split_it_rejects() -> None:
    """A real plan, read back from its JSON (where `recommended` is a copy, not the same
    entry): 1.5 prompts of 1000 tokens a second need two prefill workers; 2P+1D (cheapest
    that keeps up) is recommended, 1P+1D (cannot keep up) is the closest rejected one."""
    request = PlanRequest(PROFILE, PROFILE, REQUESTS, Slo.parse("ttft_p90_ms=3000"),
                          max_workers=3, modes=("disaggregated",), budgets=(1024,))
    doc = json.loads(json.dumps(plan(request)))
    served = served_configs(doc, 1)
    assert [(label(c), role(doc, c)) for c in served] == [
        ("2P+1D", "recommended"), ("1P+1D", "rejected")]
    assert served[0]["meets_slo"] and not served[1]["meets_slo"]


def test_serve_flags_build_the_config_as_profiled() -> None:
    flags = serve_flags(config("disaggregated", 2, 1), synthetic_profile(), 32, "auto")
    assert " ".join(flags) == (
        "--mode disaggregated --decode 1 --torch-threads 2 --max-num-batched-tokens 512 "
        "--max-num-seqs 32 --local-prefill-threshold 64 --kv-cache-gb 1 --dtype float32 "
        "--transport shm --prefill 2 --address auto")
    assert "--prefill" not in serve_flags(config("colocated", 0, 2), synthetic_profile())


def test_errors_are_relative_and_attainment_in_points() -> None:
    predicted = {"ttft_p50_ms": 110.0, "ttft_p90_ms": 90.0, "tpot_p50_ms": 10.0,
                 "tpot_p90_ms": None, "attainment": 0.9, "goodput_rps": 2.0}
    measured = {"ttft_p50_ms": 100.0, "ttft_p90_ms": 100.0, "tpot_p50_ms": 0.0,
                "tpot_p90_ms": 12.0, "attainment": 0.95, "goodput_rps": 2.5}
    assert errors(predicted, measured) == {
        "ttft_p50_ms": pytest.approx(0.1), "ttft_p90_ms": pytest.approx(-0.1),
        "tpot_p50_ms": None, "tpot_p90_ms": None, "attainment": pytest.approx(-0.05),
        "goodput_rps": pytest.approx(-0.2)}


def test_the_printed_table_gives_each_served_config_its_role_and_slo_verdict(
        capsys: pytest.CaptureFixture[str]) -> None:
    rec = {**config("disaggregated", 1, 1), "validation_role": "recommended"}
    rejected = {**config("colocated", 0, 1, meets=False), "validation_role": "rejected"}
    for c, met in ((rec, True), (rejected, False)):
        c["predicted"] = {"ttft_p50_ms": 100.0, "ttft_p90_ms": 200.0, "tpot_p50_ms": 10.0,
                          "tpot_p90_ms": 20.0, "attainment": 0.95, "goodput_rps": 0.5}
        c["measured"] = {**c["predicted"], "ttft_p90_ms": 250.0, "meets_slo": met}
        c["error"] = errors(c["predicted"], c["measured"])
    print_validation({"configs": [rec, config("colocated", 0, 2), rejected]})
    rows = [[cell.strip() for cell in line.split("│")[1:-1]]
            for line in capsys.readouterr().out.splitlines() if line.startswith("│")]
    assert ["1P+1D", "recommended", "ttft_p90_ms", "200", "250", "-20.0%"] in rows
    assert ["1 colocated", "rejected", "attainment", "95.0%", "95.0%", "+0.0 pt"] in rows
    assert ["1P+1D", "recommended", "meets SLO", "yes", "yes", ""] in rows
    assert ["1 colocated", "rejected", "meets SLO", "no", "no", ""] in rows
    assert not any(row[0] == "2 colocated" for row in rows)  # not served
