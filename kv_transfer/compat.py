"""The handshake check two engines make before any KV moves between them.

The record itself, `CompatRecord`, is a `protocol.kv` struct: it travels inside the
receiver's `KVPeerInfo` (through the router) and the sender's `Hello`.
"""

from __future__ import annotations

from protocol.kv import CompatRecord

__all__ = ["CompatRecord", "KVCompatibilityError", "check_compat"]


class KVCompatibilityError(ValueError):
    """Two KV caches cannot exchange blocks; the message names every differing field."""


def check_compat(local: CompatRecord, remote: CompatRecord) -> None:
    """Refuse a peer whose KV blocks would not mean the same as ours.

    Args:
        local: this engine's record.
        remote: the peer's record.

    Raises:
        KVCompatibilityError: one or more fields differ; each is named with both values.
    """
    diffs = [f"{name}: {getattr(local, name)!r} here, {getattr(remote, name)!r} on the peer"
             for name in CompatRecord.__struct_fields__
             if getattr(local, name) != getattr(remote, name)]
    if diffs:
        raise KVCompatibilityError("incompatible KV caches: " + "; ".join(diffs))
