"""Control messages between a KV sender and a KV receiver: typed structs over msgpack, tagged
by their "op" field, never pickle (msgspec's codec, the one the router's protocol uses).

Sender -> receiver (`SenderMessage`): `Hello`, `Begin`, `Layer` (+ tensor frames on zmq),
`Finish`, `Abort`, `Ping`, `Bye`.
Receiver -> sender (`ReceiverMessage`): `Welcome`, `BeginOk`, `Done`, `Fail`, `Ping`, `Bye`.

A message that does not decode raises `msgspec.DecodeError` (or its `ValidationError`
subclass); the IO threads log and drop it, they never crash on it.
"""

from __future__ import annotations

from typing import Literal

import msgspec

from protocol.kv import CompatRecord, FirstToken


class _Control(msgspec.Struct, kw_only=True, tag_field="op", omit_defaults=True):
    pass


# ---- both ways ---------------------------------------------------------------------------

class Ping(_Control, tag="ping"):
    """A heartbeat: the peer is alive (any message counts as one)."""


class Bye(_Control, tag="bye"):
    """The peer leaves (closed, or dropped the connection); its requests end."""

    reason: str


# ---- sender -> receiver ------------------------------------------------------------------

class Hello(_Control, tag="hello"):
    """Open a connection: this cache's record and the transport the bytes will take."""

    compat: CompatRecord
    transport: str


class Begin(_Control, tag="begin"):
    """Start a request the receiver `expect`s.

    Args:
        rid: the request id.
        dst: the destination blocks (must equal the reservation).
        runs: the sender's split of `dst` into runs, as block counts.
    """

    rid: str
    dst: list[int]
    runs: list[int]


class Layer(_Control, tag="layer"):
    """One layer of a request is on its way (zmq: its frames follow) or in place.

    Args:
        rid: the request id.
        layer: the layer index.
        sums: an xxh3_64 per source block, when the receiver verifies checksums.
        frame_blocks: zmq: blocks per tensor frame.
        dist_tag: torch_dist: the tag of the first run's send (one more per run).
    """

    rid: str
    layer: int
    sums: list[int] | None = None
    frame_blocks: int | None = None
    dist_tag: int | None = None


class Finish(_Control, tag="finish"):
    """Every layer is sent; `payload` goes to the receiver's caller with `TransferDone`."""

    rid: str
    payload: FirstToken | None = None


class Abort(_Control, tag="abort"):
    """The sender stopped the request (or acknowledges the receiver's `Fail`): nothing of it
    is on its way any more."""

    rid: str
    reason: str


# ---- receiver -> sender ------------------------------------------------------------------

class Welcome(_Control, tag="welcome"):
    """The answer to `Hello`.

    Args:
        ok: the connection is open.
        kind: why not: the caches differ (`compat`), the transport is not offered
            (`transport`), or the hello did not decode (`protocol`: another version).
        error: the refusal, for the sender's exception.
    """

    ok: bool
    kind: Literal["compat", "transport", "protocol"] | None = None
    error: str = ""


class BeginOk(_Control, tag="begin_ok"):
    """The request matches its reservation: bytes may move."""

    rid: str


class Done(_Control, tag="done"):
    """Every layer landed (and checked): the sender may free its blocks."""

    rid: str


class Fail(_Control, tag="fail"):
    """The receiver ended the request; the sender acknowledges with `Abort`."""

    rid: str
    reason: str


SenderMessage = Hello | Begin | Layer | Finish | Abort | Ping | Bye
ReceiverMessage = Welcome | BeginOk | Done | Fail | Ping | Bye

_encoder = msgspec.msgpack.Encoder()
_from_sender = msgspec.msgpack.Decoder(SenderMessage)
_from_receiver = msgspec.msgpack.Decoder(ReceiverMessage)


def encode(message: SenderMessage | ReceiverMessage) -> bytes:
    """The message as msgpack bytes (its `op` tag included)."""
    return _encoder.encode(message)


def decode_from_sender(data: bytes) -> SenderMessage:
    """A sender -> receiver message.

    Raises:
        msgspec.DecodeError: not a well-formed sender message.
    """
    return _from_sender.decode(data)


def decode_from_receiver(data: bytes) -> ReceiverMessage:
    """A receiver -> sender message.

    Raises:
        msgspec.DecodeError: not a well-formed receiver message.
    """
    return _from_receiver.decode(data)
