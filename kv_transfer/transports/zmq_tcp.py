"""Across hosts: tensor bytes as zero-copy ZMQ frames behind the "layer" header."""

from __future__ import annotations

import torch
import zmq

from kv_transfer.blocks import Run, as_bytes
from kv_transfer.transports.base import Immediate, Landed
from kv_transfer.wire import Layer, encode

# Frames of about 1 MiB measured fastest: smaller ones pay per-frame overhead, larger ones
# make libzmq allocate (and the kernel zero) fresh pages for every message received.
FRAME_BYTES = 1 << 20


def frame_slices(runs: list[tuple[int, int]], step: int) -> list[tuple[int, int]]:
    """Cut `(start, num_blocks)` runs into frames of at most `step` blocks."""
    return [(start + i, min(step, n - i)) for start, n in runs for i in range(0, n, step)]


class ZmqSendChannel(Immediate):
    """Frames are views of the sender's pool; ZMQ keeps them alive until sent."""

    def send_layer(self, sock: zmq.Socket, header: Layer, src: torch.Tensor,
                   runs: list[Run]) -> None:
        block_bytes = src.nbytes // src.shape[0]
        header.frame_blocks = step = max(1, FRAME_BYTES // block_bytes)
        view = as_bytes(src)
        frames = [view[s * block_bytes:(s + n) * block_bytes]
                  for s, n in frame_slices([(s, n) for s, _, n in runs], step)]
        # Again: no connection left (the peer is dropped)
        sock.send_multipart([encode(header), *frames], copy=False, flags=zmq.NOBLOCK)

    def close(self) -> None:
        """Nothing to release: queued frames die with the socket."""


class ZmqRecvChannel:
    """Reads each frame straight into its destination slice (`recv_into`)."""

    def recv_layer(self, sock: zmq.Socket, header: Layer, dst: torch.Tensor,
                   runs: list[tuple[int, int]], landed: Landed) -> None:
        if header.frame_blocks is None or header.frame_blocks < 1:
            raise ValueError(f"a zmq layer header needs frame_blocks >= 1, got "
                             f"{header.frame_blocks}")
        block_bytes = dst.nbytes // dst.shape[0]
        view = as_bytes(dst)
        for start, n in frame_slices(runs, header.frame_blocks):
            if not sock.get(zmq.RCVMORE):
                landed("layer message is missing tensor frames")
                return
            size = sock.recv_into(view[start * block_bytes:(start + n) * block_bytes],
                                  flags=zmq.NOBLOCK)
            if size != n * block_bytes:
                landed(f"tensor frame of {size} bytes where {n * block_bytes} were expected")
                return
        landed("layer message has extra frames" if sock.get(zmq.RCVMORE) else None)

    def close(self) -> None:
        """Nothing to release."""
