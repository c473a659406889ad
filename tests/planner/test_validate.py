"""The pure parts of `plan --validate`: which configs are served, serve flags, errors."""

from __future__ import annotations

import pytest

from cluster.validate import errors, neighbours, serve_flags
from tests.planner.synthetic import synthetic_profile


def config(mode: str, prefill: int, decode: int, attainment: float = 0.5) -> dict:
    return {"mode": mode, "prefill": prefill, "decode": decode, "threads_per_worker": 2,
            "max_num_batched_tokens": 512, "local_prefill_threshold": 64,
            "predicted": {"attainment": attainment}}


def test_the_recommended_config_and_its_nearest_neighbours_are_served() -> None:
    configs = [config("disaggregated", 1, 1), config("disaggregated", 2, 1),
               config("disaggregated", 1, 2), config("disaggregated", 3, 1),
               config("colocated", 0, 2), config("colocated", 0, 3)]
    doc = {"configs": configs, "recommended": configs[1]}
    assert neighbours(doc, 3) == [configs[1], configs[0], configs[3]]
    nothing = {"configs": [config("colocated", 0, 1, 0.2), config("colocated", 0, 2, 0.7)],
               "recommended": None}
    assert neighbours(nothing, 1) == [nothing["configs"][1]]


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
