"""Drive one trace at one server and build its report: what `plan --validate` and the
experiments measure a configuration with.

`bench_run` sends a list of trace requests with the `pdcluster bench` load generator and
adds each worker's utilization over the run (from the cumulative counters in `Status`
before and after it, `protocol.status.utilization_between`).
"""

from __future__ import annotations

import asyncio
import sys
import time
from collections.abc import Sequence
from contextlib import aclosing
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import numpy as np

from bench.loadgen import (
    GrpcBackend,
    LoadOptions,
    LoadResult,
    OpenAIBackend,
    run_load,
    served_model,
)
from bench.report import build_report, fmt, write_report
from bench.serving_metrics import summarize
from protocol.serving import Slo, TraceRequest, write_trace
from protocol.status import UTILIZATION_KEYS, utilization_between

# Workers push their stats every 0.5 s: after a run, wait for one push that follows its end.
STATS_SETTLE_S = 0.6


def mean_utilization(workers: dict[str, dict[str, Any]], role: str | None = None
                     ) -> dict[str, float] | None:
    """The mean of each utilization figure over the workers (of one role when given).

    Returns:
        `{key: mean}` for `UTILIZATION_KEYS`, or None when no worker matches.
    """
    chosen = [w for w in workers.values() if role is None or w.get("role") == role]
    if not chosen:
        return None
    return {key: float(np.mean([w[key] for w in chosen])) for key in UTILIZATION_KEYS}


def utilization_summary(before: dict[str, Any] | None, after: dict[str, Any] | None
                        ) -> dict[str, Any] | None:
    """Per worker, per role and overall utilization of a run (None without snapshots)."""
    if before is None or after is None:
        return None
    workers = utilization_between(before, after)
    roles = sorted({str(w["role"]) for w in workers.values()})
    return {"workers": workers, "by_role": {r: mean_utilization(workers, r) for r in roles},
            "mean": mean_utilization(workers)}


# ---- one benchmark run ----

@dataclass(frozen=True)
class Target:
    """Where a run sends its requests.

    Args:
        backend: `grpc` or `openai`.
        address: `host:port` (grpc) or the OpenAI base URL (openai).
        status_address: a pdcluster gRPC address to read utilization from, or None.
    """

    backend: str
    address: str
    status_address: str | None = None


@dataclass(frozen=True)
class RunSettings:
    """What every run of an experiment shares.

    Args:
        request_timeout: seconds before a streaming request fails.
        config: put into every report's config (model, experiment, ...).
    """

    request_timeout: float = 600.0
    config: dict[str, Any] = field(default_factory=dict)


def bench_run(target: Target, requests: Sequence[TraceRequest], labels: Sequence[str], *,
              label: str, out: Path | None, settings: RunSettings, slo: Slo | None = None,
              max_concurrency: int | None = None, extra_config: dict[str, Any] | None = None
              ) -> dict[str, Any]:
    """Drive one workload with the bench's load generator and build its report.

    Args:
        target: the server.
        requests: the workload.
        labels: each request's class, stored as `config.request_classes`.
        label: the run's name.
        out: the folder for report.json, trace.jsonl and plots; None writes nothing.
        settings: shared settings.
        slo: objectives for goodput and SLO attainment.
        max_concurrency: requests in flight at most.
        extra_config: more config entries for the report.

    Returns:
        The report (with `utilization` when the target has a status address).
    """
    options = LoadOptions(max_concurrency, None, settings.request_timeout,
                          progress=sys.stdout.isatty())
    before = status_snapshot(target.status_address)
    result, model = asyncio.run(_load(target, requests, options))
    if target.status_address:
        time.sleep(STATS_SETTLE_S)
    after = status_snapshot(target.status_address)
    summary = summarize(result.records, result.duration, slo)
    config = {**settings.config, **(extra_config or {}), "label": label,
              "backend": target.backend, "address": target.address, "served_model": model,
              "max_concurrency": max_concurrency, "request_timeout": settings.request_timeout,
              "slo": None if slo is None else slo.as_dict(), "request_classes": list(labels),
              "started_at": datetime.now(UTC).isoformat(timespec="seconds")}
    report = build_report(label, config, summary, result)
    report["utilization"] = utilization_summary(before, after)
    if out is not None:
        write_report(out, report, result)
        write_trace(out / "trace.jsonl", requests[:len(result.records)])
    print(_one_line(label, summary), flush=True)
    return report


async def _load(target: Target, requests: Sequence[TraceRequest], options: LoadOptions
                ) -> tuple[LoadResult, str | None]:
    if target.backend == "grpc":
        async with aclosing(GrpcBackend(target.address)) as grpc_backend:
            return await run_load(grpc_backend, requests, options), None
    model = await served_model(target.address)
    async with aclosing(OpenAIBackend(target.address, model)) as openai_backend:
        return await run_load(openai_backend, requests, options), model


def status_snapshot(address: str | None) -> dict[str, Any] | None:
    """`client.status()` of a pdcluster gRPC address (None without one, or on failure)."""
    if address is None:
        return None
    from router.client import PdClusterClient

    try:
        with PdClusterClient(address, timeout=10) as client:
            return client.status()
    except Exception as e:  # utilization is a bonus; the run's latencies still stand
        print(f"warning: no status from {address}: {e}", file=sys.stderr)
        return None


def _one_line(label: str, summary: dict[str, Any]) -> str:
    text = (f"{label}: {summary['completed']}/{summary['num_requests']} ok, "
            f"{fmt(summary['request_throughput'])} req/s, "
            f"{fmt(summary['output_throughput'])} out tok/s, "
            f"TTFT p90 {fmt(summary['ttft_ms']['p90'])} ms, "
            f"TPOT p90 {fmt(summary['tpot_ms']['p90'])} ms")
    figures = summary["figures"]
    if figures["attainment"] is not None:
        text += f", goodput {fmt(figures['goodput_rps'])} req/s ({figures['attainment']:.1%})"
    return text
