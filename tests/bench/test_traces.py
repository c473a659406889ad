"""Arrival processes, synthetic workloads and JSONL traces."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from bench.traces import WorkloadSpec, arrival_times, make_workload
from protocol.serving import TraceRequest, read_trace, write_trace


def gaps(times: np.ndarray) -> np.ndarray:
    return np.diff(times)


def test_arrivals_are_seeded() -> None:
    first = arrival_times(100, 5.0, "gamma", 2.0, seed=7)
    assert np.array_equal(first, arrival_times(100, 5.0, "gamma", 2.0, seed=7))
    assert not np.array_equal(first, arrival_times(100, 5.0, "gamma", 2.0, seed=8))
    assert first[0] == 0.0 and np.all(np.diff(first) >= 0)


@pytest.mark.parametrize(("process", "cv", "rate_tolerance"),
                         [("poisson", 1.0, 0.03), ("gamma", 0.5, 0.03), ("gamma", 3.0, 0.07)])
def test_arrivals_have_the_asked_rate_and_burstiness(process: str, cv: float,
                                                     rate_tolerance: float) -> None:
    times = arrival_times(20001, 10.0, process, cv, seed=0)
    measured_cv = gaps(times).std() / gaps(times).mean()
    assert measured_cv == pytest.approx(cv, rel=0.05)
    assert 20000 / times[-1] == pytest.approx(10.0, rel=rate_tolerance)


def test_fixed_and_unlimited_arrivals() -> None:
    assert arrival_times(4, 4.0, "fixed") == pytest.approx([0.0, 0.25, 0.5, 0.75])
    assert arrival_times(3, float("inf")).tolist() == [0.0, 0.0, 0.0]


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"rate": 0.0}, "rate must be > 0"),
    ({"process": "uniform"}, "arrival must be one of"),
    ({"burstiness": 0.0}, "burstiness must be > 0"),
    ({"num_requests": 0}, "num_requests must be >= 1"),
])
def test_arrival_errors(kwargs: dict, message: str) -> None:
    args = {"num_requests": 10, "rate": 1.0, **kwargs}
    with pytest.raises(ValueError, match=message):
        arrival_times(**args)


def test_synthetic_lengths_and_ids() -> None:
    spec = WorkloadSpec("synthetic", prompt_len=(5, 9), output_len=(2, 3),
                        vocab_range=(100, 200), seed=3)
    requests = make_workload(spec, [0.0, 0.5, 1.0] * 20)
    assert [r.timestamp for r in requests[:3]] == [0.0, 0.5, 1.0]
    assert {len(r.prompt_token_ids) for r in requests} == {5, 6, 7, 8, 9}
    assert {r.output_len for r in requests} == {2, 3}
    ids = np.concatenate([r.prompt_token_ids for r in requests])
    assert ids.min() >= 100 and ids.max() < 200
    assert make_workload(spec, [0.0, 0.5, 1.0] * 20) == requests


def test_shared_prefix_groups() -> None:
    spec = WorkloadSpec("shared-prefix", prompt_len=(4, 4), output_len=(1, 1),
                        num_prefix_groups=3, prefix_len=16, seed=1)
    requests = make_workload(spec, [0.0] * 30)
    prefixes = {tuple(r.prompt_token_ids[:16]) for r in requests}
    assert len(prefixes) == 3
    assert all(len(r.prompt_token_ids) == 20 for r in requests)
    # Suffixes are each request's own.
    assert len({tuple(r.prompt_token_ids[16:]) for r in requests}) == 30


def test_mixed_draws_every_kind() -> None:
    requests = make_workload(WorkloadSpec("mixed", prefix_len=64), [0.0] * 40)
    lengths = [len(r.prompt_token_ids) for r in requests]
    outputs = [r.output_len for r in requests]
    assert max(lengths) >= 1024   # long-prompt
    assert max(outputs) >= 512    # long-output
    with pytest.raises(ValueError, match="do not apply to the mixed workload"):
        WorkloadSpec("mixed", prompt_len=(1, 2))


def test_workload_errors() -> None:
    with pytest.raises(ValueError, match="workload must be one of"):
        WorkloadSpec("chat")
    with pytest.raises(ValueError, match="prompt_len must satisfy"):
        WorkloadSpec(prompt_len=(0, 4))
    with pytest.raises(ValueError, match="vocab_range"):
        WorkloadSpec(vocab_range=(50, 50))


def test_trace_round_trip(tmp_path: Path) -> None:
    requests = [TraceRequest(0.0, 4, [101, 102, 103]), TraceRequest(0.5, 2, prompt="Hello"),
                TraceRequest(1.25, 8, [7])]
    path = tmp_path / "trace.jsonl"
    write_trace(path, requests)
    assert read_trace(path) == requests


def test_trace_prompt_len_shift_and_order(tmp_path: Path) -> None:
    path = tmp_path / "trace.jsonl"
    lines = [{"timestamp": 12.5, "prompt_len": 6, "output_len": 3},
             {"timestamp": 10.0, "prompt": "Hi", "output_len": 1}]
    path.write_text("\n".join(json.dumps(line) for line in lines) + "\n\n")
    first, second = read_trace(path, vocab_range=(100, 110), seed=4)
    assert (first.timestamp, first.prompt, first.output_len) == (0.0, "Hi", 1)
    assert second.timestamp == 2.5 and second.output_len == 3
    assert len(second.prompt_token_ids) == 6
    assert all(100 <= i < 110 for i in second.prompt_token_ids)
    assert read_trace(path, vocab_range=(100, 110), seed=4)[1] == second


def test_trace_errors_name_the_line(tmp_path: Path) -> None:
    path = tmp_path / "bad.jsonl"
    path.write_text('{"timestamp": 0, "prompt_len": 4, "output_len": 2}\n'
                    '{"timestamp": 1, "output_len": 2}\n')
    with pytest.raises(ValueError, match=r"bad.jsonl:2: .*one of prompt, prompt_token_ids"):
        read_trace(path)
    path.write_text('{"timestamp": 0, "prompt": "x", "output_len": 0}\n')
    with pytest.raises(ValueError, match=r"bad.jsonl:1: output_len must be >= 1"):
        read_trace(path)
