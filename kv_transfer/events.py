"""What a transfer endpoint reports: every request it accepted ends in exactly one event."""

from __future__ import annotations

from dataclasses import dataclass

from protocol.kv import FirstToken


@dataclass(frozen=True)
class TransferDone:
    """All layers of all blocks landed (receiver) or were acknowledged (sender).

    Args:
        request_id: the request.
        payload: on the receiver, what the sender passed to `finish` (the prefill's first
            token); None on the sender.
        transport: on the receiver, the transport the bytes came over (`shm`, `zmq`,
            `torch_dist`).
    """

    request_id: str
    payload: FirstToken | None = None
    transport: str = ""


@dataclass(frozen=True)
class TransferFailed:
    """The transfer ended without the KV; the caller now frees the request's blocks.

    Args:
        request_id: the request.
        reason: what went wrong (timeout, checksum mismatch, peer lost, aborted, cancelled).
    """

    request_id: str
    reason: str


TransferEvent = TransferDone | TransferFailed
