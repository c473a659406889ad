"""Control messages: msgpack maps with an "op" field, never pickle (msgspec's codec, the one
the router's protocol uses; map keys may be any msgpack key, such as the token ids of a
first token's logprobs).

Sender -> receiver: hello, begin, layer (+ tensor frames on zmq), finish, abort, ping, bye.
Receiver -> sender: welcome, begin_ok, done, fail, ping, bye.
"""

from __future__ import annotations

from typing import Any

import msgspec


class ProtocolError(ValueError):
    """A peer sent something that is not a control message."""


def pack(msg: dict[str, Any]) -> bytes:
    """Encode one control message."""
    return msgspec.msgpack.encode(msg)


def unpack(data: bytes) -> dict[str, Any]:
    """Decode one control message.

    Raises:
        ProtocolError: not a msgpack map with an "op" field.
    """
    try:
        msg = msgspec.msgpack.decode(data)
    except msgspec.DecodeError as exc:
        raise ProtocolError(f"undecodable control message: {exc}") from exc
    if not isinstance(msg, dict) or "op" not in msg:
        raise ProtocolError(f"control message without op: {msg!r}"[:200])
    return msg
