"""The planner-accuracy experiment and the calibration it runs on (`planner.calibrate`): probe
steps scale the profile; each point is predicted from the calibration taken just before it."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from commands.validate import errors
from engine.engine_loop import record_step
from experiments.planner_accuracy import (
    LEVELS,
    SLO_FACTORS,
    WORKLOADS,
    parse_config,
    predict_during,
    predict_point,
    predicted_points,
    resimulate,
    workload,
    workload_slo,
)
from planner.calibrate import (
    scale_to_probes,
)
from planner.plan import PlanRequest, max_rate, predict, simulate
from planner.profile import Profile
from planner.simulator import ClusterShape
from protocol.serving import Slo
from tests.planner.test_calibrate import machine, probes, status, table_profile, uniform


def test_each_point_is_predicted_from_the_calibration_taken_just_before_it() -> None:
    """A machine that gets slower before each point: each point's maximum rate and
    prediction come from the calibration taken when the point is due, and calibration
    happens only then (not all up front); a workload's SLO is its first point's."""
    profile = table_profile()
    shape = parse_config("1P+1D")
    slowdowns = iter([1.0, 1.5, 2.0, 1.2])
    machines: list[Profile] = []

    def calibrate(workload: str) -> tuple[Profile, dict[str, Any]]:
        slowdown = next(slowdowns)
        machines.append(uniform(profile, slowdown))
        return machines[-1], {"slowdown": slowdown, "workload": workload}

    names = [name for name in WORKLOADS for _ in LEVELS]
    levels = [level for _ in WORKLOADS for level in LEVELS]
    points = predicted_points(profile, shape, 20, 3, calibrate)
    taken = []
    for point, requests in points:
        assert len(machines) == len(taken) + 1  # calibrated just now, for this point
        taken.append((point, requests))

    assert [p["calibration"]["slowdown"] for p, _ in taken] == [1.0, 1.5, 2.0, 1.2]
    assert [p["calibration"]["workload"] for p, _ in taken] == names  # told which is due
    first: dict[str, Slo] = {}
    for (point, requests), name, level, true in zip(taken, names, levels, machines,
                                                    strict=True):
        # What the module docstring states, from the planner's own calls on the machine
        # calibrated for this point: workload w's seed is 3 + 100 w; its SLO is set at its
        # first point, the maximum rate is searched on a rate-1 trace of seed + 1, and a
        # point's trace runs at its level of that rate, seeded by seed + 10 + the level's
        # index.
        seed = 3 + 100 * list(WORKLOADS).index(name)
        slo = first.setdefault(name, Slo(unloaded_slo(true, shape, name, seed)))
        top = max_rate(PlanRequest(true, true, workload(name, 20, 1.0, seed + 1), slo), shape)
        expected_requests = workload(name, 20, level * top, seed + 10 + LEVELS.index(level))
        expected = predict(PlanRequest(true, true, expected_requests, slo), shape)
        assert point == {"workload": name, "level": level, "rate_rps": level * top,
                         "max_rate_rps": top, "slo": slo.bounds, "predicted": expected,
                         "calibration": {"slowdown": point["calibration"]["slowdown"],
                                         "workload": name}}
        assert requests == expected_requests
        (p_lo, p_hi), (o_lo, o_hi) = WORKLOADS[name]
        assert all(p_lo <= r.prompt_len <= p_hi and o_lo <= r.output_len <= o_hi
                   for r in requests)
    # Each workload's second point is held to its first one's SLO, not the one its own
    # calibration (a slower or faster machine) would have set.
    for index in (0, 2):
        assert taken[index + 1][0]["slo"] == taken[index][0]["slo"] == first[names[index]].bounds
        name = names[index]
        own = workload_slo(machines[index + 1], shape, name,
                           3 + 100 * list(WORKLOADS).index(name))
        assert own.bounds["tpot_p90_ms"] != taken[index][0]["slo"]["tpot_p90_ms"]
    # The slower the machine when a workload's point is due, the lower its maximum rate.
    assert taken[1][0]["max_rate_rps"] < taken[0][0]["max_rate_rps"]
    assert taken[3][0]["max_rate_rps"] > taken[2][0]["max_rate_rps"]


def unloaded_slo(true: Profile, shape: ClusterShape, name: str, seed: int
                 ) -> dict[str, float]:
    """The workload's SLO as the experiment defines it: `SLO_FACTORS` times the p50 TTFT and
    TPOT the simulator predicts on `true` for 20 of its requests at 0.001 req/s (one at a
    time), rounded to 0.1 ms."""
    unloaded = PlanRequest(true, true, workload(name, 20, 1e-3, seed),
                           Slo({"ttft_p90_ms": 1e9}), find_max_rate=False)
    result = simulate(unloaded, shape)
    ttft_factor, tpot_factor = SLO_FACTORS[name]
    return {"ttft_p90_ms": round(1e3 * ttft_factor * float(np.median(result.ttft)), 1),
            "tpot_p90_ms": round(1e3 * tpot_factor * float(np.nanmedian(result.tpot)), 1)}


def test_a_point_predicted_from_the_speed_during_it_equals_the_true_machines() -> None:
    """`predict_during`: one colocated worker ran the point on a machine 1.4x slower than
    profiled; its step totals over the point scale the profile to that machine, and the
    point's prediction equals the one made with the true machine's profile (with the
    spread its steps showed: small, from the context growing 1 token a step)."""
    profile = table_profile()
    true = uniform(profile, 1.4)
    shape = parse_config("1C")
    point, requests = predict_point(profile, shape, "decode-heavy", 0.5, 30, 4)
    totals: dict[str, list[float]] = {}
    decode_s: dict[int, list[float]] = {}
    before = status({"w": ("mixed", totals)})
    for batch in (1, 2, 4, 8):
        prompts = [(0, 30, True)] * batch
        record_step(totals, prompts, true.step_time(prompts))
        for step in range(6):
            items = [(30 + step, 1, False)] * batch
            decode_s.setdefault(batch, []).append(true.step_time(items))
            record_step(totals, items, decode_s[batch][-1])
    after = status({"w": ("mixed", totals)}, uptime=60.0)
    # The spread the steps showed, computed here: each batch size's steps' squared
    # deviations from their mean over its square, pooled over the sizes' degrees of freedom.
    steps = [np.array(seconds) for seconds in decode_s.values()]
    spread = float(np.sqrt(sum(((s / s.mean() - 1) ** 2).sum() for s in steps)
                           / sum(len(s) - 1 for s in steps)))

    during = predict_during(profile, shape, point, requests, before, after)

    assert during["slowdown"] == 1.0  # no host-mate
    assert during["calibration"]["factors"]["prefill"] == pytest.approx(1.4)
    assert 0 < spread < 0.01
    assert during["calibration"]["step_cv"] == pytest.approx(spread)
    true = replace(true, step_cv=spread)
    expected = predict(PlanRequest(true, true, requests, Slo(point["slo"])), shape)
    assert during["predicted"] == pytest.approx(expected)


def test_a_run_is_resimulated_from_the_calibration_it_kept(tmp_path: Path) -> None:
    """`resimulate`: the profile scaled by each kept calibration record (`scaled_by`: the
    record's factors, including the batch sizes the table lacked, and its spread) and each
    point's regenerated trace give back the run's own predictions exactly; a point never
    measured is left out."""
    profile = table_profile()
    profile.save(tmp_path / "profile.json")
    shape = parse_config("1C")
    scaled, record = scale_to_probes(profile, probes(machine(
        profile, {1: 1.3, 2: 0.8, 4: 1.1, 8: 1.0, 16: 1.2, 32: 1.2}, 1.1, 1.4)))
    during_profile, during_record = scale_to_probes(profile, probes(uniform(profile, 1.2)))
    # A spread in the during-speed record only: with one in the forecast's, each of the
    # maximum-rate search's simulations of a 20-request trace would run 80 times.
    during_record["step_cv"] = 0.1
    during_profile = replace(during_profile, step_cv=0.1)
    points = []
    for point, requests in predicted_points(profile, shape, 20, 3, lambda _: (scaled, record),
                                            ["decode-heavy"]):  # the second workload's seeds
        during = predict(PlanRequest(during_profile, during_profile, requests,
                                     Slo(point["slo"])), shape)
        measured = {**during, "ttft_p50_ms": 2 * during["ttft_p50_ms"]}
        points.append({**point, "measured": measured, "error": {},
                       "during": {"predicted": during, "calibration": during_record}})
    unmeasured = {k: v for k, v in points[0].items() if k != "measured"}
    doc = {"config": "1C-t1", "profile": str(tmp_path / "profile.json"), "seed": 3,
           "num_requests": 20, "points": [*points, unmeasured]}

    again = resimulate(doc)

    assert len(again["points"]) == len(points) == 2
    for point, new in zip(points, again["points"], strict=True):
        assert new["predicted"] == pytest.approx(point["predicted"])
        assert new["error"] == errors(point["predicted"], point["measured"])
        assert new["error"]["ttft_p50_ms"] == pytest.approx(
            point["predicted"]["ttft_p50_ms"] / point["measured"]["ttft_p50_ms"] - 1)
        assert new["during"]["predicted"] == pytest.approx(point["during"]["predicted"])
        assert new["during"]["error"]["ttft_p50_ms"] == pytest.approx(-0.5)
