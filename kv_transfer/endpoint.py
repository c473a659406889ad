"""The IO thread both transfer endpoints are built on."""

from __future__ import annotations

import logging
import os
import queue
import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

import zmq

from engine.kv_cache import KVCache
from kv_transfer.compat import CompatRecord, KVCompatibilityError, check_compat
from kv_transfer.config import TransferConfig
from kv_transfer.events import TransferEvent, TransferFailed
from protocol.secure import SocketGuard

log = logging.getLogger(__name__)

_MAX_BATCH = 64  # messages read from one socket before timers get a turn


class Endpoint(ABC):
    """Owns ZMQ sockets and transfer state on one IO thread.

    Public calls (from the engine's thread) hand work to the IO thread through a queue and
    an eventfd, so they return at once; events come back through `poll` / `wait_events`.
    Only the set of live request ids is shared, under a lock, so that a duplicate id is
    refused in the caller's thread.

    Args:
        kv_cache: the engine's KV pool.
        compat: this engine's compatibility record; must describe `kv_cache`.
        config: transfer settings.
        role: thread name suffix.
    """

    def __init__(self, kv_cache: KVCache, compat: CompatRecord, config: TransferConfig,
                 role: str) -> None:
        try:
            check_compat(CompatRecord.from_kv_cache(kv_cache, compat.model), compat)
        except KVCompatibilityError as exc:
            raise ValueError(f"compat does not describe the KV cache ({exc})") from None
        self.kv = kv_cache
        self.compat = compat
        self.config = config
        self._ctx = zmq.Context()
        self._sockets = SocketGuard(self._ctx, config.cluster_key)
        self._poller = zmq.Poller()
        self._wake = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)
        self._poller.register(self._wake, zmq.POLLIN)
        self._calls: queue.SimpleQueue[tuple[Callable[..., Any], tuple[Any, ...]]] = (
            queue.SimpleQueue())
        self._events: queue.Queue[TransferEvent] = queue.Queue()
        self._live: set[str] = set()
        self._lock = threading.Lock()
        self._closed = False
        self._woken = False  # an eventfd write is pending: later calls need not write again
        self._running = True
        self._tick_s = min(0.05, config.heartbeat_s / 2)
        self._next_tick = 0.0
        self._thread = threading.Thread(target=self._run, name=f"kv-{role}", daemon=True)

    def poll(self) -> list[TransferEvent]:
        """Events that happened since the last call, without waiting.

        Returns:
            `TransferDone` / `TransferFailed`, in the order they happened.
        """
        events = []
        while True:
            try:
                events.append(self._events.get_nowait())
            except queue.Empty:
                return events

    def wait_events(self, timeout_s: float) -> list[TransferEvent]:
        """Block until at least one event happened or `timeout_s` passed.

        Args:
            timeout_s: longest wait in seconds.

        Returns:
            The events, possibly none.
        """
        try:
            first = self._events.get(timeout=timeout_s)
        except queue.Empty:
            return []
        return [first, *self.poll()]

    def close(self) -> None:
        """Fail what is in flight, tell the peers, and stop the IO thread."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._calls.put((self._stop, ()))
            os.eventfd_write(self._wake, 1)
        self._thread.join(timeout=self.config.peer_timeout_s)
        if not self._thread.is_alive():
            os.close(self._wake)

    def __enter__(self) -> Endpoint:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---- subclass hooks (IO thread) ----

    @abstractmethod
    def _on_readable(self, sock: zmq.Socket) -> None:
        """Read what arrived on one of the subclass's sockets."""

    @abstractmethod
    def _on_tick(self, now: float) -> None:
        """Deadlines and heartbeats; runs about every `_tick_s`."""

    @abstractmethod
    def _on_close(self) -> None:
        """End every request and say goodbye to the peers."""

    # ---- shared machinery ----

    def _claim(self, request_id: str) -> None:
        """Mark `request_id` live, refusing duplicates and calls after close."""
        with self._lock:
            if self._closed:
                raise RuntimeError("the transfer endpoint is closed")
            if request_id in self._live:
                raise ValueError(f"request {request_id!r} is already in flight")
            self._live.add(request_id)

    def _emit(self, event: TransferEvent) -> None:
        with self._lock:
            self._live.discard(event.request_id)
        self._events.put(event)

    def _call_soon(self, fn: Callable[..., Any], *args: Any) -> None:
        """Run `fn(*args)` on the IO thread; dropped once the endpoint is closed."""
        with self._lock:
            if self._closed:
                return
            self._calls.put((fn, args))
            if not self._woken:
                self._woken = True
                os.eventfd_write(self._wake, 1)

    def _call(self, fn: Callable[..., Any], *args: Any) -> Future:
        """Run `fn(*args)` on the IO thread; its result or exception lands in the future."""
        future: Future = Future()

        def run() -> None:
            try:
                future.set_result(fn(*args))
            except Exception as exc:  # handed to the caller through the future
                future.set_exception(exc)
        self._call_soon(run)
        return future

    def _run_calls(self) -> None:
        while True:
            try:
                fn, args = self._calls.get_nowait()
            except queue.Empty:
                return
            self._guarded(fn, *args)

    def _guarded(self, fn: Callable[..., Any], *args: Any) -> None:
        # One bad message or bug must not kill the thread every transfer depends on.
        try:
            fn(*args)
        except Exception:
            log.exception("kv_transfer: %s failed", getattr(fn, "__name__", fn))

    def _run(self) -> None:
        try:
            while self._running:
                self._step()
        except Exception as exc:
            log.exception("kv_transfer: the IO thread crashed")
            self._abandon(f"the transfer thread crashed: {exc!r}")
        finally:
            self._sockets.close()
            self._ctx.destroy(linger=0)

    def _step(self) -> None:
        ready = dict(self._poller.poll(self._tick_s * 1000))
        if ready.pop(self._wake, None):
            os.eventfd_read(self._wake)
            with self._lock:
                self._woken = False
        self._run_calls()
        for sock in ready:
            self._guarded(self._on_readable, sock)
        now = time.monotonic()
        if now >= self._next_tick:
            self._next_tick = now + self._tick_s
            self._guarded(self._on_tick, now)
        self._guarded(self._end_turn)

    @abstractmethod
    def _end_turn(self) -> None:
        """Runs at the end of each turn of the IO loop, before it waits again."""

    def _abandon(self, reason: str) -> None:
        """Without an IO thread nothing can end normally: fail every live request now."""
        with self._lock:
            self._closed = True
            live, self._live = self._live, set()
        for request_id in live:
            self._events.put(TransferFailed(request_id, reason))

    def _stop(self) -> None:
        self._on_close()
        self._running = False
