"""The bounded admission queue: a few requests inside the backend, a bounded FIFO of waiters."""

from __future__ import annotations

import asyncio
from collections import OrderedDict

from router.errors import QueueFullError, QueueTimeoutError


class AdmissionQueue:
    """At most `max_running` requests admitted at once and `max_queue` waiting, first come
    first served. A full queue rejects at once; a slot is handed straight to the oldest waiter.

    Args:
        max_running: requests admitted (inside the backend) at once.
        max_queue: requests allowed to wait for a slot.
    """

    def __init__(self, max_running: int, max_queue: int) -> None:
        self.max_running = max_running
        self.max_queue = max_queue
        self.num_running = 0
        self._waiters: OrderedDict[str, asyncio.Future[bool]] = OrderedDict()

    @property
    def num_waiting(self) -> int:
        return len(self._waiters)

    async def acquire(self, request_id: str, timeout: float | None) -> bool:
        """Wait for a slot; call `release` once done with it.

        Args:
            request_id: identifies the waiter for `cancel`.
            timeout: longest wait in seconds; None waits as long as it takes.

        Returns:
            True when admitted, False when `cancel` took the request out of the queue.

        Raises:
            QueueFullError: `max_queue` requests are already waiting.
            QueueTimeoutError: no slot came within `timeout`.
        """
        if self.num_running < self.max_running and not self._waiters:
            self.num_running += 1
            return True
        if len(self._waiters) >= self.max_queue:
            raise QueueFullError(f"the admission queue is full ({self.max_queue} requests "
                                 f"waiting, {self.num_running} running); retry later")
        waiter: asyncio.Future[bool] = asyncio.get_running_loop().create_future()
        self._waiters[request_id] = waiter
        try:
            async with asyncio.timeout(timeout):
                return await waiter
        except BaseException as e:
            self._give_up(request_id, waiter)
            if isinstance(e, TimeoutError):
                raise QueueTimeoutError(f"deadline: no slot within {timeout:.3g} s in the "
                                        "admission queue") from None
            raise

    def _give_up(self, request_id: str, waiter: asyncio.Future[bool]) -> None:
        if self._waiters.get(request_id) is waiter:
            del self._waiters[request_id]
        # A slot handed over just as the waiter gave up (deadline, disconnect) is passed on.
        elif waiter.done() and not waiter.cancelled() and waiter.result():
            self.release()

    def release(self) -> None:
        """Give an admitted request's slot to the oldest waiter, or free it."""
        while self._waiters:
            _, waiter = self._waiters.popitem(last=False)
            if not waiter.done():
                waiter.set_result(True)
                return
        self.num_running -= 1

    def cancel(self, request_id: str) -> bool:
        """Take a waiting request out of the queue (its `acquire` returns False).

        Returns:
            False when the request is not waiting.
        """
        waiter = self._waiters.pop(request_id, None)
        if waiter is None or waiter.done():
            return False
        waiter.set_result(False)
        return True
