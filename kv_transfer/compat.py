"""The handshake record two engines compare before any KV moves between them."""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields
from typing import Any

from engine.kv_cache import KVCache


class KVCompatibilityError(ValueError):
    """Two KV caches cannot exchange blocks; the message names every differing field."""


@dataclass(frozen=True)
class CompatRecord:
    """What must agree for a block of one engine to mean the same thing in another.

    Args:
        model: fingerprint of the weights (for example a hash of `config.json` and the
            weight files); KV computed by other weights is garbage to the receiver.
        dtype: element type name, for example "bfloat16".
        block_size: tokens per block.
        num_layers: transformer layers.
        num_kv_heads: key/value heads.
        head_dim: size of one head.
        layout: page layout; only "NHD" (`[2, block_size, num_kv_heads, head_dim]`) exists.
    """

    model: str
    dtype: str
    block_size: int
    num_layers: int
    num_kv_heads: int
    head_dim: int
    layout: str = "NHD"

    @classmethod
    def from_kv_cache(cls, kv_cache: KVCache, model: str) -> CompatRecord:
        """Describe `kv_cache` as filled by the weights `model`.

        Args:
            kv_cache: the engine's KV pool.
            model: fingerprint of the weights.

        Returns:
            The record to hand to `KVSender` / `KVReceiver`.
        """
        layout = kv_cache.layout()
        return cls(model=model, dtype=str(layout["dtype"]), block_size=kv_cache.block_size,
                   num_layers=kv_cache.num_layers, num_kv_heads=kv_cache.num_kv_heads,
                   head_dim=kv_cache.head_dim, layout=str(layout["layout"]))

    def to_dict(self) -> dict[str, Any]:
        """The record as a msgpack-able dict."""
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> CompatRecord:
        """Rebuild a record sent by a peer.

        Raises:
            KVCompatibilityError: fields are missing or unknown (a peer of another version).
        """
        names = {f.name for f in fields(cls)}
        if not isinstance(data, dict) or set(data) != names:
            raise KVCompatibilityError(f"malformed compatibility record from peer: {data!r}")
        return cls(**data)


def check_compat(local: CompatRecord, remote: CompatRecord) -> None:
    """Refuse a peer whose KV blocks would not mean the same as ours.

    Args:
        local: this engine's record.
        remote: the peer's record.

    Raises:
        KVCompatibilityError: one or more fields differ; each is named with both values.
    """
    diffs = [f"{f.name}: {getattr(local, f.name)!r} here, {getattr(remote, f.name)!r} on the peer"
             for f in fields(local) if getattr(local, f.name) != getattr(remote, f.name)]
    if diffs:
        raise KVCompatibilityError("incompatible KV caches: " + "; ".join(diffs))
