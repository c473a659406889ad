"""Serving metric math on hand-made records: exact TTFT/TPOT/ITL/E2E, percentiles, goodput."""

from __future__ import annotations

import pytest

from bench.loadgen import RequestRecord
from bench.serving_metrics import (
    breakdown,
    e2e,
    itls,
    met,
    summarize,
    token_throughput_over_time,
    tpot,
    ttft,
)
from protocol.serving import Slo


def record(send: float, chunks: list[tuple[float, int]], finish: float, *,
           finish_reason: str | None = "length", error: str | None = None,
           prompt_tokens: int = 10, server: dict[str, float] | None = None) -> RequestRecord:
    output_tokens = sum(n for _, n in chunks)
    return RequestRecord(index=0, arrival=send, max_tokens=output_tokens,
                         prompt_tokens=prompt_tokens, send=send, chunks=chunks, finish=finish,
                         output_tokens=output_tokens, finish_reason=finish_reason, error=error,
                         server=server)


def test_latencies_of_one_request() -> None:
    # Sent at 1.0; tokens at 1.5, 1.7 and two together at 2.1; the stream ends at 2.2.
    r = record(1.0, [(1.5, 1), (1.7, 1), (2.1, 2)], 2.2)
    assert ttft(r) == pytest.approx(0.5)
    assert e2e(r) == pytest.approx(1.2)
    assert tpot(r) == pytest.approx(0.7 / 3)
    # The two-token chunk's 0.4 s gap is split evenly between its tokens.
    assert itls(r) == pytest.approx([0.2, 0.2, 0.2])


def test_one_token_output_has_no_tpot_or_itl() -> None:
    r = record(0.0, [(0.3, 1)], 0.3)
    assert tpot(r) is None
    assert itls(r) == []
    assert met(Slo({"ttft_ms": 400, "tpot_ms": 1}), r)
    assert not met(Slo({"ttft_ms": 200}), r)


def test_summary_counts_throughput_and_goodput() -> None:
    records = [
        record(0.0, [(0.1, 1), (0.3, 1), (0.5, 1)], 0.5),        # ttft 100 ms, tpot 200 ms
        record(0.5, [(1.0, 1), (1.1, 1)], 1.1),                  # ttft 500 ms, tpot 100 ms
        record(1.0, [(1.2, 1), (1.8, 1), (2.0, 1)], 2.0,         # ttft 200 ms, tpot 400 ms
               finish_reason="stop"),
        record(1.5, [(1.6, 1)], 1.7, finish_reason="error", error="boom"),
        record(1.8, [], 1.9, finish_reason=None, error="UNAVAILABLE: gone"),
    ]
    summary = summarize(records, duration=2.0, slo=Slo({"ttft_ms": 300, "tpot_ms": 250}))
    assert summary["num_requests"] == 5
    assert summary["completed"] == 3
    assert summary["failed"] == 2
    assert summary["total_prompt_tokens"] == 30
    assert summary["total_output_tokens"] == 8
    assert summary["request_throughput"] == pytest.approx(1.5)
    assert summary["output_throughput"] == pytest.approx(4.0)
    assert summary["total_token_throughput"] == pytest.approx(19.0)
    assert summary["ttft_ms"]["mean"] == pytest.approx(800 / 3)
    assert summary["ttft_ms"]["p50"] == pytest.approx(200.0)
    assert summary["tpot_ms"]["mean"] == pytest.approx(700 / 3)
    assert summary["e2e_ms"]["p50"] == pytest.approx(600.0)
    # ITLs: 200, 200 | 100 | 600, 200 ms.
    assert summary["itl_ms"]["mean"] == pytest.approx(260.0)
    # Only the first request meets both: the second is late to its first token, the third
    # too slow per token, and failed requests never count.
    figures = summary["figures"]
    assert figures["goodput_rps"] == pytest.approx(0.5)
    assert figures["attainment"] == pytest.approx(0.2)
    assert summary["slo"] == {"ttft_ms": 300.0, "tpot_ms": 250.0, "attainment": 0.9}
    # The SLO figures, under the keys a plan predicts: TTFTs 100, 500, 200 ms.
    assert figures["ttft_p50_ms"] == pytest.approx(200.0)
    assert figures["ttft_p90_ms"] == pytest.approx(200 + 0.8 * 300)
    assert figures["tpot_p90_ms"] == pytest.approx(summary["tpot_ms"]["p90"])


def test_summary_without_slo_leaves_goodput_out() -> None:
    summary = summarize([record(0.0, [(0.1, 1)], 0.1)], duration=1.0)
    assert summary["slo"] is None
    assert summary["figures"]["goodput_rps"] is None
    assert summary["figures"]["attainment"] is None
    assert summary["figures"]["ttft_p50_ms"] == pytest.approx(100.0)


def test_throughput_over_time_bins_tokens_by_arrival() -> None:
    records = [record(0.0, [(0.2, 1), (0.9, 2)], 0.9),
               record(0.5, [(1.2, 1), (1.5, 2)], 1.5, finish_reason="error", error="x")]
    # [0, 1): 3 tokens; [1, 1.5]: 3 tokens over half a second.
    assert token_throughput_over_time(records, duration=1.5) == pytest.approx([3.0, 6.0])
    assert token_throughput_over_time(records, duration=1.5, bin_s=0.5) == pytest.approx(
        [2.0, 4.0, 6.0])


def test_the_breakdown_splits_each_request_between_router_workers_and_client() -> None:
    # Sent at 1.0, first token at 1.5, end at 2.2 (client). The router saw: 0.05 s in its
    # queue, a remote prefill of 0.2 s, a KV wait of 0.05 s, first token 0.45 s after
    # arrival, the end 1.1 s after it. The second request prefilled on its decode worker.
    timed = record(1.0, [(1.5, 1), (1.7, 1), (2.1, 2)], 2.2,
                   server={"queue": 0.05, "prefill": 0.2, "transfer": 0.05, "ttft": 0.45,
                           "e2e": 1.1})
    local = record(3.0, [(3.1, 1), (3.3, 1)], 3.4,
                   server={"queue": 0.0, "prefill": 0.0, "transfer": 0.0, "ttft": 0.08,
                           "e2e": 0.36})
    unreported = record(0.0, [(0.1, 1)], 0.1)
    failed = record(0.0, [(0.1, 1)], 0.2, finish_reason="error", error="boom",
                    server={"queue": 0.0, "prefill": 0.0, "transfer": 0.0, "ttft": 0.1,
                            "e2e": 0.1})

    out = breakdown([timed, local, unreported, failed])

    assert out["requests"] == 2
    means = {part: stats["mean"] for part, stats in out["ms"].items()}
    assert means == pytest.approx({
        "queue": 25.0, "prefill": 100.0, "kv_transfer": 25.0,
        "first_token_other": (150 + 80) / 2,       # 0.45 - 0.3 and 0.08 - 0
        "client_first": (50 + 20) / 2,             # client TTFT 0.5 and 0.1
        "decode": (650 + 280) / 2,                 # router 1.1 - 0.45 and 0.36 - 0.08
        "client_rest": (50 + 20) / 2})             # client 0.7 and 0.3 after the first
    e2e_total = (1.2 + 0.4) * 1e3 / 2
    assert sum(means.values()) == pytest.approx(e2e_total)
    assert out["share"]["decode"] == pytest.approx((650 + 280) / 2 / e2e_total)
    assert breakdown([unreported, failed]) is None
    assert summarize([unreported], 1.0)["breakdown"] is None
