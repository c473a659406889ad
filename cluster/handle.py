"""The router's view of one worker: its role, state, last stats and the requests on it."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import Any

from protocol import Role, WorkerInfo, WorkerStats, WorkerStatus
from protocol.defaults import STATS_INTERVAL_S
from router.placement import WorkerLoad

# Stats older than this many intervals mark a worker `slow` in status (never dead).
SLOW_AFTER_INTERVALS = 4


@dataclass
class WorkerHandle:
    """One worker as the router tracks it.

    Args:
        worker_id: its name.
        role: its current role.
        info: what the worker said of itself when it started (or changed role): endpoint,
            model facts, KV `peer_info`, `num_blocks`, `block_bytes`, pid, node.
        actor: its Ray actor (None where no Ray is involved, as in unit tests).
        pg: its placement group.
        socket: the router's PUSH socket to it.
    """

    worker_id: str
    role: Role
    info: WorkerInfo
    actor: Any = None
    pg: Any = None
    socket: Any = None
    stats: WorkerStats | None = None  # None until its first push
    stats_at: float = field(default_factory=time.monotonic)  # when stats last arrived
    state: str = "ready"  # ready | draining | dead
    stopping: bool = False  # the router is stopping it: its end is not a death
    in_flight: set[str] = field(default_factory=set)  # request ids placed here
    idle: asyncio.Event = field(default_factory=asyncio.Event)

    def __post_init__(self) -> None:
        self.idle.set()

    def load(self) -> WorkerLoad:
        """Placement's view: the last stats, the KV size before any, the router's count."""
        s = self.stats or WorkerStats(num_free_blocks=self.info.num_blocks)
        return WorkerLoad(self.worker_id, self.role, num_free_blocks=s.num_free_blocks,
                          num_blocks=self.info.num_blocks, num_running=s.num_running,
                          num_waiting=s.num_waiting,
                          queued_prefill_tokens=s.queued_prefill_tokens,
                          in_flight=len(self.in_flight))

    def shown_state(self, now: float) -> str:
        """`slow` when a ready worker's stats are late (busy or stalled, but alive)."""
        late = now - self.stats_at > SLOW_AFTER_INTERVALS * STATS_INTERVAL_S
        return "slow" if self.state == "ready" and late else self.state

    def status(self, now: float, fresh: WorkerStats | None = None) -> WorkerStatus:
        """The worker as `Status` reports it: from `fresh`, a snapshot just taken (age 0),
        else from its last pushed stats."""
        stats = fresh or self.stats or WorkerStats(num_blocks=self.info.num_blocks,
                                                   num_free_blocks=self.info.num_blocks)
        peer_info = self.info.peer_info
        return WorkerStatus(
            **{f: getattr(stats, f) for f in WorkerStats.__struct_fields__},
            worker_id=self.worker_id, role=str(self.role), state=self.shown_state(now),
            node=self.info.node_id, host=self.info.host, endpoint=self.info.endpoint,
            kv_endpoint=peer_info.endpoint if peer_info is not None else "",
            pid=self.info.pid, stats_age_s=0.0 if fresh else now - self.stats_at,
            in_flight=len(self.in_flight))

    def add(self, request_id: str) -> None:
        self.in_flight.add(request_id)
        self.idle.clear()

    def discard(self, request_id: str) -> None:
        self.in_flight.discard(request_id)
        if not self.in_flight:
            self.idle.set()
