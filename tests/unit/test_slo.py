"""The one SLO scorer (`protocol/slo.py`) on hand-computed runs: which requests meet the
SLO, attainment, goodput and the latency percentiles."""

from __future__ import annotations

import math

import numpy as np
import pytest

from protocol.serving import Slo
from protocol.slo import FIGURE_KEYS, Latencies, score, within

# Five requests (seconds): (ttft, tpot, e2e); None where undefined.
RUN = Latencies.of([
    (0.20, 0.04, 1.00),  # within 300 ms TTFT and 50 ms TPOT
    (0.35, 0.03, 0.65),  # first token late
    (0.10, 0.06, 0.70),  # too slow per token
    (None, None, None),  # failed
    (0.25, None, 0.25),  # one token: no TPOT
])
TTFT_AND_TPOT = Slo({"ttft_ms": 300, "tpot_ms": 50})


def test_a_request_meets_both_objectives_or_it_misses() -> None:
    assert within(TTFT_AND_TPOT, RUN).tolist() == [True, False, False, False, True]


def test_attainment_is_over_every_request_sent_and_goodput_over_the_duration() -> None:
    figures = score(RUN, 4.0, TTFT_AND_TPOT)
    assert figures["attainment"] == pytest.approx(2 / 5)
    assert figures["goodput_rps"] == pytest.approx(2 / 4.0)
    assert set(figures) == set(FIGURE_KEYS)


def test_a_failed_request_meets_no_bound_and_has_no_latency() -> None:
    # Only an E2E bound, which NaN would pass if failures were not ruled out first.
    failed = Latencies.of([(None, None, None), (0.1, 0.01, 0.5)])
    assert within(Slo({"e2e_ms": 1000}), failed).tolist() == [False, True]
    figures = score(failed, 2.0, Slo({"e2e_ms": 1000}))
    assert figures["attainment"] == 0.5 and figures["goodput_rps"] == 0.5
    assert figures["ttft_p50_ms"] == pytest.approx(100.0)


def test_a_one_token_answer_meets_any_tpot_bound() -> None:
    one_token = Latencies.of([(0.25, None, 0.25)])
    assert within(Slo({"tpot_ms": 0.001}), one_token).tolist() == [True]
    assert within(Slo({"tpot_ms": 0.001, "ttft_ms": 200}), one_token).tolist() == [False]
    assert score(one_token, 1.0, None)["tpot_p50_ms"] is None


def test_a_latency_equal_to_its_bound_meets_it() -> None:
    at_bound = Latencies.of([(0.25, 0.04, 0.5)])
    assert within(Slo({"ttft_ms": 250, "tpot_ms": 40}), at_bound).tolist() == [True]


def test_the_tightest_bound_on_a_metric_applies_to_each_request() -> None:
    # ttft_ms=300 is tighter than ttft_p90_ms=400: the second request (350 ms) misses.
    slo = Slo({"ttft_p90_ms": 400, "ttft_ms": 300})
    assert within(slo, RUN).tolist() == [True, False, True, False, True]


def test_percentiles_are_over_the_requests_that_succeeded() -> None:
    figures = score(RUN, 4.0, None)
    # TTFT ms of the four that succeeded, sorted: 100, 200, 250, 350 (linear interpolation:
    # p50 halfway between the middle two, p90 at 2.7 of 3 intervals).
    assert figures["ttft_p50_ms"] == pytest.approx(225.0)
    assert figures["ttft_p90_ms"] == pytest.approx(250 + 0.7 * 100)
    # TPOT: only the three with one: 30, 40, 60.
    assert figures["tpot_p50_ms"] == pytest.approx(40.0)
    assert figures["tpot_p90_ms"] == pytest.approx(40 + 0.8 * 20)
    assert figures["e2e_p50_ms"] == pytest.approx((650 + 700) / 2)
    assert figures["attainment"] is None and figures["goodput_rps"] is None


def test_the_figures_are_what_a_percentile_bound_reads() -> None:
    # Per request ttft <= 330 (or 310) ms: three of five meet it, 60 % >= 50 %; the run's
    # TTFT p90 is 320 ms, within 330 and not within 310.
    figures = score(RUN, 4.0, Slo({"ttft_p90_ms": 330}, attainment=0.5))
    assert figures["attainment"] == pytest.approx(0.6)
    assert Slo({"ttft_p90_ms": 330}, attainment=0.5).meets(figures)
    tighter = Slo({"ttft_p90_ms": 310}, attainment=0.5)
    assert not tighter.meets(score(RUN, 4.0, tighter))


def test_a_run_in_which_nothing_finished_has_no_goodput() -> None:
    nothing = Latencies.of([(None, None, None)] * 3)
    for duration in (0.0, math.nan):
        assert score(nothing, duration, TTFT_AND_TPOT)["goodput_rps"] == 0.0
    assert score(nothing, 1.0, TTFT_AND_TPOT)["attainment"] == 0.0
    empty = score(Latencies.of([]), 1.0, TTFT_AND_TPOT)
    assert empty["attainment"] is None and empty["ttft_p90_ms"] is None


def test_latencies_of_different_lengths_are_refused() -> None:
    with pytest.raises(ValueError, match="differ in length"):
        Latencies(np.zeros(2), np.zeros(2), np.zeros(3))
