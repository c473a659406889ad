"""The planner-accuracy experiment and the calibration it runs on (`planner.calibrate`): probe
steps scale the profile; each point is predicted from the calibration taken just before it."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from bench.run import Target
from cluster.validate import errors
from engine.engine_loop import record_step
from experiments.planner_accuracy import (
    LEVELS,
    SLO_FACTORS,
    WORKLOADS,
    ServingCalibrator,
    parse_config,
    predict_during,
    predict_point,
    predicted_points,
    resimulate,
    workload,
    workload_slo,
)
from planner.calibrate import (
    PROBE_BATCHES,
    PROBE_CONTEXT,
    PROBE_PREFILL,
    Calibrator,
    scale_to_probes,
    scale_to_steps,
)
from planner.plan import PlanRequest, max_rate, predict, simulate
from planner.profile import LinearModel, Profile
from planner.simulator import ClusterShape
from protocol.serving import Slo
from tests.planner.synthetic import synthetic_profile

PREFILL = (0.01, 0.002, 0.001, 0.0005)
# A decode table as CPU BLAS makes it: batch 2 dearer than batch 4.
TABLE = ("b1", "b2", "b4", "b8", "b16", "b32", "context")
DECODE = (0.004, 0.009, 0.007, 0.01, 0.016, 0.03, 0.01)


def table_profile(decode: tuple[float, ...] = DECODE, model: str = "synthetic") -> Profile:
    return replace(synthetic_profile(prefill=PREFILL, model=model),
                   decode=LinearModel(TABLE, decode))


def machine(profile: Profile, table: dict[int, float], context: float, prefill: float
            ) -> Profile:
    """A machine whose decode table entries (per batch size), context term and prefill
    are these multiples of the profile's."""
    coef = tuple(c * (table[int(f[1:])] if f[0] == "b" else context)
                 for f, c in zip(profile.decode.features, profile.decode.coef, strict=True))
    return replace(profile, decode=LinearModel(profile.decode.features, coef),
                   prefill=LinearModel(profile.prefill.features,
                                       tuple(v * prefill for v in profile.prefill.coef)))


def uniform(profile: Profile, factor: float, prefill: float | None = None) -> Profile:
    return machine(profile, dict.fromkeys((1, 2, 4, 8, 16, 32), factor), factor,
                   factor if prefill is None else prefill)


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
        assert profile.step_time(sample["items"]) == pytest.approx(sample["y"], rel=1e-6)


def table_value(profile: Profile, batch: int) -> float:
    """The profile's decode table at `batch` (interpolated between its sizes): a step
    attending to nothing has no context term."""
    return profile.step_time([(0, 0, False)] * batch)


def test_a_uniformly_slower_machine_scales_each_model_by_its_slowdown() -> None:
    profile = table_profile()
    true = uniform(profile, 1.5, prefill=1.2)
    samples = probes(true)

    scaled, record = scale_to_probes(profile, samples)

    assert record["factors"] == {**{f"decode_b{b}": pytest.approx(1.5) for b in PROBE_BATCHES},
                                 "decode_context": pytest.approx(1.5),
                                 "prefill": pytest.approx(1.2)}
    for batch in (*PROBE_BATCHES, 24, 32, 40):  # 40: beyond every table
        items = [(PROBE_CONTEXT, 1, False)] * batch
        assert scaled.step_time(items) == pytest.approx(true.step_time(items))
    assert scaled.prefill.coef == pytest.approx(true.prefill.coef)
    assert scaled.transfer == profile.transfer
    reproduces(scaled, samples)
    # The record: median probe steps (8 steps attending to 129-136 tokens: median 132.5).
    assert record["measured_ms"]["decode_b8"] == pytest.approx(
        1e3 * true.step_time([(131.5, 1, False)] * 8), abs=0.01)
    assert record["profile_ms"]["prefill"] == pytest.approx(
        1e3 * profile.step_time([(0, PROBE_PREFILL, True)]), abs=0.01)


def test_every_probed_batch_gets_its_own_entry_and_the_rest_are_interpolated() -> None:
    """A machine whose step is not smooth in the batch size, as this VM's BLAS makes it:
    odd batches 1.6x what the profile's table gives them, even ones 1.1x. Every probe is
    reproduced exactly, sizes the profile's table lacks (3, 5-7, 9-15) included; the
    unprobed batch 32 takes the largest probe's factor, and 24 lies between 16 and 32."""
    profile = table_profile()
    sizes = (*PROBE_BATCHES, 32)
    factor = {b: 1.6 if b % 2 else 1.1 for b in sizes}
    true = replace(profile, decode=LinearModel(
        (*(f"b{b}" for b in sizes), "context"),
        (*(table_value(profile, b) * factor[b] for b in sizes), DECODE[-1] * 1.1)))
    samples = probes(true)

    scaled, record = scale_to_probes(profile, samples)

    assert record["factors"]["decode_context"] == pytest.approx(1.1)
    assert record["factors"]["decode_b7"] == pytest.approx(1.6)
    assert scaled.decode.features == (*(f"b{b}" for b in sizes), "context")
    reproduces(scaled, samples)
    for batch in (24, 32):
        items = [(PROBE_CONTEXT, 1, False)] * batch
        assert scaled.step_time(items) == pytest.approx(true.step_time(items))


def test_a_profile_without_a_batch_table_is_refused_and_a_sparse_one_is_filled_in() -> None:
    """A profile of the older linear decode model cannot be scaled per batch: a clear
    error, not a silent guess. A table lacking probed sizes gains an entry for each, and
    each probed batch's median step is reproduced."""
    linear = synthetic_profile(prefill=PREFILL, decode=(0.004, 0.002, 0.01))
    with pytest.raises(ValueError, match=r"no batch table: profile again"):
        scale_to_probes(linear, probes(linear))
    sparse = replace(linear, decode=LinearModel(("b1", "b4", "context"), (0.01, 0.02, 0.01)))

    scaled, record = scale_to_probes(sparse, probes(table_profile()))

    assert scaled.decode.features == (*(f"b{b}" for b in PROBE_BATCHES), "context")
    for batch in PROBE_BATCHES:
        assert record["measured_ms"][f"decode_b{batch}"] == pytest.approx(
            1e3 * scaled.step_time([(131.5, 1, False)] * batch), abs=0.01)


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


def test_the_calibrator_times_probes_on_a_kept_engine_and_frees_their_kv() -> None:
    """The real probe steps on the tiny model, twice on one engine: a profile claiming 1 s
    per step is scaled far down, each model by its own factor, and the probes leave the
    KV pool as they found it."""
    profile = replace(synthetic_profile(prefill=(1.0, 0.0, 0.0, 0.0), model="tiny"),
                      decode=LinearModel(("b1", "b2", "b4", "b8", "b16", "context"),
                                         (1.0, 1.0, 1.0, 1.0, 1.0, 0.0)))
    calibrator = Calibrator(profile)
    pool = calibrator._sampler.engine.block_pool
    free = pool.num_free_blocks

    for _ in range(2):
        scaled, record = calibrator()
        factors = record["factors"]
        table = [factors[f"decode_b{b}"] for b in PROBE_BATCHES]
        assert all(0 < f < 0.5 for f in table) and 0 < factors["prefill"] < 0.5
        assert scaled.decode.coef == pytest.approx((*table, 0.0))  # no context cost
        assert scaled.prefill.coef == (factors["prefill"], 0.0, 0.0, 0.0)
        assert set(record["measured_ms"]) == {*(f"decode_b{b}" for b in PROBE_BATCHES),
                                              "prefill"}
        assert pool.num_free_blocks == free
        assert not calibrator._sampler.engine.has_unfinished_requests()


def status(workers: dict[str, tuple[str, dict[str, list[float]]]], uptime: float = 0.0
           ) -> dict[str, Any]:
    """A `Status` snapshot: per worker id, (role, step totals); busy time is the steps'."""
    pools: dict[str, list[dict[str, Any]]] = {}
    for worker_id, (role, totals) in workers.items():
        pools.setdefault(role, []).append({
            "worker_id": worker_id, "role": role, "uptime_s": uptime,
            "busy_seconds": sum(v[1] for v in totals.values()),
            "step_totals": {k: list(v) for k, v in totals.items()}})
    return {"pools": pools}


def test_serving_steps_scale_the_profile_to_what_the_workers_ran() -> None:
    """Worker step totals as `EngineLoop` records them on a machine that is 1.3x the
    profile's in decode (1.6x at batch 2) and 1.25x in prefill, on 1P+1D: decode groups
    where both workers of the host were busy (their measured seconds carry the neighbour
    slowdown, which is divided out), and a prefill group on the prefill worker (whose
    steps carry the role factor, which the modelled time includes). The scaled profile
    reproduces every measured step; batch 3 ran only twice and is left out."""
    profile = replace(table_profile(), neighbour_slowdown=0.1, prefill_role_factor=1.2)
    true = machine(profile, {1: 1.3, 2: 1.6, 4: 1.3, 8: 1.3, 16: 1.3, 32: 1.3}, 1.3, 1.25)
    d_totals: dict[str, list[float]] = {"decode_5": [7.0, 1.0, 0.2, 50.0]}  # earlier steps
    p_totals: dict[str, list[float]] = {}
    before = status({"d": ("decode", d_totals), "p": ("prefill", p_totals)})
    for batch, steps in ((1, 8), (2, 8), (3, 2), (4, 8), (8, 8)):
        prompts = [(0, 16, True)] * batch  # the group's prefill, with its neighbour too
        record_step(d_totals, prompts, true.step_time(prompts) * 1.1)
        for step in range(steps):
            items = [(16 + step, 1, False)] * batch
            record_step(d_totals, items, true.step_time(items) * 1.1)  # a busy neighbour
    mid = status({"d": ("decode", d_totals), "p": ("prefill", p_totals)})
    prompt = [(0, PROBE_PREFILL, True)]
    for _ in range(4):
        record_step(p_totals, prompt, true.step_time(prompt) * 1.2)
    after = status({"d": ("decode", d_totals), "p": ("prefill", p_totals)})

    scaled, record = scale_to_steps(profile, [(before, mid, 1.1), (mid, after, 1.0)])

    assert record["steps"] == {"decode_b1": 8, "decode_b2": 8, "decode_b3": 2,
                               "decode_b4": 8, "decode_b8": 8, "prompt": 9}
    assert set(record["measured_ms"]) == {"decode_b1", "decode_b2", "decode_b4", "decode_b8",
                                          "prefill"}
    assert record["factors"]["decode_b2"] == pytest.approx(1.6)
    assert record["factors"]["prefill"] == pytest.approx(1.25)
    for batch in (1, 2, 4, 8):
        for step in range(8):
            items = [(16 + step, 1, False)] * batch
            assert scaled.step_time(items) == pytest.approx(true.step_time(items))
    assert scaled.step_time(prompt) == pytest.approx(true.step_time(prompt))


def test_serving_steps_give_the_spread_of_step_times() -> None:
    """Two decode workers whose batch-1 steps alternate 1.2x and 0.8x their own mean (one
    worker twice as slow as the other): the pooled spread is the sample coefficient of
    variation of either, sqrt(4 x 0.2^2 / 3); the scaled profile carries it. A batch size
    stepped once adds nothing to it."""
    profile = table_profile()
    fast: dict[str, list[float]] = {}
    slow: dict[str, list[float]] = {}
    before = status({"a": ("decode", fast), "b": ("decode", slow)})
    record_step(fast, [(0, 16, True)], 0.1)
    for totals, mean in ((fast, 0.05), (slow, 0.1)):
        for factor in (1.2, 0.8, 1.2, 0.8):
            record_step(totals, [(16, 1, False)], mean * factor)
    record_step(slow, [(16, 1, False)] * 3, 5.0)  # one batch-3 step: no spread to measure
    after = status({"a": ("decode", fast), "b": ("decode", slow)})

    scaled, record = scale_to_steps(profile, [(before, after, 1.0)])

    assert record["step_cv"] == pytest.approx((4 * 0.2 ** 2 / 3) ** 0.5)
    assert scaled.step_cv == record["step_cv"]
    assert profile.step_cv == 0.0


def test_serving_calibration_without_status_or_prompt_steps_is_an_error() -> None:
    profile = table_profile()
    with pytest.raises(ValueError, match="needs a status address"):
        ServingCalibrator(profile, parse_config("2C"), Target("grpc", "127.0.0.1:1"))
    with pytest.raises(ValueError, match="no status from the server"):
        scale_to_steps(profile, [(None, status({}), 1.0)])
    idle = status({"d": ("decode", {"decode_1": [4.0, 0.1, 0.0025, 40.0]})})
    with pytest.raises(ValueError, match="no prompt step was measured"):
        scale_to_steps(profile, [(idle, idle, 1.0)])


def decode_window(profile: Profile, slowdown: float, totals: dict[str, list[float]],
                  steps: int) -> tuple[tuple[dict[str, Any], dict[str, Any], float], float]:
    """One colocated worker's window: a prompt step, then `steps` batch-1 decode steps,
    on a machine `slowdown` times the profile's; and the profile's seconds for them."""
    before = status({"w": ("mixed", totals)})
    record_step(totals, [(0, 16, True)], slowdown * profile.step_time([(0, 16, True)]))
    modelled = 0.0
    for step in range(steps):
        seconds = profile.step_time([(16 + step, 1, False)])
        modelled += seconds
        record_step(totals, [(16 + step, 1, False)], slowdown * seconds)
    return (before, status({"w": ("mixed", totals)}, uptime=60.0), 1.0), modelled


def test_a_workloads_calibration_pools_the_probe_with_its_last_replay() -> None:
    """A probe that caught the machine 1.5x slower than the replays ran (1.2x) is
    outweighed, by step count, by the last replay of the point's workload; a workload
    not yet replayed gets the probe alone, and a later replay of a workload replaces its
    earlier one."""
    profile = table_profile()
    calibrator = ServingCalibrator(profile, parse_config("1C"),
                                   Target("grpc", "127.0.0.1:1", "127.0.0.1:1"))
    totals: dict[str, list[float]] = {}
    probe, probe_s = decode_window(profile, 1.5, totals, 10)
    (before, after, _), replay_s = decode_window(profile, 1.2, totals, 90)
    calibrator.remember("decode-heavy", before, after)

    _, alone = calibrator.scale([probe], "prefill-heavy")
    _, pooled = calibrator.scale([probe], "decode-heavy")

    assert alone["pooled"] == ["probe"] and pooled["pooled"] == ["probe", "replay"]
    assert alone["steps"]["decode_b1"] == 10 and pooled["steps"]["decode_b1"] == 100
    assert alone["factors"]["decode_b1"] == pytest.approx(1.5)
    # Pooled seconds over the profile's (a decode step is linear in its context).
    assert pooled["factors"]["decode_b1"] == pytest.approx(
        (1.5 * probe_s + 1.2 * replay_s) / (probe_s + replay_s))
    (before, after, _), _ = decode_window(profile, 1.0, totals, 10)
    calibrator.remember("decode-heavy", before, after, "pilot")
    _, newer = calibrator.scale([probe], "decode-heavy")
    assert newer["pooled"] == ["probe", "pilot"] and newer["steps"]["decode_b1"] == 20
    assert newer["factors"]["decode_b1"] == pytest.approx(1.25)  # equal steps, contexts
    calibrator.remember("decode-heavy", before, None)  # the server did not answer
    assert calibrator.scale([probe], "decode-heavy")[1]["pooled"] == ["probe"]


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
