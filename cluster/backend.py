"""`ClusterBackend`: the router's backend over Ray-managed prefill and decode pools.

It wires three parts together: the `WorkerPool` (Ray actors, sockets, stats, liveness),
the `Dispatcher` (placement, streaming, migration, transfer retries) and the `Scaler`
(live resizing and draining). A worker that dies is replaced in the background and its
requests move to the workers left; a worker that joins the decode pool takes running
requests from the busier ones.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator
from typing import Any

import msgspec

from cluster.config import ClusterConfig
from cluster.dispatch import DispatchConfig, Dispatcher
from cluster.handle import WorkerHandle
from cluster.metrics import ClusterMetrics
from cluster.pool import Detached, WorkerPool
from cluster.scaling import Scaler
from engine import defaults
from protocol import Role
from protocol.status import WorkerStats
from protocol.tracing import Tracer
from router.backend import Backend, GenerateRequest, ModelInfo, TokenDelta

log = logging.getLogger(__name__)

# How long `status` waits for a worker's own snapshot before showing its pushed one.
FRESH_STATS_TIMEOUT_S = 1.0


class ClusterBackend(Backend):
    """Starts and owns the worker pools; places, streams and migrates requests.

    Args:
        config: pool layout and engine settings.
        model_name: the model's name in the API (the metrics' `model_name` label); None:
            `config.model`.
        detached: workers that outlive this process, adopted again by a restarted front
            door (`cluster.frontdoor`); None: they end with it.

    Attributes:
        tracer: the router process's spans (`config.tracing`), shared with the front door.
    """

    def __init__(self, config: ClusterConfig, model_name: str | None = None,
                 detached: Detached | None = None) -> None:
        self.config = config
        self.metrics = ClusterMetrics(model_name or config.model)
        self.tracer = Tracer(config.tracing, "router")
        self.pool = WorkerPool(config, on_ready=self._on_ready, on_leave=self._on_leave,
                               on_death=self._on_death, on_message=self._on_message,
                               detached=detached)
        self.dispatcher = Dispatcher(
            self.pool, DispatchConfig(config.local_prefill_threshold, config.reserve_timeout_s,
                                      config.migrate,
                                      config.decode.engine.get("block_size", defaults.BLOCK_SIZE),
                                      config.ttft_slo_s),
            self.metrics, self.tracer)
        self.scaler = Scaler(self.pool, self.dispatcher, config.mode, config.drain_timeout_s)
        self._replacing: set[asyncio.Task] = set()

    @property
    def workers(self) -> dict[str, WorkerHandle]:
        return self.pool.workers

    @property
    def internal_security(self) -> str:
        return self.pool.internal_security

    # ---- lifecycle ----

    async def start(self) -> None:
        """Start the pools and wait until every worker has loaded its model; after a
        restart of a detached front door, adopt the workers it left instead (a new pool
        only if none of them is left)."""
        self.pool.start()
        if await self.pool.adopt():
            return
        roles = [(Role.MIXED, self.config.num_decode)] if self.config.mode == "colocated" \
            else [(Role.DECODE, self.config.num_decode), (Role.PREFILL, self.config.num_prefill)]
        await asyncio.gather(*(self.pool.add(role) for role, n in roles for _ in range(n)))

    async def close(self) -> None:
        for task in list(self._replacing):
            task.cancel()
        self.scaler.close()
        self.dispatcher.close()
        await self.pool.close()
        self.tracer.shutdown()

    # ---- pool events ----

    def _on_ready(self, handle: WorkerHandle) -> None:
        self.dispatcher.spread_onto(handle)

    def _on_leave(self, handle: WorkerHandle) -> None:
        self.dispatcher.forget(handle.worker_id)

    def _on_message(self, handle: WorkerHandle, message: Any) -> None:
        self.dispatcher.on_message(handle, message)

    async def _on_death(self, handle: WorkerHandle, error: BaseException) -> None:
        if handle.state == "ready":  # a draining worker was leaving anyway
            # In the background, so the model load holds up nothing else; started before
            # the requests move, so they can wait for it when no other worker is left.
            task = asyncio.create_task(self._replace(handle.role))
            self._replacing.add(task)
            task.add_done_callback(self._replacing.discard)
        handle.state = "dead"
        self.dispatcher.migrate_off(handle)
        await self.pool.stop(handle)

    async def _replace(self, role: Role) -> None:
        try:
            await self.pool.add(role)
        except Exception:
            log.exception("could not replace a %s worker", role)

    # ---- Backend ----

    def model_info(self) -> ModelInfo:
        info = self.pool.first_info
        if info is None:
            raise RuntimeError("the cluster has not started")
        return ModelInfo(self.config.model, info.model_dir, info.max_model_len,
                         info.vocab_size)

    def healthy(self) -> bool:
        return any(h.state == "ready" and h.role.decodes for h in self.workers.values())

    def generate(self, request: GenerateRequest) -> AsyncIterator[TokenDelta]:
        return self.dispatcher.generate(request)

    async def abort(self, request_id: str) -> bool:
        return self.dispatcher.abort(request_id)

    async def status(self, fresh: bool = True) -> dict[str, Any]:
        """The pools as they are now.

        Args:
            fresh: each live worker's figures are a snapshot taken for this call (its
                pushed stats lag by up to an interval, so right after the pools drained
                they could still show blocks in use); a worker that does not answer
                within `FRESH_STATS_TIMEOUT_S` (a long step, a stalled engine) shows its
                last pushed ones, with their age. False: the pushed ones only, at once.
        """
        handles = list(self.workers.values())
        snapshots = await _fresh_stats(handles, FRESH_STATS_TIMEOUT_S) if fresh else {}
        pools: dict[str, list[dict[str, Any]]] = {}
        now = time.monotonic()
        for h in handles:
            pools.setdefault(str(h.role), []).append(
                msgspec.to_builtins(h.status(now, snapshots.get(h.worker_id))))
        return {"mode": self.config.mode, "model": self.config.model, "pools": pools,
                "pool_settings": self.config.pool_settings(),
                "num_streams": len(self.dispatcher.requests)}

    async def scale(self, num_prefill: int | None, num_decode: int | None) -> dict[str, Any]:
        """Add workers (returns once they are ready) or drain and remove some
        (`cluster.scaling`); the pools as their pushed stats show them (the new layout
        at once, without waiting on a worker busy with a long step)."""
        await self.scaler.scale(num_prefill, num_decode)
        return await self.status(fresh=False)


async def _fresh_stats(handles: list[WorkerHandle], timeout_s: float
                       ) -> dict[str, WorkerStats]:
    """Snapshots from the live workers that answer within `timeout_s`, by worker id."""
    live = [h for h in handles if h.actor is not None and h.state != "dead"]
    calls = {asyncio.ensure_future(_stats_of(h)): h.worker_id for h in live}
    if not calls:
        return {}
    done, pending = await asyncio.wait(calls, timeout=timeout_s)
    for call in pending:
        call.cancel()
    return {calls[call]: call.result() for call in done if call.exception() is None}


async def _stats_of(handle: WorkerHandle) -> WorkerStats:
    return await handle.actor.stats.remote()
