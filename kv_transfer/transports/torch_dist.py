"""torch.distributed: a two-rank process group per connection, made on demand.

The receiver hosts a `TCPStore`; each connection rendezvous under its own prefix, so no
global `init_process_group` is needed. gloo moves CPU tensors; NCCL is chosen when the pool
is on CUDA (that path is written but only exercised on GPU machines; NCCL ignores tags, which
is fine because both ranks post in the same order). Rank 0 sends, rank 1 receives straight
into the reserved destination slices.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
import zmq

from kv_transfer.blocks import Run
from kv_transfer.transports.base import Immediate, Landed
from kv_transfer.wire import Layer, encode
from protocol.kv import StoreAddress

SENDER_RANK, RECEIVER_RANK = 0, 1
_TAG_MASK = 0x7FFFFFFF


def open_pair_group(store: StoreAddress, name: str, rank: int, device: torch.device,
                    host: str, timeout_s: float) -> dist.ProcessGroup:
    """Join the two-rank group `name`; blocks until the other rank joins too.

    Args:
        store: the receiver's `TCPStore`.
        name: unique name of this connection.
        rank: `SENDER_RANK` or `RECEIVER_RANK`.
        device: where the KV pool lives (selects gloo or NCCL).
        host: this process's address for gloo's connections.
        timeout_s: bound on the rendezvous and on every send/recv.

    Returns:
        The process group.
    """
    timeout = timedelta(seconds=timeout_s)
    client = dist.TCPStore(store.host, store.port, is_master=False, timeout=timeout)
    prefixed = dist.PrefixStore(name, client)
    if device.type == "cuda":
        nccl_opts = dist.ProcessGroupNCCL.Options()
        nccl_opts._timeout = timeout
        return dist.ProcessGroupNCCL(prefixed, rank, 2, nccl_opts)
    # The private options are what init_process_group uses too; they let us pin the
    # interface instead of trusting that the hostname resolves to a reachable address.
    opts = dist.ProcessGroupGloo._Options()
    opts._devices = [dist.ProcessGroupGloo.create_device(hostname=host)]
    opts._timeout = timeout
    return dist.ProcessGroupGloo(prefixed, rank, 2, opts)


class _WorkWaiter:
    """Waits for posted receives in order on its own thread and reports each batch."""

    def __init__(self, notify: Callable[..., None], device: torch.device) -> None:
        self._notify = notify
        self._device = device
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        threading.Thread(target=self._run, name="kv-dist-waiter", daemon=True).start()

    def watch(self, works: list[dist.Work], landed: Landed) -> None:
        self._queue.put((works, landed))

    def stop(self) -> None:
        self._queue.put(None)

    def _run(self) -> None:
        while (item := self._queue.get()) is not None:
            works, landed = item
            self._notify(landed, self._wait(works))

    def _wait(self, works: list[dist.Work]) -> str | None:
        try:
            for work in works:
                work.wait()  # gloo fails it when the peer dies or the group timeout passes
            if self._device.type == "cuda":
                torch.cuda.synchronize(self._device)
        except RuntimeError as exc:
            return f"torch.distributed receive failed: {exc}"
        return None


class DistSendChannel(Immediate):
    """Posts one send per run after the header that tells the receiver the tags."""

    def __init__(self, group: dist.ProcessGroup) -> None:
        self._group: dist.ProcessGroup | None = group
        self._next_tag = 0
        self._works: list[dist.Work] = []  # kept alive until done; gloo needs its buffers

    def send_layer(self, sock: zmq.Socket, header: Layer, src: torch.Tensor,
                   runs: list[Run]) -> None:
        header.dist_tag = tag = self._next_tag
        self._next_tag = (tag + len(runs)) & _TAG_MASK
        sock.send(encode(header), zmq.NOBLOCK)  # Again: no connection left (the peer is dropped)
        self._works = [w for w in self._works if not w.is_completed()]
        for i, (s, _, n) in enumerate(runs):
            self._works.append(self._group.send([src[s:s + n]], RECEIVER_RANK,
                                                (tag + i) & _TAG_MASK))

    def close(self) -> None:
        self._works.clear()
        self._group = None  # tears the pair down once gloo finishes what is in flight


class DistRecvChannel:
    """Posts one receive per run into the destination slices; a waiter reports completion.

    The group is built on a helper thread (joining blocks until the sender joins), so the
    receiver's IO thread keeps serving other peers meanwhile.

    Args:
        store: this receiver's `TCPStore`.
        name: unique name of the connection.
        device: where the KV pool lives.
        host: this process's address.
        timeout_s: rendezvous and per-operation bound.
        notify: runs a callback on the IO thread (`Endpoint._call_soon`).
    """

    def __init__(self, store: StoreAddress, name: str, device: torch.device, host: str,
                 timeout_s: float, notify: Callable[..., None]) -> None:
        self._timeout_s = timeout_s
        self._lock = threading.Lock()
        self._joined = threading.Event()
        self._group: dist.ProcessGroup | None = None
        self._error: Exception | None = None
        self._closed = False
        self._waiter = _WorkWaiter(notify, device)
        args = (store, name, RECEIVER_RANK, device, host, timeout_s)
        threading.Thread(target=self._join, args=args, name="kv-dist-join", daemon=True).start()

    def _join(self, *args: Any) -> None:
        try:
            group = open_pair_group(*args)
        except Exception as exc:  # surfaces on the IO thread at the first layer
            self._error = exc
        else:
            with self._lock:
                if not self._closed:
                    self._group = group
        self._joined.set()

    def recv_layer(self, sock: zmq.Socket, header: Layer, dst: torch.Tensor,
                   runs: list[tuple[int, int]], landed: Landed) -> None:
        if header.dist_tag is None:
            raise ValueError("a torch_dist layer header needs dist_tag")
        if not self._joined.wait(self._timeout_s) or self._group is None:
            raise ConnectionError(f"no torch.distributed group with the sender: {self._error}")
        tag = header.dist_tag
        works = [self._group.recv([dst[d:d + n]], SENDER_RANK, (tag + i) & _TAG_MASK)
                 for i, (d, n) in enumerate(runs)]
        self._waiter.watch(works, landed)

    def close(self) -> None:
        """Tear the pair down now rather than at interpreter exit, where gloo aborts."""
        self._waiter.stop()
        with self._lock:
            self._closed = True
            self._group = None
