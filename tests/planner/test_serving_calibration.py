"""Calibration through a running server (`commands.serving_calibration`): the probe and a
workload's replays pooled, and the pilot trace drawn from a trace's own distribution."""

from __future__ import annotations

from dataclasses import asdict, replace
from typing import Any

import numpy as np
import pytest

from bench.loadgen import RequestRecord
from bench.run import Target
from commands.serving_calibration import (
    ServingCalibrator,
    first_token_seconds,
    pilot_trace,
    probe_prompts,
    response_latency,
)
from engine.engine_loop import record_step
from planner.profile import Profile
from planner.simulator import ClusterShape, Simulation
from protocol.serving import TraceRequest
from tests.planner.synthetic import poisson_arrivals, random_prompts, trace
from tests.planner.test_calibrate import status, table_profile


def test_serving_calibration_needs_a_status_address() -> None:
    with pytest.raises(ValueError, match="needs a status address"):
        ServingCalibrator(table_profile(), ClusterShape("colocated", 0, 2),
                          Target("grpc", "127.0.0.1:1"))


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
    calibrator = ServingCalibrator(profile, ClusterShape("colocated", 0, 1),
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


SEED = 424_242


def mixed_trace(num: int = 60, seed: int = 5) -> list[TraceRequest]:
    """40 % documents (400-500 prompt tokens, 8 output), 60 % chat (30-60 prompt, 40-64
    output), Poisson at 0.5 req/s, random token ids."""
    rng = np.random.default_rng(seed)
    documents = rng.random(num) < 0.4
    prompts = [p for d, s in zip(documents, range(num), strict=True)
               for p in random_prompts(1, (400, 500) if d else (30, 60), seed * 1000 + s)]
    outputs = [8 if d else int(rng.integers(40, 65)) for d in documents]
    return trace(poisson_arrivals(num, 0.5, seed), prompts, outputs)


def test_the_pilot_is_drawn_from_the_traces_lengths_and_gaps_but_sends_none_of_its_prompts(
        ) -> None:
    """Each pilot request has a (prompt length, output length) pair of the trace's and
    each gap between arrivals is one of the trace's; the mix follows the trace's; no pilot
    prompt shares even its first KV block (16 tokens) with a trace prompt, so the trace
    finds nothing of the pilot in the prefix cache; the seed fixes the draw."""
    requests = mixed_trace()
    pairs = {(len(r.prompt_token_ids), r.output_len) for r in requests}
    gaps = set(np.diff([r.timestamp for r in requests]).round(9))
    firsts = {tuple(r.prompt_token_ids[:16]) for r in requests}

    pilot = pilot_trace(requests, 200, SEED)

    assert len(pilot) == 200 and pilot[0].timestamp == 0.0
    assert {(len(r.prompt_token_ids), r.output_len) for r in pilot} <= pairs
    assert set(np.diff([r.timestamp for r in pilot]).round(9)) <= gaps
    assert not {tuple(r.prompt_token_ids[:16]) for r in pilot} & firsts
    share = np.mean([len(r.prompt_token_ids) >= 400 for r in requests])
    assert np.mean([len(r.prompt_token_ids) >= 400 for r in pilot]) == pytest.approx(
        share, abs=0.1)
    assert pilot_trace(requests, 200, SEED) == pilot
    assert pilot_trace(requests, 200, SEED + 1) != pilot
    assert len(pilot_trace(requests[:1], 3, 0)) == 3  # one request: no gaps, all at 0
    with pytest.raises(ValueError, match="a pilot needs requests"):
        pilot_trace(requests, 0, SEED)


def test_the_probe_prefills_the_traces_long_prompts_too() -> None:
    requests = mixed_trace()
    p90 = int(np.percentile([len(r.prompt_token_ids) for r in requests], 90))
    assert 400 <= p90 <= 500
    assert probe_prompts(requests, 1022) == (128, p90)
    assert probe_prompts(requests, 300) == (128, 300)  # within the model's length
    assert probe_prompts(trace(np.zeros(3), random_prompts(3, 40, 1), 4), 1022) == (40, 128)


def test_the_serving_paths_latency_is_the_pilots_median_first_token_gap() -> None:
    """A served machine whose path adds 35 ms to every first token, and 200 ms to one
    request's (a straggler): the latency is the median gap, 35 ms, whatever latency the
    profiles already carry; a machine faster than simulated gives 0, not a negative
    latency; failed requests (NaN) are left out."""
    profile = replace(table_profile(), step_cv=0.0, response_latency_s=0.5)
    shape = ClusterShape("colocated", 0, 1)
    requests = trace(poisson_arrivals(9, 4.0, seed=2), random_prompts(9, (20, 90), 2), 5)
    simulated = Simulation(shape, *[replace(profile, response_latency_s=0.0)] * 2
                           ).run(requests).ttft
    measured = simulated + 0.035
    measured[3] += 0.2
    measured[5] = np.nan

    assert response_latency(profile, profile, shape, requests, measured) == \
        pytest.approx(0.035)
    assert response_latency(profile, profile, shape, requests, simulated - 0.01) == 0.0
    with pytest.raises(ValueError, match="no pilot request has a measured first token"):
        response_latency(profile, profile, shape, requests, np.full(9, np.nan))
    with pytest.raises(ValueError, match="8 measured TTFTs for 9 requests"):
        response_latency(profile, profile, shape, requests, measured[:8])


def test_first_tokens_are_read_from_a_report_in_request_order() -> None:
    """Send to first chunk, as the bench defines TTFT; NaN for a failed request or one that
    streamed nothing."""
    def record(index: int, send: float, chunks: list, error: str | None = None) -> dict:
        return asdict(RequestRecord(index, send, 2, send=send, chunks=chunks,
                                    finish_reason="error" if error else "length",
                                    error=error))

    report = {"requests": [record(2, 1.0, [[1.25, 1]]), record(0, 0.0, [[0.5, 1], [0.6, 1]]),
                           record(1, 0.5, []), record(3, 2.0, [[2.1, 1]], "aborted")]}
    assert first_token_seconds(report) == pytest.approx([0.5, np.nan, 0.25, np.nan],
                                                        nan_ok=True)
