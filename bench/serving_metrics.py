"""Serving metrics from request records: TTFT, TPOT, ITL, E2E, throughput, goodput.

Definitions (per request, from the client's clock):

- TTFT: first chunk's arrival - send time.
- E2E: end of the stream - send time.
- TPOT: (E2E - TTFT) / (output_tokens - 1); undefined for a one-token output.
- ITL: the gap before each chunk after the first, divided evenly among the chunk's tokens
  (a chunk of k tokens after a gap g gives k ITLs of g / k).

Latencies are summarized over the requests that succeeded (finish_reason `stop` or
`length`, no error); failed requests are counted. Throughputs divide by the run's duration.
Goodput is the rate of requests that succeeded within both SLOs; a request without a TPOT
(one output token) meets any TPOT SLO.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from itertools import pairwise
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    from bench.loadgen import RequestRecord

PERCENTILES = (50, 90, 99)
# `vllm bench serve --percentile-metrics` names: TTFT, TPOT, ITL, end-to-end latency.
VLLM_METRICS = ("ttft", "tpot", "itl", "e2el")
_OK_FINISH_REASONS = ("stop", "length")


@dataclass(frozen=True)
class Slo:
    """Latency objectives in milliseconds; None leaves one unconstrained.

    Args:
        ttft_ms: time to first token at most this.
        tpot_ms: time per output token at most this.
        e2e_ms: end-to-end latency at most this.
    """

    ttft_ms: float | None = None
    tpot_ms: float | None = None
    e2e_ms: float | None = None

    @classmethod
    def from_goodput(cls, pairs: Sequence[str]) -> Slo:
        """Parse `vllm bench serve --goodput` pairs: `ttft:MS`, `tpot:MS`, `e2el:MS`.

        Raises:
            ValueError: an unknown key or a value that is not a number >= 0.
        """
        names = {"ttft": "ttft_ms", "tpot": "tpot_ms", "e2el": "e2e_ms"}
        fields: dict[str, float] = {}
        for pair in pairs:
            key, sep, value = pair.partition(":")
            if not sep or key not in names:
                raise ValueError(f"goodput: expected KEY:MS with KEY one of ttft, tpot, e2el, "
                                 f"got {pair!r}")
            try:
                number = float(value)
            except ValueError:
                raise ValueError(f"goodput: {key} must be a number of ms, got {value!r}") from None
            if not number >= 0:
                raise ValueError(f"goodput: {key} must be >= 0 ms, got {value}")
            fields[names[key]] = number
        if not fields:
            raise ValueError("goodput: give at least one of ttft:MS, tpot:MS, e2el:MS")
        return cls(**fields)

    @classmethod
    def parse(cls, text: str) -> Slo:
        """Parse `ttft=MS,tpot=MS` (either part may be left out).

        Raises:
            ValueError: an unknown key or a value that is not a positive number.
        """
        fields: dict[str, float] = {}
        for part in filter(None, (p.strip() for p in text.split(","))):
            key, _, value = part.partition("=")
            if key not in ("ttft", "tpot"):
                raise ValueError(f"slo: unknown objective {key!r}; use ttft=MS,tpot=MS")
            try:
                number = float(value)
            except ValueError:
                raise ValueError(f"slo: {key} must be a number of ms, got {value!r}") from None
            if not number > 0:
                raise ValueError(f"slo: {key} must be > 0 ms, got {value}")
            fields[f"{key}_ms"] = number
        if not fields:
            raise ValueError("slo: give ttft=MS, tpot=MS or both")
        return cls(**fields)

    def met(self, record: RequestRecord) -> bool:
        """Whether a request succeeded within every objective."""
        if not succeeded(record):
            return False
        if self.ttft_ms is not None and ttft(record) * 1e3 > self.ttft_ms:
            return False
        if self.e2e_ms is not None and e2e(record) * 1e3 > self.e2e_ms:
            return False
        record_tpot = tpot(record)
        return self.tpot_ms is None or record_tpot is None or record_tpot * 1e3 <= self.tpot_ms


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


def distribution(values: Sequence[float], scale: float = 1.0) -> dict[str, float | None]:
    """Mean and percentiles (linear interpolation), each times `scale`; None when empty.

    Args:
        values: the samples.
        scale: e.g. 1e3 to turn seconds into milliseconds.

    Returns:
        `{"mean", "p50", "p90", "p99"}`.
    """
    keys = ("mean", *(f"p{p}" for p in PERCENTILES))
    if not values:
        return dict.fromkeys(keys)
    array = np.asarray(values, dtype=np.float64) * scale
    stats = [array.mean(), *np.percentile(array, PERCENTILES)]
    return {key: float(value) for key, value in zip(keys, stats, strict=True)}


def summarize(records: Sequence[RequestRecord], duration: float,
              slo: Slo | None = None) -> dict[str, Any]:
    """The run's summary metrics.

    Args:
        records: one per request sent.
        duration: seconds from the start of the run until the last request ended.
        slo: the objectives for goodput; None leaves goodput out.

    Returns:
        Counts, token totals, throughputs (per second), latency distributions in ms
        (`ttft_ms`, `tpot_ms`, `itl_ms`, `e2e_ms`), and `slo`, `goodput` (requests/s) and
        `slo_attainment` (fraction of all requests sent) — None without an SLO.
    """
    if not duration > 0:
        raise ValueError(f"duration must be > 0 seconds, got {duration}")
    ok = [r for r in records if succeeded(r)]
    prompt_tokens = sum(r.prompt_tokens for r in ok)
    output_tokens = sum(r.output_tokens for r in ok)
    good = sum(slo.met(r) for r in records) if slo else 0
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
        "slo": None if slo is None else asdict(slo),
        "goodput": good / duration if slo else None,
        "slo_attainment": good / len(records) if slo and records else None,
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
