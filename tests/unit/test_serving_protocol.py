"""The records bench and planner share: SLO parsing and scoring, the latency summary."""

from __future__ import annotations

import pytest

from protocol.serving import Slo, distribution


def test_both_slo_spellings_parse_to_the_same_bounds() -> None:
    assert Slo.parse("ttft=200,tpot=50") == Slo({"ttft_ms": 200.0, "tpot_ms": 50.0})
    assert Slo.parse("ttft_p90_ms=500,tpot_p50_ms=12.5", attainment=0.95) == \
        Slo({"ttft_p90_ms": 500.0, "tpot_p50_ms": 12.5}, 0.95)
    assert Slo.from_goodput(["ttft:300", "e2el:2000"]) == \
        Slo({"ttft_ms": 300.0, "e2e_ms": 2000.0})


@pytest.mark.parametrize(("text", "message"), [
    ("ttft_p95_ms=100", "unknown key 'ttft_p95_ms'"), ("ttft=-1", "ttft_ms must be > 0"),
    ("ttft=fast", "must be a number"), ("", "give at least one bound")])
def test_a_bad_slo_names_what_is_wrong(text: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        Slo.parse(text)


def test_bad_attainment_and_goodput_pairs_are_errors() -> None:
    with pytest.raises(ValueError, match=r"attainment must be in \(0, 1\]"):
        Slo({"ttft_ms": 1.0}, 1.5)
    with pytest.raises(ValueError, match="expected KEY:MS"):
        Slo.from_goodput(["itl:3"])


def test_a_request_is_bounded_by_the_tightest_bound_on_each_metric() -> None:
    """(`protocol.slo.within` applies the bounds: tests/unit/test_slo.py.)"""
    slo = Slo({"ttft_p90_ms": 500, "ttft_ms": 300, "tpot_p50_ms": 40})
    assert slo.bound("ttft") == 300 and slo.bound("tpot") == 40 and slo.bound("e2e") is None


def test_a_run_meets_the_slo_on_attainment_and_percentile_bounds_only() -> None:
    slo = Slo({"ttft_p90_ms": 500, "tpot_ms": 40}, attainment=0.9)
    # `tpot_ms` bounds requests (through the attainment), not a percentile of the run.
    assert slo.meets({"attainment": 0.9, "ttft_p90_ms": 500.0, "tpot_p90_ms": 400.0})
    assert not slo.meets({"attainment": 0.89, "ttft_p90_ms": 100.0})
    assert not slo.meets({"attainment": 1.0, "ttft_p90_ms": 500.1})
    assert slo.as_dict() == {"ttft_p90_ms": 500.0, "tpot_ms": 40.0, "attainment": 0.9}
    assert Slo.parse(slo.text()) == Slo(slo.bounds)


def test_distribution_percentiles_interpolate_linearly() -> None:
    stats = distribution([float(v) for v in range(1, 101)], scale=2.0)
    assert stats == pytest.approx({"mean": 101.0, "p50": 101.0, "p90": 180.2, "p99": 198.02})
    assert distribution([]) == {"mean": None, "p50": None, "p90": None, "p99": None}
