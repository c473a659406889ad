"""What the two ends of a KV transfer tell each other through the router and with the KV.

- `KVPeerInfo`: a decode worker's KV receiver as a prefill worker reaches it (inside
  `Prefill`), with the handles of the transports it offers (`ShmHandle`, `StoreAddress`,
  `MooncakeHandle`);
- `CompatRecord`: what both caches must agree on before a block moves (the receiver's is in
  its `KVPeerInfo`, the sender's in its hello);
- `FirstToken`: what the prefill worker hands the decode worker with the last layer.

They live here, below `kv_transfer`, because `Prefill` carries them: the router forwards
a receiver's info without importing the transfer code.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import msgspec

if TYPE_CHECKING:
    from engine.kv_cache import KVCache


class CompatRecord(msgspec.Struct, kw_only=True, frozen=True, forbid_unknown_fields=True):
    """What must agree for a block of one engine to mean the same thing in another.

    Unknown fields are refused: a peer of another version that compares more (or other)
    fields is not silently taken for a compatible one.

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


class ShmHandle(msgspec.Struct, kw_only=True, frozen=True):
    """A `SharedKVPool` as a same-host peer maps it: `/proc/<pid>/fd/<fd>`, `nbytes` long."""

    pid: int
    fd: int
    nbytes: int


class StoreAddress(msgspec.Struct, kw_only=True, frozen=True):
    """The receiver's `torch.distributed.TCPStore`, where each connection's pair group meets."""

    host: str
    port: int


class MooncakeHandle(msgspec.Struct, kw_only=True, frozen=True):
    """A receiver's pool as its Mooncake Transfer Engine exposes it.

    Args:
        session: the engine's `host:rpc_port`.
        protocol: `tcp` or `rdma`; the sender's engine must speak the same.
        base: the pool's address in the receiver's memory.
        nbytes: the pool's size.
    """

    session: str
    protocol: str
    base: int
    nbytes: int


class KVPeerInfo(msgspec.Struct, kw_only=True, frozen=True):
    """What a sender needs to connect to a receiver (`KVReceiver.peer_info()`).

    Args:
        receiver_id: unique per receiver (a prefill worker keeps one connection per id).
        endpoint: the receiver's control socket, `tcp://host:port`.
        compat: the receiver's compatibility record.
        num_blocks: blocks in the receiver's pool.
        transports: the transports it offers.
        verify_checksums: it wants an xxh3_64 per block with every layer.
        locality: equal to the sender's `locality()` exactly when `shm` can reach it.
        shm: its pool in shared memory, when it offers `shm`.
        store: its rendezvous store, when it offers `torch_dist`.
        mooncake: its registered pool, when it offers `mooncake`.
    """

    receiver_id: str
    endpoint: str
    compat: CompatRecord
    num_blocks: int
    transports: tuple[str, ...]
    verify_checksums: bool
    locality: str
    shm: ShmHandle | None = None
    store: StoreAddress | None = None
    mooncake: MooncakeHandle | None = None


class FirstToken(msgspec.Struct, kw_only=True, frozen=True):
    """The prefill's result, riding with the KV to the decode worker (`KVSender.finish`).

    Args:
        token_id: the first sampled token.
        logprobs: its step's `{token id: logprob}` when the request asked for logprobs.
        prefill_s: seconds from the prefill command's arrival to the first token, on the
            prefill worker (a wait behind the steps already running included).
    """

    token_id: int
    logprobs: dict[int, float] | None = None
    prefill_s: float = 0.0
