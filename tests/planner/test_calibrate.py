"""Scaling a profile to the machine's speed now (`planner/calibrate.py`): from probe steps
on a bare engine, and from the steps serving workers ran between two `Status` snapshots.
Synthetic machines whose true step times are known, so every factor is checked exactly."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import pytest

from engine.engine_loop import record_step
from planner.calibrate import (
    PROBE_BATCHES,
    PROBE_CONTEXT,
    PROBE_PREFILL,
    Calibrator,
    scale_to_probes,
    scale_to_steps,
)
from planner.profile import LinearModel, Profile
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


def test_the_calibrator_times_probes_on_a_kept_engine_and_frees_their_kv() -> None:
    """The real probe steps on the tiny model, twice on one engine: a profile claiming 1 s
    per step is scaled far down, each model by its own factor, and the probes leave the
    KV pool as they found it. The probes are the profile's table sizes (the default,
    every size to 16, is the same steps, more of them), on a KV pool that holds them."""
    batches = (1, 2, 4)
    profile = replace(synthetic_profile(prefill=(1.0, 0.0, 0.0, 0.0), model="tiny"),
                      decode=LinearModel((*(f"b{b}" for b in batches), "context"),
                                         (1.0, 1.0, 1.0, 0.0)),
                      kv_cache_gb=0.02)
    with pytest.raises(ValueError, match="probe batch sizes must be at least 1"):
        Calibrator(profile, batches=())
    calibrator = Calibrator(profile, batches)
    pool = calibrator._sampler.engine.block_pool
    free = pool.num_free_blocks

    for _ in range(2):
        scaled, record = calibrator()
        factors = record["factors"]
        table = [factors[f"decode_b{b}"] for b in batches]
        assert all(0 < f < 0.5 for f in table) and 0 < factors["prefill"] < 0.5
        assert scaled.decode.coef == pytest.approx((*table, 0.0))  # no context cost
        assert scaled.prefill.coef == (factors["prefill"], 0.0, 0.0, 0.0)
        assert set(record["measured_ms"]) == {*(f"decode_b{b}" for b in batches), "prefill"}
        assert pool.num_free_blocks == free
        assert not calibrator._sampler.engine.has_unfinished_requests()


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


def test_calibrating_without_status_or_prompt_steps_is_an_error() -> None:
    profile = table_profile()
    with pytest.raises(ValueError, match="no status from the server"):
        scale_to_steps(profile, [(None, status({}), 1.0)])
    idle = status({"d": ("decode", {"decode_1": [4.0, 0.1, 0.0025, 40.0]})})
    with pytest.raises(ValueError, match="no prompt step was measured"):
        scale_to_steps(profile, [(idle, idle, 1.0)])


