"""A serving benchmark's report: a table, `report.json`, PNG plots, and side-by-side comparisons.

`report.json`:

    {"schema": "pdcluster.bench/1", "label": str, "config": {...every CLI setting...},
     "summary": {...bench.serving_metrics.summarize...},
     "throughput_over_time": {"bin_s": 1.0, "output_tokens_per_s": [float, ...]},
     "requests": [{"index", "arrival", "max_tokens", "prompt_tokens", "send",
                   "chunks": [[time, num_tokens], ...], "finish", "output_tokens",
                   "finish_reason", "error", "server": {"queue", "prefill", "transfer",
                   "ttft", "e2e"} or null}, ...]}
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

import numpy as np
from matplotlib.figure import Figure
from rich.console import Console
from rich.table import Table

from bench.loadgen import LoadResult, RequestRecord
from bench.serving_metrics import (
    BREAKDOWN,
    e2e,
    itls,
    latencies,
    succeeded,
    token_throughput_over_time,
    tpot,
    ttft,
)
from protocol.serving import Slo
from protocol.slo import ATTAINMENT, GOODPUT, score

SCHEMA = "pdcluster.bench/1"
THROUGHPUT_BIN_S = 1.0
# (label, path into the summary, higher is better) of what a comparison shows.
COMPARED = (
    ("request throughput (req/s)", ("request_throughput",), True),
    ("output throughput (tok/s)", ("output_throughput",), True),
    ("total throughput (tok/s)", ("total_token_throughput",), True),
    ("goodput (req/s)", ("figures", GOODPUT), True),
    ("SLO attainment", ("figures", ATTAINMENT), True),
    ("TTFT mean (ms)", ("ttft_ms", "mean"), False),
    ("TTFT p99 (ms)", ("ttft_ms", "p99"), False),
    ("TPOT mean (ms)", ("tpot_ms", "mean"), False),
    ("TPOT p99 (ms)", ("tpot_ms", "p99"), False),
    ("ITL p99 (ms)", ("itl_ms", "p99"), False),
    ("E2E mean (ms)", ("e2e_ms", "mean"), False),
    ("E2E p99 (ms)", ("e2e_ms", "p99"), False),
    ("failed requests", ("failed",), False),
)


def build_report(label: str, config: dict[str, Any], summary: dict[str, Any],
                 result: LoadResult) -> dict[str, Any]:
    """The report as a JSON-ready dict (schema in the module docstring).

    Args:
        label: names the run in comparisons.
        config: the settings of the run.
        summary: `bench.serving_metrics.summarize` of the run.
        result: the records and duration.

    Returns:
        The report.
    """
    series = token_throughput_over_time(result.records, result.duration, THROUGHPUT_BIN_S)
    return {"schema": SCHEMA, "label": label, "config": config, "summary": summary,
            "throughput_over_time": {"bin_s": THROUGHPUT_BIN_S, "output_tokens_per_s": series},
            "requests": [asdict(r) for r in result.records]}


def write_report(out_dir: Path, report: dict[str, Any], result: LoadResult) -> list[Path]:
    """Write `report.json` and the plots into `out_dir` (created if missing).

    Args:
        out_dir: the folder.
        report: from `build_report`.
        result: the records and duration the report was built from.

    Returns:
        The files written: report.json, latency_cdf.png, throughput.png.
    """
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / "report.json"
    path.write_text(json.dumps(report, indent=1, default=str))
    label = report["label"]
    return [path, plot_latency_cdfs(out_dir / "latency_cdf.png", result.records, label),
            plot_throughput(out_dir / "throughput.png", report["throughput_over_time"], label)]


def plot_latency_cdfs(path: Path, records: Sequence[RequestRecord], title: str) -> Path:
    """Empirical CDFs of TTFT, TPOT and E2E (ms) over the successful requests.

    Args:
        path: the PNG to write.
        records: the run's requests.
        title: the figure's title.

    Returns:
        `path`.
    """
    ok = [r for r in records if succeeded(r)]
    samples = {"TTFT": [ttft(r) for r in ok],
               "TPOT": [t for r in ok if (t := tpot(r)) is not None],
               "E2E": [e2e(r) for r in ok]}
    figure = Figure(figsize=(12, 3.6), layout="constrained")
    for axes, (name, values) in zip(figure.subplots(1, 3), samples.items(), strict=True):
        x = np.sort(np.asarray(values) * 1e3)
        axes.step(x, np.arange(1, len(x) + 1) / max(len(x), 1), where="post")
        axes.set(xlabel=f"{name} (ms)", ylabel="fraction of requests", ylim=(0, 1.02))
        axes.grid(alpha=0.3)
    figure.suptitle(f"{title}: latency CDFs")
    figure.savefig(path, dpi=100)
    return path


def plot_throughput(path: Path, series: dict[str, Any], title: str) -> Path:
    """Output tokens per second over the run, in bins.

    Args:
        path: the PNG to write.
        series: the report's `throughput_over_time`.
        title: the figure's title.

    Returns:
        `path`.
    """
    rates = series["output_tokens_per_s"]
    starts = np.arange(len(rates)) * series["bin_s"]
    figure = Figure(figsize=(8, 3.6), layout="constrained")
    axes = figure.subplots()
    axes.bar(starts, rates, width=series["bin_s"], align="edge")
    axes.set(xlabel="time since start (s)", ylabel="output tokens/s",
             title=f"{title}: output throughput")
    axes.grid(alpha=0.3)
    figure.savefig(path, dpi=100)
    return path


def print_summary(label: str, summary: dict[str, Any], console: Console | None = None) -> None:
    """Print the summary as a table.

    Args:
        label: the run's name (the title).
        summary: from `bench.serving_metrics.summarize`.
        console: where to print; a new stdout console by default.
    """
    table = Table(title=f"pdcluster bench · {label}")
    table.add_column("metric")
    table.add_column("value", justify="right")
    counts = (("requests", "num_requests"), ("completed", "completed"), ("failed", "failed"),
              ("duration (s)", "duration_s"), ("prompt tokens", "total_prompt_tokens"),
              ("output tokens", "total_output_tokens"),
              ("request throughput (req/s)", "request_throughput"),
              ("output throughput (tok/s)", "output_throughput"),
              ("total throughput (tok/s)", "total_token_throughput"))
    for name, key in counts:
        table.add_row(name, fmt(summary[key]))
    for key, name in (("ttft_ms", "TTFT"), ("tpot_ms", "TPOT"), ("itl_ms", "ITL"),
                      ("e2e_ms", "E2E")):
        for stat, value in summary[key].items():
            table.add_row(f"{name} {stat} (ms)", fmt(value))
    parts = summary.get("breakdown")
    for part in BREAKDOWN if parts else ():
        stats = parts["ms"][part]
        table.add_row(f"time in {part.replace('_', ' ')}: mean / p90 (ms)",
                      f"{fmt(stats['mean'])} / {fmt(stats['p90'])} "
                      f"({_percent(parts['share'][part])})")
    if summary["slo"] is not None:
        table.add_row("SLO", ", ".join(f"{k.removesuffix('_ms')} <= {v:g} ms"
                                       for k, v in summary["slo"].items() if k != "attainment"))
        figures = summary["figures"]
        table.add_row("goodput (req/s)", fmt(figures[GOODPUT]))
        table.add_row("SLO attainment", "-" if figures[ATTAINMENT] is None
                      else f"{figures[ATTAINMENT]:.1%}")
    (console or Console()).print(table)


def _percent(share: float | None) -> str:
    return "-" if share is None else f"{share:.0%} of E2E"


def load_report(path: Path) -> dict[str, Any]:
    """Read a `report.json`.

    Raises:
        ValueError: the file is not a pdcluster bench report.
    """
    report = json.loads(path.read_text())
    if not isinstance(report, dict) or report.get("schema") != SCHEMA:
        raise ValueError(f"{path}: not a pdcluster bench report (schema {SCHEMA})")
    return report


def compare_reports(reports: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """Metrics of several reports side by side, with ratios against the first.

    Args:
        reports: loaded reports; the first is the baseline.

    Returns:
        One row per metric of `COMPARED`: `{"metric", "higher_is_better", "values",
        "ratios"}`; `values[i]` is report i's value (None when it has none) and `ratios[i]`
        is `values[i] / values[0]` (None when either is missing or the baseline is zero).
    """
    if not reports:
        raise ValueError("compare at least one report")
    rows = []
    for metric, path, higher_is_better in COMPARED:
        values = [_lookup(report["summary"], path) for report in reports]
        base = values[0]
        ratios = [None if value is None or not base else value / base for value in values]
        rows.append({"metric": metric, "higher_is_better": higher_is_better,
                     "values": values, "ratios": ratios})
    return rows


def print_comparison(reports: Sequence[dict[str, Any]], console: Console | None = None) -> None:
    """Print `compare_reports` as a table: each report's value and its ratio to the first.

    Args:
        reports: loaded reports; the first is the baseline.
        console: where to print; a new stdout console by default.
    """
    table = Table(title=f"pdcluster bench · compared with {reports[0]['label']}")
    table.add_column("metric")
    for report in reports:
        table.add_column(report["label"], justify="right")
    for row in compare_reports(reports):
        cells = [fmt(row["values"][0])]
        cells += [f"{fmt(value)} ({fmt(ratio, 'x')})"
                  for value, ratio in zip(row["values"][1:], row["ratios"][1:], strict=True)]
        table.add_row(row["metric"], *cells)
    (console or Console()).print(table)


def _lookup(summary: dict[str, Any], path: tuple[str, ...]) -> float | None:
    value: Any = summary
    for key in path:
        value = value.get(key) if isinstance(value, dict) else None
    return value


def fmt(value: float | None, suffix: str = "") -> str:
    """Three significant figures (one decimal from 100 up); `-` for None."""
    if value is None:
        return "-"
    if isinstance(value, int):
        return f"{value}{suffix}"
    return f"{value:.3g}{suffix}" if abs(value) < 100 else f"{value:.1f}{suffix}"


def vllm_result(result: LoadResult, settings: dict[str, Any], percentile_metrics: Sequence[str],
                percentiles: Sequence[float], goodput: Slo | None) -> dict[str, Any]:
    """The run as `vllm bench serve --save-result` writes it, field for field, so the two
    tools' files compare directly. Latency statistics cover successful requests, in ms.

    Args:
        result: the records and duration.
        settings: vLLM's run fields (`date`, `backend`, `label`, `model_id`, `tokenizer_id`,
            `num_prompts`, `request_rate`, `burstiness`, `max_concurrency`).
        percentile_metrics: which of `VLLM_METRICS` get mean/median/std/percentiles.
        percentiles: e.g. (99,) for `p99_ttft_ms`.
        goodput: the `Slo` of `--goodput`, or None (then `request_goodput` is null).

    Returns:
        The JSON-ready dict.
    """
    records, duration = result.records, result.duration
    ok = [r for r in records if succeeded(r)]
    per_request = {
        "ttft": [ttft(r) for r in ok],
        "tpot": [t for r in ok if (t := tpot(r)) is not None],
        "itl": [t for r in ok for t in itls(r)],
        "e2el": [e2e(r) for r in ok],
    }
    input_tokens = sum(r.prompt_tokens for r in ok)
    output_tokens = sum(r.output_tokens for r in ok)
    out: dict[str, Any] = {
        **settings,
        "duration": duration,
        "completed": len(ok),
        "failed": len(records) - len(ok),
        "total_input_tokens": input_tokens,
        "total_output_tokens": output_tokens,
        "request_throughput": len(ok) / duration,
        "request_goodput": score(latencies(records), duration, goodput)[GOODPUT],
        "output_throughput": output_tokens / duration,
        "total_token_throughput": (input_tokens + output_tokens) / duration,
        "input_lens": [r.prompt_tokens for r in records],
        "output_lens": [r.output_tokens if succeeded(r) else 0 for r in records],
        "ttfts": [ttft(r) if succeeded(r) else 0.0 for r in records],
        "itls": [itls(r) if succeeded(r) else [] for r in records],
        "latencies": [e2e(r) if succeeded(r) else 0.0 for r in records],
        "start_times": [r.send for r in records],
        "errors": [r.error or "" for r in records],
        **_per_second_peaks(ok),
    }
    for name in percentile_metrics:
        values = np.asarray(per_request[name], dtype=np.float64) * 1e3
        empty = not len(values)
        out[f"mean_{name}_ms"] = 0.0 if empty else float(values.mean())
        out[f"median_{name}_ms"] = 0.0 if empty else float(np.median(values))
        out[f"std_{name}_ms"] = 0.0 if empty else float(values.std())
        for p in percentiles:
            word = str(int(p)) if int(p) == p else str(p)
            out[f"p{word}_{name}_ms"] = 0.0 if empty else float(np.percentile(values, p))
    return out


def _per_second_peaks(ok: Sequence[RequestRecord]) -> dict[str, float | int]:
    """vLLM's `max_output_tokens_per_s` and `max_concurrent_requests`: one-second buckets
    from the first send; a request counts in every bucket it was active in, so the second
    can exceed the concurrency cap when one request ends and the next starts in it."""
    if not ok:
        return {"max_output_tokens_per_s": 0.0, "max_concurrent_requests": 0}
    start = min(r.send for r in ok)
    num_buckets = int(np.ceil(max(r.finish for r in ok) - start)) + 1
    tokens = np.zeros(num_buckets)
    active = np.zeros(num_buckets)
    for r in ok:
        for when, num_tokens in r.chunks:
            tokens[int(when - start)] += num_tokens
        active[int(r.send - start):int(r.finish - start) + 1] += 1
    return {"max_output_tokens_per_s": float(tokens.max()),
            "max_concurrent_requests": int(active.max())}
