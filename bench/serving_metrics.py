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

Where the time went (`breakdown`), per request that succeeded and carries the server's
clocks (pdcluster's gRPC API; `RequestRecord.server`); each part a difference of two
clocks of one process, so no two machines' clocks are compared:

- `queue`: waiting for admission at the router (`--max-running`);
- `prefill`: the prompt's prefill on a prefill worker, as that worker timed it (zero when
  the decode worker prefilled it itself);
- `kv_transfer`: the decode worker's wait for the KV blocks beyond that prefill;
- `first_token_other`: the rest of the router's time to the first token: placement, the
  messages between router and workers, a prefill the decode worker ran itself, the first
  token's way back;
- `client_first`: the client's TTFT beyond the router's: the network both ways, parsing and
  tokenizing before the router's clock starts, the client's own scheduling;
- `decode`: the router's time from the first token to the last;
- `client_rest`: the client's time from the first token to the end beyond the router's.

The first five add up to the client's TTFT and all seven to its E2E.
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


BREAKDOWN = ("queue", "prefill", "kv_transfer", "first_token_other", "client_first", "decode",
             "client_rest")


def parts(record: RequestRecord) -> dict[str, float] | None:
    """Seconds of each part of `BREAKDOWN` (module docstring) for one request; None when it
    failed or the server did not report its clocks."""
    server = record.server
    if server is None or not succeeded(record):
        return None
    first, last = ttft(record), e2e(record)
    remote = server["queue"] + server["prefill"] + server["transfer"]
    return {"queue": server["queue"], "prefill": server["prefill"],
            "kv_transfer": server["transfer"], "first_token_other": server["ttft"] - remote,
            "client_first": first - server["ttft"], "decode": server["e2e"] - server["ttft"],
            "client_rest": (last - first) - (server["e2e"] - server["ttft"])}


def breakdown(records: Sequence[RequestRecord]) -> dict[str, Any] | None:
    """Where the requests' time went: each part's distribution in ms, and its share of the
    mean E2E; None when no request carries the server's clocks.

    Returns:
        `{"requests": n, "ms": {part: {"mean", "p50", "p90", "p99"}}, "share": {part:
        fraction}}`.
    """
    timed = [p for r in records if (p := parts(r)) is not None]
    if not timed:
        return None
    total = sum(sum(p.values()) for p in timed)
    return {"requests": len(timed),
            "ms": {part: distribution([p[part] for p in timed], 1e3) for part in BREAKDOWN},
            "share": {part: (sum(p[part] for p in timed) / total if total else None)
                      for part in BREAKDOWN}}


def summarize(records: Sequence[RequestRecord], duration: float,
              slo: Slo | None = None) -> dict[str, Any]:
    """The run's summary metrics.

    Args:
        records: one per request sent.
        duration: seconds from the start of the run until the last request ended.
        slo: the objectives for goodput; None leaves goodput out.

    Returns:
        Counts, token totals, throughputs (per second), latency distributions in ms
        (`ttft_ms`, `tpot_ms`, `itl_ms`, `e2e_ms`), `slo` (None without one),
        `figures`: `protocol.slo.score`'s, the keys a plan predicts (`attainment` and
        `goodput_rps` None without an SLO), and `breakdown` (None where the server does not
        report its clocks).
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
        "breakdown": breakdown(records),
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
