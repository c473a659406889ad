"""The one interface a worker's role implements (prefill, decode, mixed).

`cluster.worker.Worker` owns the threads and sockets and calls these hooks; every hook that
takes the engine runs on the engine loop's thread, so a role never races the scheduler.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from protocol.messages import Command, Reply, Role

if TYPE_CHECKING:
    from engine import EngineOutput, LLMEngine


@dataclass(frozen=True)
class RoleLoad:
    """What a role adds to its worker's `WorkerStats` for placement.

    Args:
        queued_prefill_tokens: prompt tokens a prefill worker has yet to compute.
    """

    queued_prefill_tokens: int = 0


class WorkerRole(ABC):
    """A role's policy over the engine and its KV endpoint.

    Args:
        worker_id: the worker's name, stamped on every reply.
    """

    role: Role
    #: The role's KV transfer endpoint (`KVSender` / `KVReceiver`), or None.
    endpoint: Any = None

    def __init__(self, worker_id: str) -> None:
        self.worker_id = worker_id

    def prepare(self, command: Command) -> None:
        """Work that may block on the network, done on the command reader's thread."""
        return

    @abstractmethod
    def handle(self, engine: LLMEngine, command: Command) -> list[Reply]:
        """Start a request (`Generate` or `Prefill`); the replies to send now.

        Raises:
            ValueError: this role does not take `command`.
        """

    @abstractmethod
    def abort(self, engine: LLMEngine, request_id: str) -> list[Reply]:
        """End a request; blocks are freed now or once its transfer stopped."""

    @abstractmethod
    def on_outputs(self, outputs: list[EngineOutput]) -> list[Reply]:
        """One engine step's outputs, as replies."""

    def on_events(self, engine: LLMEngine, events: list[Any]) -> list[Reply]:
        """KV transfer events (`TransferDone` / `TransferFailed`), as replies."""
        return []

    def pending(self) -> set[str]:
        """Requests the role holds beyond the engine's (KV on its way in or out)."""
        return set()

    def layer_hook(self, layer: int, schedule: Any) -> None:
        """Called after each layer of each step (layer-wise KV streaming)."""
        return

    def load(self, engine: LLMEngine) -> RoleLoad:
        """Role-specific load figures for placement (merged into the worker's stats)."""
        return RoleLoad()
