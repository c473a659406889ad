"""Scoring a run against an SLO: the one definition `pdcluster bench` measures with and
`pdcluster plan` predicts with.

A run is scored from each request's latencies (`Latencies`). A request meets the SLO when it
succeeded and its TTFT, TPOT and E2E are each within the tightest bound the SLO names on
that metric (`Slo.bound`); a one-token answer has no TPOT and meets any TPOT bound; a failed
request meets none. `score` gives a run's figures under one key set, `FIGURE_KEYS`, which a
bench summary's `figures`, a plan's `predicted` and `--validate`'s `measured` share:

- `<metric>_p<q>_ms`: the q-th percentile of TTFT, TPOT or E2E in ms over the requests that
  succeeded (TPOT: over those with one); the keys of the SLO's percentile bounds, so
  `Slo.meets` reads the figures as they are;
- `attainment`: the share of the requests sent that meet the SLO;
- `goodput_rps`: those requests per second of the run.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from protocol.serving import METRICS, PERCENTILE_KEYS, PERCENTILES, Slo, distribution

ATTAINMENT = "attainment"
GOODPUT = "goodput_rps"
FIGURE_KEYS = (*PERCENTILE_KEYS, ATTAINMENT, GOODPUT)


@dataclass(frozen=True)
class Latencies:
    """Each request's latencies in a run, in seconds, one entry per request sent.

    Args:
        ttft: time to the first token; NaN where the request failed.
        tpot: time per output token after the first; NaN where there is none (a one-token
            answer, or a failed request).
        e2e: time to the last token; NaN where the request failed.

    Raises:
        ValueError: the three differ in length.
    """

    ttft: np.ndarray
    tpot: np.ndarray
    e2e: np.ndarray

    def __post_init__(self) -> None:
        for name in METRICS:
            object.__setattr__(self, name, np.asarray(getattr(self, name), dtype=np.float64))
        lengths = {len(getattr(self, name)) for name in METRICS}
        if len(lengths) > 1:
            raise ValueError(f"latencies: ttft, tpot and e2e differ in length ({lengths})")

    @classmethod
    def of(cls, requests: Sequence[tuple[float | None, float | None, float | None]]
           ) -> Latencies:
        """From (ttft, tpot, e2e) per request, None where undefined."""
        columns = np.array([[np.nan if v is None else v for v in r] for r in requests],
                           dtype=np.float64).reshape(-1, 3)
        return cls(*columns.T)

    @property
    def succeeded(self) -> np.ndarray:
        """Per request, whether it succeeded (has a first token)."""
        return np.isfinite(self.ttft)


def within(slo: Slo, latencies: Latencies) -> np.ndarray:
    """Per request, whether it meets the SLO's per-request bounds (see the module
    docstring)."""
    good = latencies.succeeded
    for metric in METRICS:
        if (bound := slo.bound(metric)) is not None:
            # `not >`: a NaN (no TPOT) meets the bound; failures are already out.
            good &= ~(getattr(latencies, metric) * 1e3 > bound)
    return good


def score(latencies: Latencies, duration_s: float, slo: Slo | None) -> dict[str, float | None]:
    """A run's figures (`FIGURE_KEYS`).

    Args:
        latencies: every request sent.
        duration_s: seconds the run lasted (first arrival to last token); goodput's
            denominator. A run in which nothing finished has no duration (0 or NaN) and a
            goodput of 0.
        slo: the objectives; None leaves `attainment` and `goodput_rps` None.

    Returns:
        Percentiles in ms (None where no request has the metric), `attainment` (None also
        when there is no request) and `goodput_rps`.
    """
    ok = latencies.succeeded
    out: dict[str, float | None] = {}
    for metric in METRICS:
        values = getattr(latencies, metric)[ok]
        dist = distribution(values[np.isfinite(values)].tolist(), 1e3)
        for q in PERCENTILES:
            out[f"{metric}_p{q}_ms"] = dist[f"p{q}"]
    out[ATTAINMENT] = out[GOODPUT] = None
    if slo is not None:
        good = int(within(slo, latencies).sum())
        out[ATTAINMENT] = good / len(ok) if len(ok) else None
        out[GOODPUT] = good / duration_s if duration_s > 0 else 0.0
    return out
