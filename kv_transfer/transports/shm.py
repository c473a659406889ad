"""Same host: the receiver's pool lives in an anonymous memfd the sender maps and copies into.

The segment has no name in any filesystem (`memfd_create`), so it cannot outlive its
users: the kernel frees it when the last descriptor and mapping are gone. The owner's go
when it exits, even on SIGKILL; a sender drops its mapping when it loses the owner.
"""

from __future__ import annotations

import os

import torch
import zmq

from kv_transfer.blocks import Run, copy_runs
from kv_transfer.transports.base import Immediate, Landed
from kv_transfer.wire import Layer, encode
from protocol.kv import ShmHandle


class SharedKVPool:
    """`KVCache` allocator placing the pool in shared memory peers can map.

    Use one per pool: `KVCache(..., allocator=pool)`, then `KVReceiver(..., shm_pool=pool)`.

    Args:
        name: label shown in `/proc/<pid>/maps` (debugging only; no file is created).
    """

    def __init__(self, name: str = "pdcluster-kv") -> None:
        self.name = name
        self._fd: int | None = None
        self.nbytes = 0

    def __call__(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """Allocate the flat, zeroed pool.

        Args:
            numel: elements.
            dtype: element type.

        Returns:
            A CPU tensor backed by the shared segment.
        """
        if self.nbytes:
            raise RuntimeError("a SharedKVPool backs exactly one KV cache")
        self.nbytes = numel * torch.empty((), dtype=dtype).element_size()
        self._fd = os.memfd_create(self.name, os.MFD_CLOEXEC)
        os.ftruncate(self._fd, self.nbytes)  # a fresh memfd reads as zeros
        return torch.from_file(f"/proc/self/fd/{self._fd}", shared=True, size=numel, dtype=dtype)

    def close(self) -> None:
        """Close the descriptor: peers can no longer map the pool, and its memory goes as
        soon as the KV cache tensor and every peer mapping are gone. Exit does the same."""
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    def handle(self) -> ShmHandle:
        """What a same-host peer needs to map the pool: owner pid, descriptor, size."""
        if self._fd is None:
            raise RuntimeError("the pool is not allocated, or closed")
        return ShmHandle(pid=os.getpid(), fd=self._fd, nbytes=self.nbytes)


def map_peer_pool(handle: ShmHandle, shape: tuple[int, ...],
                  dtype: torch.dtype) -> torch.Tensor:
    """Map a peer's `SharedKVPool` through `/proc/<pid>/fd/<fd>`.

    Args:
        handle: the peer's `SharedKVPool.handle()`.
        shape: the peer's pool shape `[num_layers, num_blocks, 2, block_size, H, D]`.
        dtype: element type.

    Returns:
        The peer's pool; writes land in its memory. Freed when the tensor is.

    Raises:
        OSError: the owner is gone or in another PID namespace.
        ValueError: the segment size does not match `shape`.
    """
    numel = 1
    for dim in shape:
        numel *= dim
    if numel * torch.empty((), dtype=dtype).element_size() != handle.nbytes:
        raise ValueError(f"shared pool of {handle.nbytes} bytes does not hold {shape}")
    path = f"/proc/{handle.pid}/fd/{handle.fd}"
    return torch.from_file(path, shared=True, size=numel, dtype=dtype).view(shape)


class ShmSendChannel(Immediate):
    """Copies each layer's runs straight into the receiver's reserved blocks."""

    def __init__(self, peer_pool: torch.Tensor) -> None:
        self._pool: torch.Tensor | None = peer_pool  # [L, N, 2, bs, H, D], the peer's memory

    def send_layer(self, sock: zmq.Socket, header: Layer, src: torch.Tensor,
                   runs: list[Run]) -> None:
        if self._pool is None:
            raise RuntimeError("shared pool already released")
        copy_runs(self._pool[header.layer], src, runs)
        sock.send(encode(header), zmq.NOBLOCK)  # Again: no connection left (the peer is dropped)

    def close(self) -> None:
        self._pool = None  # our last reference: unmaps the peer's pool


class ShmRecvChannel:
    """Nothing to do: the "layer" header arrives after the sender's copy finished."""

    def recv_layer(self, sock: zmq.Socket, header: Layer, dst: torch.Tensor,
                   runs: list[tuple[int, int]], landed: Landed) -> None:
        landed(None)

    def close(self) -> None:
        """Nothing to release: the pool belongs to the receiver."""
