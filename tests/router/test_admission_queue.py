"""The admission queue alone: limits, FIFO hand-over, deadlines and cancellation."""

from __future__ import annotations

import asyncio

import pytest

from router.admission import AdmissionQueue
from router.errors import QueueFullError, QueueTimeoutError


async def _settle() -> None:
    """Let every ready task run up to its next wait."""
    for _ in range(3):
        await asyncio.sleep(0)


def test_slots_pass_to_waiters_in_order() -> None:
    async def main() -> None:
        queue = AdmissionQueue(max_running=1, max_queue=2)
        assert await queue.acquire("a", None)
        b = asyncio.create_task(queue.acquire("b", None))
        c = asyncio.create_task(queue.acquire("c", None))
        await _settle()
        assert (queue.num_running, queue.num_waiting) == (1, 2)
        with pytest.raises(QueueFullError, match="2 requests waiting"):
            await queue.acquire("d", None)
        queue.release()
        assert await b and not c.done()
        queue.release()
        assert await c
        queue.release()
        assert (queue.num_running, queue.num_waiting) == (0, 0)

    asyncio.run(main())


def test_deadline_and_cancel_leave_the_queue() -> None:
    async def main() -> None:
        queue = AdmissionQueue(max_running=1, max_queue=2)
        await queue.acquire("a", None)
        with pytest.raises(QueueTimeoutError, match="deadline"):
            await queue.acquire("late", 0.01)
        cancelled = asyncio.create_task(queue.acquire("b", None))
        await _settle()
        assert queue.cancel("b") and not await cancelled
        assert not queue.cancel("b") and queue.num_waiting == 0
        gone = asyncio.create_task(queue.acquire("c", None))  # e.g. its client disconnects
        await _settle()
        gone.cancel()
        await asyncio.gather(gone, return_exceptions=True)
        queue.release()
        assert (queue.num_running, queue.num_waiting) == (0, 0)

    asyncio.run(main())


def test_slot_handed_to_a_waiter_that_gives_up_is_passed_on() -> None:
    async def main() -> None:
        queue = AdmissionQueue(max_running=1, max_queue=2)
        await queue.acquire("a", None)
        b = asyncio.create_task(queue.acquire("b", None))
        c = asyncio.create_task(queue.acquire("c", None))
        await _settle()
        queue.release()  # hands the slot to b ...
        b.cancel()  # ... which is cancelled before it runs again
        await asyncio.gather(b, return_exceptions=True)
        assert await c and queue.num_running == 1

    asyncio.run(main())
