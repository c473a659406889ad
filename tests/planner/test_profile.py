"""Profile fits: recovery of a known model, held-out scoring, the file round trip, and a real
(quick) profile of the tiny model."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from commands.worker_pair import transfer_samples
from engine import CacheConfig, LLMEngine
from engine.hardware import cpu_features
from planner.measure import ProfileSettings, fit_profile, measure
from planner.profile import (
    LINEAR_DECODE_FEATURES,
    PREFILL_FEATURES,
    Profile,
    check_same_model,
    decode_feature_names,
    decode_features,
    fit,
    fit_held_out,
    prefill_features,
)
from tests.planner.synthetic import synthetic_profile


def test_fit_recovers_a_known_model_and_scores_held_out_samples() -> None:
    """Samples of 2 ms + 50 us/token + 3 us/kilo-pair with 2 % noise: the fit lands within
    a few percent of each coefficient and the held-out error reflects the noise."""
    rng = np.random.default_rng(0)
    items = [[(int(rng.integers(0, 1024)), int(rng.integers(1, 2048)))
              for _ in range(int(rng.integers(1, 4)))] for _ in range(200)]
    xs = [prefill_features(i) for i in items]
    truth = np.array([2e-3, 5e-5, 3e-6, 0.0])
    ys = [float(np.dot(truth, x) * (1 + rng.normal(0, 0.02))) for x in xs]

    model, error = fit_held_out(PREFILL_FEATURES, xs, ys)

    np.testing.assert_allclose(model.coef[:3], truth[:3], rtol=0.1)
    assert model.coef[3] < 2e-4  # a true zero stays near zero (and never negative)
    assert all(c >= 0 for c in model.coef)
    assert error["num_samples"] == 50  # a quarter held out
    assert 0.005 < error["median"] < 0.03


def test_fit_leaves_out_steps_another_process_interrupted() -> None:
    """One sample in ten runs 2-4x slow (the CPU taken away mid-step): the fit ignores
    them and recovers the model the other samples follow."""
    rng = np.random.default_rng(1)
    xs = [decode_features(rng.integers(16, 1024, int(rng.integers(1, 32))).tolist(),
                          LINEAR_DECODE_FEATURES) for _ in range(200)]
    truth = np.array([0.04, 0.005, 0.01])
    ys = [float(np.dot(truth, x)) * (rng.uniform(2, 4) if i % 10 == 0 else 1.0)
          for i, x in enumerate(xs)]

    model = fit(LINEAR_DECODE_FEATURES, xs, ys)

    np.testing.assert_allclose(model.coef, truth, rtol=1e-6)


def test_the_decode_table_interpolates_between_batch_sizes_and_fits_a_non_monotonic_cost(
        ) -> None:
    """Batch 3 is halfway between the table's 2 and 4, batch 6 a third of the way from 4
    to 10, batch 12 extrapolates the line through 4 and 10; and a cost where batch 2 is
    dearer than batch 4 (as OpenBLAS makes it) is recovered exactly, which no line in the
    batch size can do."""
    names = decode_feature_names([4, 1, 2, 10, 2])
    assert names == ("b1", "b2", "b4", "b10", "context")
    assert decode_features([100, 200, 300], names) == (0.0, 0.5, 0.5, 0.0, 0.6)
    assert decode_features([0] * 6, names) == pytest.approx((0, 0, 2 / 3, 1 / 3, 0))
    assert decode_features([0] * 12, names) == pytest.approx((0, 0, -1 / 3, 4 / 3, 0))
    assert decode_features([0] * 4, names) == (0.0, 0.0, 1.0, 0.0, 0.0)
    truth = np.array([0.04, 0.1, 0.08, 0.12, 0.01])
    rng = np.random.default_rng(2)
    xs = [decode_features(rng.integers(16, 1024, b).tolist(), names)
          for b in (1, 2, 4, 10) for _ in range(6)]

    model = fit(names, xs, [float(np.dot(truth, x)) for x in xs])

    np.testing.assert_allclose(model.coef, truth, rtol=1e-6)


def test_fit_never_returns_a_negative_coefficient() -> None:
    """y falls with x2 in the samples; the step model keeps that coefficient at 0."""
    xs = [(1.0, float(i), float(10 - i)) for i in range(10)]
    ys = [1.0 + 0.5 * i for i in range(10)]
    model = fit(("const", "a", "b"), xs, ys)
    assert all(c >= 0 for c in model.coef)
    assert model.predict((1.0, 4.0, 6.0)) == pytest.approx(3.0)
    with pytest.raises(ValueError, match="need at least 3 samples"):
        fit(("const", "a", "b"), xs[:2], ys[:2])


def test_the_step_spread_is_the_decode_steps_deviation_from_the_fitted_model() -> None:
    """Each decode step twice, 1.1x and 0.9x a known table: the relative least-squares fit
    lands at k = sum(1/f) / sum(1/f^2) of the table (0.980), and the profile's step spread
    is the standard deviation of 1.1 / k and 0.9 / k."""
    names = decode_feature_names([1, 4])
    truth = np.array([0.02, 0.05, 0.01])
    rng = np.random.default_rng(4)
    decode = []
    for i in range(20):  # each step twice: once 1.1x, once 0.9x
        contexts = rng.integers(16, 512, (1, 4)[i % 2]).tolist()
        y = float(np.dot(truth, decode_features(contexts, names)))
        decode += [{"items": [[c - 1, 1, False] for c in contexts], "y": y * f}
                   for f in (1.1, 0.9)]
    prefill = [{"items": [[0, n, True]], "y": 0.01 + 1e-4 * n} for n in range(16, 528, 64)]
    transfer = [{"blocks": b, "y": 0.001 * b, "prefill_s": 0.01 + 1.6e-3 * b}
                for b in range(1, 9)]
    profile = replace(synthetic_profile(), samples={"prefill": prefill, "decode": decode,
                                                    "transfer": transfer})

    fitted = fit_profile(profile)

    k = (1 / 1.1 + 1 / 0.9) / (1 / 1.1 ** 2 + 1 / 0.9 ** 2)
    np.testing.assert_allclose(fitted.decode.coef, truth * k, rtol=1e-6)
    assert fitted.step_cv == pytest.approx(0.1 / k)


def test_profile_file_round_trip_and_model_checks(tmp_path: Path) -> None:
    profile = synthetic_profile()
    profile.save(tmp_path / "p.json")
    assert Profile.load(tmp_path / "p.json") == profile
    with pytest.raises(ValueError, match="of model 'synthetic', not 'smollm2'"):
        check_same_model([profile], "smollm2")
    with pytest.raises(ValueError, match="cannot read it"):
        Profile.load(tmp_path / "missing.json")


@pytest.mark.subprocess
def test_a_quick_profile_of_the_tiny_model(tmp_path: Path) -> None:
    """The real engine and real prefill/decode workers: every sample recorded, the models
    fitted on them and scored on held-out ones, KV capacity as the engine sizes it."""
    settings = ProfileSettings(model="tiny", kv_cache_gb=0.25, repeats=2, quick=True)

    profile = measure(settings, transfer_samples)

    engine = LLMEngine("tiny", cache=CacheConfig(kv_cache_memory_gb=0.25))
    assert profile.num_blocks == engine.block_pool.num_blocks
    assert profile.max_model_len == engine.max_model_len
    assert profile.model == "tiny" and profile.model_id.startswith("LlamaForCausalLM:")
    for key in ("prefill", "decode", "transfer"):
        samples = profile.samples[key]
        assert samples and all(s["y"] > 0 for s in samples)
        assert profile.fit_error[key]["num_samples"] == max(len(samples) // 4, 1)
        assert all(c >= 0 for c in getattr(profile, key).coef)
    assert profile.decode.features == ("b1", "b2", "b4", "b16", "context")  # the quick table
    # Each sample is what the engine scheduled (`SchedulerOutput.items`): decode samples
    # one token per request at a table batch size, prompt samples with prompt tokens.
    for sample in profile.samples["decode"]:
        assert len(sample["items"]) in (1, 2, 4, 16)
        assert all(n == 1 and not is_prompt for _, n, is_prompt in sample["items"])
    assert all(any(is_prompt for *_, is_prompt in s["items"]) for s in profile.samples["prefill"])
    # Prompt steps of many tokens cost more than of a few (orders of magnitude apart).
    assert profile.step_time([(0, 512, True)]) > profile.step_time([(0, 16, True)])
    assert profile.prefill_role_factor > 0
    # Steps timed alone and beside a stepping neighbour engine, at every neighbour point.
    neighbour = profile.samples["neighbour"]
    assert len(neighbour) == 4 and all(p["alone"] and p["beside"] for p in neighbour)
    # The slowdown is the median excess of beside over alone, clamped at 0. How large it
    # is depends on the machine's load (a benchmark's business, not this test's).
    ratios = [float(np.median(p["beside"]) / np.median(p["alone"])) for p in neighbour]
    assert all(np.isfinite(ratio) and ratio > 0 for ratio in ratios), ratios
    assert profile.neighbour_slowdown == max(float(np.median([r - 1 for r in ratios])), 0.0)
    assert profile.workers_per_host == max(cpu_features().cores // profile.torch_threads, 1)
    profile.save(tmp_path / "tiny.json")
    assert Profile.load(tmp_path / "tiny.json") == profile
