"""The autoscaling experiment's trace: its predicted rates separate the two fixed splits as
claimed (phase A's rate, and where phase B's measured rate starts its probes)."""

from __future__ import annotations

from pathlib import Path

import pytest

from experiments.autoscale_run import (
    RATE_REQUESTS,
    SPLITS,
    build_trace,
    choose_rate,
    experiment_slo,
    first_miss,
    phase_durations,
    phase_requests,
    shape,
    slo_from_summary,
)
from planner.plan import PlanRequest, predict
from planner.profile import Profile
from protocol.serving import Slo

# The SmolLM2 profile (one torch thread, decode batch table) the experiment was designed on,
# as `pdcluster profile` wrote it, its raw samples left out (the models are those of
# docs/results/planner_profile_smollm2_t1.json; a copy here keeps the test off the docs).
PROFILE = Path(__file__).parent / "data" / "smollm2-t1-table.json"


def test_the_phases_rates_favour_opposite_splits() -> None:
    """Phase A's rate: 1P+1D is predicted to meet the SLO and 0P+2D to miss it; phase B's
    first probe (higher): the reverse. The trace holds phase A's requests for its 80 s, then
    phase B's for 40."""
    profile = Profile.load(PROFILE)
    one, none = SPLITS["1P+1D"], SPLITS["0P+2D"]
    slo = experiment_slo(profile)

    rate_a = choose_rate(profile, slo, "prefill-heavy", one, none, RATE_REQUESTS)
    rate_b = choose_rate(profile, slo, "decode-heavy", none, one, RATE_REQUESTS, above=rate_a)
    trace = build_trace((80, 40), slo, rate_a, rate_b)

    rates = trace["rates"]
    assert rates == {"prefill-heavy": rate_a, "decode-heavy": rate_b} and rate_b > rate_a
    for name, good, bad in (("prefill-heavy", one, none), ("decode-heavy", none, one)):
        requests = phase_requests(name, RATE_REQUESTS, rates[name], 0.0, 5)
        request = PlanRequest(profile, profile, requests, slo, 3, find_max_rate=False)
        assert slo.meets(predict(request, shape(good)))
        assert not slo.meets(predict(request, shape(bad)))
    arrivals = [r.timestamp for r in trace["requests"]]
    assert arrivals == sorted(arrivals) and arrivals[-1] < 120
    phases = trace["phases"]
    assert phases == sorted(phases, key=lambda p: p != "prefill-heavy")
    assert all((r.timestamp < 80) == (p == "prefill-heavy")
               for r, p in zip(trace["requests"], phases, strict=True))


@pytest.mark.parametrize("start", [0.5, 1.0, 2.0])
def test_phase_bs_probes_find_the_lowest_rate_that_misses(start: float) -> None:
    """Up from a start that meets, down from one that misses: the lowest probed rate whose
    attainment is below the bound, with the next lower probed rate meeting it."""
    def probe(rate: float) -> float:
        return 0.95 if rate < 1.2 else 0.6

    rate, probes = first_miss("1P+1D", start, probe)

    rates = [p["rate"] for p in probes]
    assert rate >= 1.2 and rate / 1.15 < 1.2 + 1e-3
    assert max(r for r in rates if r < 1.2) == pytest.approx(rate / 1.15, rel=1e-2)
    assert all(p["attainment"] == probe(p["rate"]) for p in probes)
    assert rates == sorted(rates) if start < 1.2 else rates == sorted(rates, reverse=True)


def test_phase_bs_probes_fail_clearly_without_a_turn() -> None:
    with pytest.raises(RuntimeError, match="no rate where 0P\\+2D turns"):
        first_miss("0P+2D", 1.0, lambda rate: 1.0)


def test_phase_lengths_are_read_as_a_then_b_or_one_for_both() -> None:
    assert phase_durations("300,150") == (300.0, 150.0)
    assert phase_durations("150") == (150.0, 150.0)
    with pytest.raises(ValueError):
        phase_durations("long")


def test_the_traces_seed_draws_another_trace_at_the_same_rates() -> None:
    """`--seed` draws other arrivals and lengths; the same seed draws the same trace."""
    slo = experiment_slo(Profile.load(PROFILE))

    def key(trace: dict) -> list[tuple[float, int, int]]:
        return [(r.timestamp, len(r.prompt_token_ids), r.output_len) for r in trace["requests"]]

    first, again = build_trace((80, 40), slo, 0.6, 1.6), build_trace((80, 40), slo, 0.6, 1.6, 21)
    other = build_trace((80, 40), slo, 0.6, 1.6, 31)
    assert key(first) == key(again)
    assert key(other) != key(first) and other["rates"] == first["rates"]
    assert {r.timestamp < 80 for r in other["requests"]} == {True, False}


def test_a_summarys_slo_is_read_back_as_it_was_recorded() -> None:
    """`--more` rebuilds the trace from the SLO a summary recorded (`Slo.as_dict`), and
    still reads the older nested form."""
    slo = Slo({"ttft_p90_ms": 1234.5, "tpot_p90_ms": 150.2}, attainment=0.85)
    assert slo_from_summary(slo.as_dict()) == slo
    assert slo_from_summary({"bounds": dict(slo.bounds), "attainment": 0.85}) == slo
