"""A worker's figures: what it pushes (`WorkerStats`, inside the `Stats` message), what the
router adds when it reports the pools (`WorkerStatus`), and how two `Status` snapshots give
what happened between them (utilization, steps by shape).

The counters are cumulative since the worker started, so the difference of two snapshots
is exact over the window between them, where a single snapshot's `utilization` covers
only the last stats interval.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import msgspec

UTILIZATION_KEYS = ("busy", "transfer_wait", "idle", "flops_utilization",
                    "bandwidth_utilization")


class Utilization(msgspec.Struct, kw_only=True):
    """Where the last stats interval went, as shares of it.

    Args:
        busy: computing.
        idle: nothing to do.
        transfer_wait: idle while requests waited for KV.
        flops_utilization: model FLOP/s over the measured matmul peak (MFU).
        bandwidth_utilization: bytes read per second over the measured bandwidth.
    """

    busy: float = 0.0
    idle: float = 0.0
    transfer_wait: float = 0.0
    flops_utilization: float = 0.0
    bandwidth_utilization: float = 0.0


class WorkerStats(msgspec.Struct, kw_only=True):
    """Load, memory, work counters and utilization of one worker, read on its engine thread.

    Args:
        num_running: requests in the running batch.
        num_waiting: requests queued inside the engine.
        num_parked: requests held outside the batch (waiting for remote KV, or prefilled
            and waiting to be shipped).
        num_waiting_for_kv: parked requests whose KV has not landed yet.
        num_preemptions: running requests preempted when blocks ran out (cumulative).
        num_blocks: KV blocks in the pool.
        num_free_blocks: of them, free (prefix-cached ones included).
        kv_usage: share of blocks in use.
        prefix_hit_rate: prompt tokens served from the prefix cache, as a share.
        prefix_cache_hits: prompt tokens found in the prefix cache (cumulative).
        prefix_cache_queries: prompt tokens looked up in it (cumulative).
        step_token_counts: engine steps by the tokens they computed: one count per bucket
            of `engine.stats.STEP_TOKEN_BUCKETS` (vLLM's of `vllm:iteration_tokens_total`)
            and one above them (cumulative).
        step_tokens: tokens computed, over those steps (cumulative).
        prefill_tokens: prompt tokens computed (cumulative).
        decode_tokens: tokens decoded (cumulative).
        flops: model FLOPs computed (cumulative).
        bytes: bytes of weights and KV read (cumulative).
        busy_seconds: time spent in engine steps (cumulative).
        transfer_wait_seconds: idle time with requests waiting for KV (cumulative).
        uptime_s: seconds since the worker started.
        num_steps: engine steps taken (cumulative).
        step_totals: steps by shape (`EngineLoop.step_totals`): per key, running totals
            the planner's calibration differences.
        peak_flops: the measured matmul FLOP/s of this worker's device.
        peak_bandwidth: the measured memory bandwidth (bytes/s).
        utilization: the last interval's shares (None before the first whole interval).
        queued_prefill_tokens: prompt tokens queued on a prefill worker (placement).
        dtype: what its model computes in (`--dtype auto` resolved).
        kv_cache_dtype: what its KV pages hold (`int8`, or `dtype` with `--kv-cache-dtype
            auto`).
        hardware: its device and the kernel paths it took there.
        compute_threads: its compute threads now (fixed by `--torch-threads`; an engine
            given none follows the cores other processes leave free).
        kv_block_bytes: what one KV block costs across all layers (the target's pages and
            a draft model's: the KV budget is divided by it).
        draft_kv_block_bytes: of it, a speculative draft model's pages (0: none).
        spec_draft_tokens: speculative decoding: tokens drafted (cumulative).
        spec_accepted_tokens: of them, accepted by verification (cumulative).
        spec_emitted_tokens: tokens emitted by verification steps (cumulative).
        spec_verify_steps: request-steps that verified drafts (cumulative).
        spec_acceptance_rate: accepted / drafted, since start.
        spec_tokens_per_step: emitted / verify steps, since start (1 to K + 1).
    """

    num_running: int = 0
    num_waiting: int = 0
    num_parked: int = 0
    num_waiting_for_kv: int = 0
    num_preemptions: int = 0
    num_blocks: int = 0
    num_free_blocks: int = 0
    kv_usage: float = 0.0
    prefix_hit_rate: float = 0.0
    prefix_cache_hits: int = 0
    prefix_cache_queries: int = 0
    step_token_counts: list[int] = []
    step_tokens: int = 0
    prefill_tokens: int = 0
    decode_tokens: int = 0
    flops: float = 0.0
    bytes: float = 0.0
    busy_seconds: float = 0.0
    transfer_wait_seconds: float = 0.0
    uptime_s: float = 0.0
    num_steps: int = 0
    step_totals: dict[str, list[float]] = {}
    peak_flops: float = 0.0
    peak_bandwidth: float = 0.0
    utilization: Utilization | None = None  # None until a whole interval was sampled
    queued_prefill_tokens: int = 0
    dtype: str = ""
    kv_cache_dtype: str = ""
    hardware: str = ""
    compute_threads: int = 0
    kv_block_bytes: int = 0
    draft_kv_block_bytes: int = 0
    spec_draft_tokens: int = 0
    spec_accepted_tokens: int = 0
    spec_emitted_tokens: int = 0
    spec_verify_steps: int = 0
    spec_acceptance_rate: float = 0.0
    spec_tokens_per_step: float = 0.0


class WorkerStatus(WorkerStats, kw_only=True):
    """One worker as `Status` reports it: its last stats and the router's view of it.

    Args:
        worker_id: its name.
        role: `prefill`, `decode` or `mixed`.
        state: `ready`, `slow` (stats late: busy or stalled, never dead), `draining` or
            `dead`.
        node: its Ray node id.
        host: the address it binds.
        endpoint: its command socket (the router pushes to it), `tcp://host:port`.
        kv_endpoint: its KV receiver's control socket (decode and mixed workers).
        pid: its process id.
        stats_age_s: seconds since its stats last arrived.
        in_flight: requests the router has placed on it and not seen end.
    """

    worker_id: str
    role: str
    state: str = "ready"
    node: str = ""
    host: str = ""
    endpoint: str = ""
    kv_endpoint: str = ""
    pid: int = 0
    stats_age_s: float = 0.0
    in_flight: int = 0


def workers(status: Mapping[str, Any]) -> list[WorkerStatus]:
    """Every worker of a `Status` (as `PdClusterClient.status` returns it), typed.

    Raises:
        msgspec.ValidationError: a worker entry that is not a `WorkerStatus`.
    """
    return [msgspec.convert(w, WorkerStatus) for pool in status.get("pools", {}).values()
            for w in pool]


def paired_workers(before: Mapping[str, Any], after: Mapping[str, Any]
                   ) -> list[tuple[WorkerStatus, WorkerStatus]]:
    """(the worker in `before`, the same worker in `after`) for each worker in both
    `Status` snapshots."""
    first = {w.worker_id: w for w in workers(before)}
    return [(first[w.worker_id], w) for w in workers(after) if w.worker_id in first]


def utilization_between(before: Mapping[str, Any], after: Mapping[str, Any]
                        ) -> dict[str, dict[str, float | int | str | None]]:
    """Each worker's utilization between two `Status` snapshots, from its counters.

    Returns:
        `{worker_id: {"role", "busy", "transfer_wait", "idle", "flops_utilization",
        "bandwidth_utilization", "steps", "mean_step_ms"}}` for the workers in both
        snapshots whose stats advanced (and that measured their peaks).
    """
    result = {}
    for start, worker in paired_workers(before, after):
        dt = worker.uptime_s - start.uptime_s
        if dt <= 0 or not worker.peak_flops or not worker.peak_bandwidth:
            continue
        busy = (worker.busy_seconds - start.busy_seconds) / dt
        steps = worker.num_steps - start.num_steps
        result[worker.worker_id] = {
            "role": worker.role, "busy": busy,
            "transfer_wait": (worker.transfer_wait_seconds - start.transfer_wait_seconds) / dt,
            "flops_utilization": (worker.flops - start.flops) / dt / worker.peak_flops,
            "bandwidth_utilization": (worker.bytes - start.bytes) / dt / worker.peak_bandwidth,
            "steps": steps, "mean_step_ms": 1e3 * busy * dt / steps if steps else None}
        result[worker.worker_id]["idle"] = max(
            1.0 - busy - result[worker.worker_id]["transfer_wait"], 0.0)
    return result


def step_deltas(before: Mapping[str, Any], after: Mapping[str, Any]
                ) -> list[tuple[str, dict[str, list[float]]]]:
    """Per worker in both snapshots: its role and the growth of each step total it ran
    (only the totals that grew)."""
    out = []
    for start, worker in paired_workers(before, after):
        grown = {key: _minus(total, start.step_totals.get(key))
                 for key, total in worker.step_totals.items()}
        out.append((worker.role, {k: v for k, v in grown.items() if v[0] > 0}))
    return out


def _minus(total: Sequence[float], earlier: Sequence[float] | None) -> list[float]:
    if earlier is None:
        return list(total)
    return [a - b for a, b in zip(total, earlier, strict=True)]
