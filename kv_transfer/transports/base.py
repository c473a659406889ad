"""The two halves of a transport: how one layer of a request's blocks leaves and lands."""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

import torch
import zmq

from kv_transfer.blocks import Run
from kv_transfer.wire import Layer

# Called once per layer on the receiver's IO thread: None when the bytes are in place,
# else why they are not.
Landed = Callable[[str | None], None]


class SendChannel(Protocol):
    """The sender's side of one connection; used only on the sender's IO thread."""

    def send_layer(self, sock: zmq.Socket, header: Layer, src: torch.Tensor,
                   runs: list[Run]) -> None:
        """Move one layer of a request's blocks and send `header` on the control socket.

        Args:
            sock: the control socket to the receiver.
            header: the "layer" control message; a transport may set its own field
                (`frame_blocks`, `dist_tag`).
            src: the sender's pool for this layer, `[num_blocks, 2, block_size, H, D]`.
            runs: the request's blocks as runs consecutive on both sides.
        """
        ...

    def flush(self, sock: zmq.Socket) -> None:
        """Complete every write `send_layer` left in flight and send their headers, in
        order; raise `ConnectionError` (after all of them ended) if any failed. The sender
        calls it before any other message to the peer and at the end of each loop turn."""
        ...

    def close(self) -> None:
        """Release what the connection holds (mappings, process groups); a write still in
        flight ends first."""
        ...


class Immediate:
    """For send channels whose `send_layer` finishes the layer, header included."""

    def flush(self, sock: zmq.Socket) -> None:
        """Nothing is ever left in flight."""


class RecvChannel(Protocol):
    """The receiver's side of one connection; used only on the receiver's IO thread."""

    def recv_layer(self, sock: zmq.Socket, header: Layer, dst: torch.Tensor,
                   runs: list[tuple[int, int]], landed: Landed) -> None:
        """Land one layer whose "layer" header just arrived.

        Args:
            sock: the control socket, positioned after the header (tensor frames follow
                on zmq).
            header: the "layer" control message.
            dst: the receiver's pool for this layer, `[num_blocks, 2, block_size, H, D]`.
            runs: `(dst_start, num_blocks)` of the request, already validated.
            landed: called exactly once, now or later on the IO thread.
        """
        ...

    def close(self) -> None:
        """Release what the connection holds."""
        ...
