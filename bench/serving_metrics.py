"""Serving metrics from request records: TTFT, TPOT, ITL, E2E, throughput, goodput.

Definitions (per request, from the client's clock):

- TTFT: first chunk's arrival - send time.
- E2E: end of the stream - send time.
- TPOT: (E2E - TTFT) / (output_tokens - 1); undefined for a one-token output.
- ITL: the gap before each chunk after the first, divided evenly among the chunk's tokens
  (a chunk of k tokens after a gap g gives k ITLs of g / k).

Latencies are summarized over the requests that succeeded (finish_reason `stop` or
`length`, no error); failed requests are counted. Throughputs divide by the run's duration.
The run is scored against the SLO by `protocol.slo` (attainment, goodput), the scorer the
planner predicts with.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from itertools import pairwise
from typing import TYPE_CHECKING, Any

import numpy as np

from protocol.serving import Slo, distribution
from protocol.slo import Latencies, score, within

if TYPE_CHECKING:
    from bench.loadgen import RequestRecord

# `vllm bench serve --percentile-metrics` names: TTFT, TPOT, ITL, end-to-end latency.
VLLM_METRICS = ("ttft", "tpot", "itl", "e2el")
_OK_FINISH_REASONS = ("stop", "length")


def met(slo: Slo, record: RequestRecord) -> bool:
    """Whether a request succeeded within every per-request bound of `slo`."""
    return bool(within(slo, latencies([record]))[0])


def latencies(records: Sequence[RequestRecord]) -> Latencies:
    """The records' latencies as `protocol.slo` scores them (NaN where a request failed)."""
    return Latencies.of([(ttft(r), tpot(r), e2e(r)) if succeeded(r) else (None, None, None)
                         for r in records])


def succeeded(record: RequestRecord) -> bool:
    """Finished normally (`stop` or `length`) with at least one token and no error."""
    return (record.error is None and record.finish_reason in _OK_FINISH_REASONS
            and bool(record.chunks))


def ttft(record: RequestRecord) -> float:
    """Seconds from send to the first chunk."""
    return record.chunks[0][0] - record.send


def e2e(record: RequestRecord) -> float:
    """Seconds from send to the end of the stream."""
    return record.finish - record.send


def tpot(record: RequestRecord) -> float | None:
    """Seconds per output token after the first; None for a one-token output."""
    if record.output_tokens < 2:
        return None
    return (e2e(record) - ttft(record)) / (record.output_tokens - 1)


def itls(record: RequestRecord) -> list[float]:
    """Inter-token latencies in seconds, one per token after the first chunk."""
    values = []
    for (previous, _), (now, num_tokens) in pairwise(record.chunks):
        values.extend([(now - previous) / num_tokens] * num_tokens)
    return values


def summarize(records: Sequence[RequestRecord], duration: float,
              slo: Slo | None = None) -> dict[str, Any]:
    """The run's summary metrics.

    Args:
        records: one per request sent.
        duration: seconds from the start of the run until the last request ended.
        slo: the objectives for goodput; None leaves goodput out.

    Returns:
        Counts, token totals, throughputs (per second), latency distributions in ms
        (`ttft_ms`, `tpot_ms`, `itl_ms`, `e2e_ms`), `slo` (None without one) and
        `figures`: `protocol.slo.score`'s, the keys a plan predicts (`attainment` and
        `goodput_rps` None without an SLO).
    """
    if not duration > 0:
        raise ValueError(f"duration must be > 0 seconds, got {duration}")
    ok = [r for r in records if succeeded(r)]
    prompt_tokens = sum(r.prompt_tokens for r in ok)
    output_tokens = sum(r.output_tokens for r in ok)
    return {
        "num_requests": len(records),
        "completed": len(ok),
        "failed": len(records) - len(ok),
        "duration_s": duration,
        "total_prompt_tokens": prompt_tokens,
        "total_output_tokens": output_tokens,
        "request_throughput": len(ok) / duration,
        "output_throughput": output_tokens / duration,
        "total_token_throughput": (prompt_tokens + output_tokens) / duration,
        "ttft_ms": distribution([ttft(r) for r in ok], 1e3),
        "tpot_ms": distribution([t for r in ok if (t := tpot(r)) is not None], 1e3),
        "itl_ms": distribution([t for r in ok for t in itls(r)], 1e3),
        "e2e_ms": distribution([e2e(r) for r in ok], 1e3),
        "slo": None if slo is None else slo.as_dict(),
        "figures": score(latencies(records), duration, slo),
    }


def token_throughput_over_time(records: Sequence[RequestRecord], duration: float,
                               bin_s: float = 1.0) -> list[float]:
    """Output tokens per second in consecutive bins from the start of the run.

    Args:
        records: every request (a failed one's tokens were still served).
        duration: seconds the run lasted.
        bin_s: bin width in seconds; the last bin ends at `duration` and may be shorter.

    Returns:
        One rate per bin: tokens arriving in `[i * bin_s, (i + 1) * bin_s)` / the bin's width.
    """
    num_bins = max(1, math.ceil(duration / bin_s))
    counts = np.zeros(num_bins)
    for record in records:
        for time, num_tokens in record.chunks:
            counts[min(int(time // bin_s), num_bins - 1)] += num_tokens
    widths = np.minimum(bin_s, duration - np.arange(num_bins) * bin_s)
    return (counts / widths).tolist()
