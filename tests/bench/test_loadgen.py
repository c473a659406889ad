"""The load driver against a scripted in-process backend: timing, concurrency, caps, errors."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import pytest

from bench.loadgen import LoadOptions, LoadResult, StreamEvent, run_load
from protocol.serving import TraceRequest


class ScriptedBackend:
    """Streams `output_len` one-token chunks, `token_s` apart; fails a prompt of [0]; a
    prompt of [2] stops after 3 chunks and waits for a gate nobody opens (it can only end
    by the client's timeout, however fast or slow the machine)."""

    def __init__(self, token_s: float = 0.01) -> None:
        self.token_s = token_s
        self.in_flight = 0
        self.max_in_flight = 0
        self.gate = asyncio.Event()

    async def stream(self, request: TraceRequest) -> AsyncIterator[StreamEvent]:
        self.in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.in_flight)
        try:
            if request.prompt_token_ids == [0]:
                raise ConnectionError("refused")
            for i in range(request.output_len):
                if request.prompt_token_ids == [2] and i == 3:
                    await self.gate.wait()
                await asyncio.sleep(self.token_s)
                last = i == request.output_len - 1
                yield StreamEvent(1, "length" if last else None,
                                  prompt_tokens=7 if last else None,
                                  output_tokens=request.output_len if last else None)
        finally:
            self.in_flight -= 1


def requests(timestamps: list[float], output_len: int = 3) -> list[TraceRequest]:
    return [TraceRequest(t, output_len, [1, 2]) for t in timestamps]


def run(backend: ScriptedBackend, reqs: list[TraceRequest], **options: Any) -> LoadResult:
    return asyncio.run(run_load(backend, reqs, LoadOptions(progress=False, **options)))


def test_records_each_chunk_on_schedule() -> None:
    result = run(ScriptedBackend(), requests([0.0, 0.05, 0.1]))
    assert [r.index for r in result.records] == [0, 1, 2]
    for record, arrival in zip(result.records, [0.0, 0.05, 0.1], strict=True):
        assert record.arrival == arrival
        assert record.send >= arrival
        assert [n for _, n in record.chunks] == [1, 1, 1]
        times = [t for t, _ in record.chunks]
        assert record.send < times[0] < times[1] < times[2] <= record.finish
        assert (record.finish_reason, record.error) == ("length", None)
        assert (record.prompt_tokens, record.output_tokens) == (7, 3)
    assert result.duration >= result.records[-1].finish
    # Sent in arrival order (how late each send is depends on the machine's load: no bound).
    sends = [r.send for r in result.records]
    assert sends == sorted(sends)


def test_max_concurrency_holds_requests_back() -> None:
    backend = ScriptedBackend()
    result = run(backend, requests([0.0] * 4), max_concurrency=1)
    assert backend.max_in_flight == 1
    for previous, record in zip(result.records, result.records[1:], strict=False):
        assert record.send >= previous.finish
    assert result.records[-1].send - result.records[-1].arrival >= 3 * 3 * backend.token_s


def test_duration_stops_sending() -> None:
    result = run(ScriptedBackend(), requests([0.0, 0.02, 0.5, 0.6]), duration=0.1)
    assert [r.index for r in result.records] == [0, 1]
    assert all(r.finish_reason == "length" for r in result.records)


def test_failures_and_timeouts_are_recorded() -> None:
    # The held request can only time out; the quick one (20 ms) has 25 times its length.
    reqs = [TraceRequest(0.0, 2, [0]), TraceRequest(0.0, 50, [2]), TraceRequest(0.0, 2, [1])]
    result = run(ScriptedBackend(), reqs, request_timeout=0.5)
    refused, held, ok = result.records
    assert refused.error == "ConnectionError: refused" and refused.chunks == []
    assert held.error == "timed out after 0.5 s" and held.finish_reason is None
    assert len(held.chunks) == 3
    assert ok.error is None and ok.output_tokens == 2


def test_options_are_checked() -> None:
    with pytest.raises(ValueError, match="max_concurrency must be >= 1"):
        LoadOptions(max_concurrency=0)
    with pytest.raises(ValueError, match="duration must be > 0"):
        LoadOptions(duration=0)
