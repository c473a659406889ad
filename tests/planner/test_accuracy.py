"""The accuracy run's calibration: probe steps scale the profile; each point is predicted
from the calibration taken just before it."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import pytest

from planner.accuracy import (
    LEVELS,
    PROBE_BATCHES,
    PROBE_CONTEXT,
    PROBE_PREFILL,
    WORKLOADS,
    Calibrator,
    parse_config,
    predict_point,
    predicted_points,
    scale_to_probes,
)
from planner.profile import LinearModel, Profile
from tests.planner.synthetic import synthetic_profile

PREFILL = (0.01, 0.002, 0.001, 0.0005)
DECODE = (0.004, 0.002, 0.01)


def machine(profile: Profile, fixed: float, per_seq: float, prefill: float) -> Profile:
    """A machine whose decode fixed cost, per-sequence cost and prefill are these multiples
    of the profile's."""
    c, s, x = profile.decode.coef
    return replace(profile,
                   decode=LinearModel(profile.decode.features, (c * fixed, s * per_seq,
                                                                x * per_seq)),
                   prefill=LinearModel(profile.prefill.features,
                                       tuple(v * prefill for v in profile.prefill.coef)))


def probes(true: Profile, decode_steps: int = 8, prefills: int = 5
           ) -> dict[str, list[dict[str, Any]]]:
    """Probe samples as `Calibrator.probe` records them, timed on the `true` machine:
    decode steps whose context grows by one token a step, and 128-token prefills."""
    decode = [{"items": items, "y": true.step_time(items)}
              for batch in PROBE_BATCHES for step in range(decode_steps)
              for items in [[[PROBE_CONTEXT + step, 1, False]] * batch]]
    prefill = [{"items": items, "y": true.step_time(items)}
               for items in [[[0, PROBE_PREFILL, True]]] * prefills]
    return {"decode": decode, "prefill": prefill}


def reproduces(profile: Profile, samples: dict[str, list[dict[str, Any]]]) -> None:
    for sample in samples["decode"] + samples["prefill"]:
        assert profile.step_time(sample["items"]) == pytest.approx(sample["y"], rel=1e-9)


def test_a_uniformly_slower_machine_scales_each_model_by_its_slowdown() -> None:
    profile = synthetic_profile(prefill=PREFILL, decode=DECODE)
    true = machine(profile, 1.5, 1.5, 1.2)
    samples = probes(true)

    scaled, record = scale_to_probes(profile, samples)

    assert record["factors"] == {"decode_fixed": pytest.approx(1.5),
                                 "decode_per_seq": pytest.approx(1.5),
                                 "prefill": pytest.approx(1.2)}
    assert scaled.decode.coef == pytest.approx(true.decode.coef)
    assert scaled.prefill.coef == pytest.approx(true.prefill.coef)
    assert scaled.transfer == profile.transfer
    reproduces(scaled, samples)
    # The record: median probe steps (8 steps attending to 129-136 tokens: median 132.5).
    assert record["measured_ms"]["decode_b8"] == pytest.approx(
        1e3 * true.step_time([(131.5, 1, False)] * 8), abs=0.01)
    assert record["profile_ms"]["prefill"] == pytest.approx(
        1e3 * profile.step_time([(0, PROBE_PREFILL, True)]), abs=0.01)


def test_fixed_and_per_sequence_drift_are_fitted_apart() -> None:
    """Memory-bound drift: the per-sequence cost doubles, the fixed cost does not. One
    factor cannot match batch 1 and batch 8 both; the two parts' factors can, and then
    an unprobed batch is right too."""
    profile = synthetic_profile(prefill=PREFILL, decode=DECODE)
    true = machine(profile, 1.0, 2.0, 1.0)
    samples = probes(true)

    scaled, record = scale_to_probes(profile, samples)

    assert record["factors"]["decode_fixed"] == pytest.approx(1.0)
    assert record["factors"]["decode_per_seq"] == pytest.approx(2.0)
    reproduces(scaled, samples)
    batch4 = [(PROBE_CONTEXT, 1, False)] * 4
    assert scaled.step_time(batch4) == pytest.approx(true.step_time(batch4))


def test_probes_that_need_a_negative_fixed_cost_get_the_closest_non_negative_fit() -> None:
    """Batch 8 more than the model's per-sequence growth allows: matching both would need
    a negative fixed cost, so the fixed part is dropped and the per-sequence factor lands
    between what each probe alone implies."""
    profile = synthetic_profile(decode=(0.01, 0.001, 0.0))
    samples = probes(profile)
    for sample in samples["decode"]:
        sample["y"] = 0.011 if len(sample["items"]) == 1 else 0.2

    scaled, record = scale_to_probes(profile, samples)

    assert record["factors"]["decode_fixed"] == 0.0
    assert scaled.decode.coef[0] == 0.0
    assert 0.011 / 0.001 < record["factors"]["decode_per_seq"] < 0.2 / 0.008


def test_a_decode_model_without_a_fixed_part_keeps_factor_one_for_it() -> None:
    profile = synthetic_profile(prefill=PREFILL, decode=(0.0, 0.002, 0.01))
    samples = probes(machine(profile, 1.0, 1.7, 0.8))

    scaled, record = scale_to_probes(profile, samples)

    assert record["factors"] == {"decode_fixed": 1.0, "decode_per_seq": pytest.approx(1.7),
                                 "prefill": pytest.approx(0.8)}
    reproduces(scaled, samples)


def test_each_point_is_predicted_from_the_calibration_taken_just_before_it() -> None:
    """A machine that gets slower before each point: each point's SLO, maximum rate and
    prediction come from the calibration taken when the point is due, and calibration
    happens only then (not all up front)."""
    profile = synthetic_profile(prefill=PREFILL, decode=DECODE)
    shape = parse_config("1P+1D")
    slowdowns = iter([1.0, 1.5, 2.0, 1.2])
    machines: list[Profile] = []

    def calibrate() -> tuple[Profile, dict[str, Any]]:
        slowdown = next(slowdowns)
        machines.append(machine(profile, slowdown, slowdown, slowdown))
        return machines[-1], {"slowdown": slowdown}

    points = predicted_points(profile, shape, 20, 3, calibrate)
    taken = []
    for point, requests in points:
        assert len(machines) == len(taken) + 1  # calibrated just now, for this point
        taken.append((point, requests))

    names = [name for name in WORKLOADS for _ in LEVELS]
    assert [p["calibration"]["slowdown"] for p, _ in taken] == [1.0, 1.5, 2.0, 1.2]
    for (point, requests), name, true in zip(taken, names, machines, strict=True):
        w_index = list(WORKLOADS).index(name)
        expected, expected_requests = predict_point(true, shape, name, point["level"], 20,
                                                    3 + 100 * w_index)
        assert point == {**expected, "calibration": point["calibration"]}
        assert requests == expected_requests
    # The slower the machine when a workload's point is due, the lower its maximum rate.
    assert taken[1][0]["max_rate_rps"] < taken[0][0]["max_rate_rps"]
    assert taken[3][0]["max_rate_rps"] > taken[2][0]["max_rate_rps"]


def test_the_calibrator_times_probes_on_a_kept_engine_and_frees_their_kv() -> None:
    """The real probe steps on the tiny model, twice on one engine: a profile claiming 1 s
    per step is scaled far down, each model by its own factor, and the probes leave the
    KV pool as they found it."""
    profile = synthetic_profile(prefill=(1.0, 0.0, 0.0, 0.0), decode=(1.0, 0.0, 0.0),
                                model="tiny")
    calibrator = Calibrator(profile)
    pool = calibrator._sampler.engine.block_pool
    free = pool.num_free_blocks

    for _ in range(2):
        scaled, record = calibrator()
        factors = record["factors"]
        assert 0 < factors["decode_fixed"] < 0.5 and 0 < factors["prefill"] < 0.5
        assert factors["decode_per_seq"] == 1.0  # the model has no per-sequence cost
        assert scaled.decode.coef == (factors["decode_fixed"], 0.0, 0.0)
        assert scaled.prefill.coef == (factors["prefill"], 0.0, 0.0, 0.0)
        assert set(record["measured_ms"]) == {"decode_b1", "decode_b8", "prefill"}
        assert pool.num_free_blocks == free
        assert not calibrator._sampler.engine.has_unfinished_requests()
