"""Control messages: msgpack dicts with an "op" field, never pickle.

Sender -> receiver: hello, begin, layer (+ tensor frames on zmq), finish, abort, ping, bye.
Receiver -> sender: welcome, begin_ok, done, fail, ping, bye.
"""

from __future__ import annotations

from typing import Any

import msgpack


class ProtocolError(ValueError):
    """A peer sent something that is not a control message."""


def pack(msg: dict[str, Any]) -> bytes:
    """Encode one control message."""
    return msgpack.packb(msg)


def unpack(data: bytes) -> dict[str, Any]:
    """Decode one control message.

    Raises:
        ProtocolError: not a msgpack map with an "op" field.
    """
    try:
        msg = msgpack.unpackb(data)
    except (ValueError, TypeError) as exc:
        raise ProtocolError(f"undecodable control message: {exc}") from exc
    if not isinstance(msg, dict) or "op" not in msg:
        raise ProtocolError(f"control message without op: {msg!r}"[:200])
    return msg
