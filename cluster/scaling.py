"""Resizing the pools live: add workers, drain and remove workers, move workers between the
prefill and decode pools in place.

A rebalance (one pool grows as the other shrinks) changes the role of drained workers,
keeping their process, model and KV pool, so no worker starts and no resources are needed
beside the old; this needs both pools built alike (`ClusterConfig.prefill` equal to
`decode`), else the growing pool starts workers of its own spec. What is left to add or
remove after that (and any worker that could not change) makes before it breaks: the new
workers start, and only once they are ready do the old ones drain; when Ray has no room
for the new workers beside the old, the old ones drain first to free theirs.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging

from cluster.dispatch import Dispatcher
from cluster.handle import WorkerHandle
from cluster.pool import WorkerPool
from protocol import Role

log = logging.getLogger(__name__)


class Scaler:
    """Carries out `scale` requests on the pool.

    Args:
        pool: the workers.
        dispatcher: moves a drained worker's remaining requests elsewhere.
        mode: `disaggregated` or `colocated` (one pool of mixed workers).
        drain_timeout_s: how long a drained worker's requests may take to finish before
            they move to other workers.
    """

    def __init__(self, pool: WorkerPool, dispatcher: Dispatcher, mode: str,
                 drain_timeout_s: float) -> None:
        self.pool = pool
        self.dispatcher = dispatcher
        self.decode_role = Role.MIXED if mode == "colocated" else Role.DECODE
        self.drain_timeout_s = drain_timeout_s
        self._tasks: set[asyncio.Task] = set()

    def changes(self, num_prefill: int | None, num_decode: int | None) -> dict[Role, int]:
        """Workers to add (> 0) or remove (< 0) per pool for the requested sizes.

        Raises:
            ValueError: a size out of range, or prefill workers on a colocated cluster.
        """
        if self.decode_role == Role.MIXED and num_prefill:
            raise ValueError("prefill: a colocated cluster has no prefill pool")
        if num_decode is not None and num_decode < 1:
            raise ValueError(f"decode: must be >= 1, got {num_decode}")
        if num_prefill is not None and num_prefill < 0:
            raise ValueError(f"prefill: must be >= 0, got {num_prefill}")
        return {role: target - len(self.pool.active(role))
                for role, target in ((Role.PREFILL, num_prefill), (self.decode_role, num_decode))
                if target is not None}

    async def scale(self, num_prefill: int | None, num_decode: int | None) -> None:
        """Resize the pools (see the module docstring); returns once new workers are ready
        (removed ones drain in the background).

        Raises:
            ValueError: see `changes`.
        """
        change = self.changes(num_prefill, num_decode)
        await self._trade_roles(change)
        if self.pool.has_room(change):
            await self._grow(change)
            self._shrink(change)
        else:
            self._shrink(change)
            await self._grow(change)

    async def _trade_roles(self, change: dict[Role, int]) -> None:
        """Turn workers of the shrinking pool into workers of the growing one, in place;
        `change` keeps what is left to start or stop."""
        if len(change) != 2 or Role.MIXED in change:
            return
        if self.pool.config.prefill != self.pool.config.decode:
            return  # a worker keeps its process and engine: only same-spec pools trade
        (role, n), (other, m) = change.items()
        if n * m >= 0:
            return
        source, target = (role, other) if n < 0 else (other, role)
        chosen = self.pool.least_busy(source, min(abs(n), abs(m)))
        changed = await asyncio.gather(*(self._change_role(h, target) for h in chosen))
        change[source] += len(chosen)  # each left the pool: changed, or stopped if it failed
        change[target] -= sum(changed)

    async def _change_role(self, handle: WorkerHandle, role: Role) -> bool:
        """Drain the worker, then change its role; False (and the worker stopped) if it
        could not."""
        await self.drain(handle)
        try:
            await self.pool.change_role(handle, role)
        except Exception as e:
            log.warning("worker %s could not become %s (%s); stopping it", handle.worker_id,
                        role, e)
            await self.pool.stop(handle)
            return False
        return True

    async def _grow(self, change: dict[Role, int]) -> None:
        await asyncio.gather(*(self.pool.add(role) for role, n in change.items()
                               for _ in range(n)))

    def _shrink(self, change: dict[Role, int]) -> None:
        """Retire the least busy workers of each pool that shrinks."""
        for role, n in change.items():
            if n < 0:
                for handle in self.pool.least_busy(role, -n):
                    handle.state = "draining"
                    self._spawn(self._retire(handle))

    async def drain(self, handle: WorkerHandle) -> None:
        """Stop placing on the worker; its requests finish, or after the drain timeout
        move to other workers."""
        handle.state = "draining"
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(handle.idle.wait(), self.drain_timeout_s)
        self.dispatcher.migrate_off(handle)

    async def _retire(self, handle: WorkerHandle) -> None:
        """Drain the worker, then stop it."""
        await self.drain(handle)
        await self.pool.stop(handle)

    def _spawn(self, coro: object) -> None:
        task = asyncio.create_task(coro)  # type: ignore[arg-type]
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def close(self) -> None:
        for task in list(self._tasks):
            task.cancel()
