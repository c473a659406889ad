"""Same host: the receiver's pool lives in an anonymous memfd (`engine.kv_cache.SharedPages`)
the sender maps and copies into; a sender drops its mapping when it loses the owner."""

from __future__ import annotations

import os

import torch
import zmq

from engine.kv_cache import SharedPages, map_shared
from kv_transfer.blocks import Run, copy_runs
from kv_transfer.transports.base import Immediate, Landed
from kv_transfer.wire import Layer, encode
from protocol.kv import ShmHandle


class SharedKVPool(SharedPages):
    """`KVCache` allocator placing the pool in shared memory peers can map
    (`engine.kv_cache.SharedPages`), with the handle a KV transport's peer maps it by.

    Use one per pool: `KVCache(..., allocator=pool)`, then `KVReceiver(..., shm_pool=pool)`.
    """

    def handle(self) -> ShmHandle:
        """What a same-host peer needs to map the pool: owner pid, descriptor, size."""
        if self.fd is None:
            raise RuntimeError("the pool is not allocated, or closed")
        return ShmHandle(pid=os.getpid(), fd=self.fd, nbytes=self.nbytes)


def map_peer_pool(handle: ShmHandle, shape: tuple[int, ...],
                  dtype: torch.dtype) -> torch.Tensor:
    """Map a peer's `SharedKVPool` (`engine.kv_cache.map_shared`).

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
    return map_shared(handle.pid, handle.fd, handle.nbytes, dtype).view(shape)


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
