"""Moving paged KV blocks from a prefill engine to a decode engine.

The interface, used the same way whatever the transport::

    # decode worker (receiver)
    pool = SharedKVPool()                              # only when offering "shm"
    kv = KVCache(..., allocator=pool)
    rx = KVReceiver(kv, CompatRecord.from_kv_cache(kv, model), TransferConfig(
        transports=("shm", "zmq"), verify_checksums=False), shm_pool=pool)
    info = rx.peer_info()                              # a KVPeerInfo; goes to the prefill side
    rx.expect("req-1", dst_block_ids=[7, 8, 9])        # reserve first, then ask for prefill
    for event in rx.wait_events(timeout_s=0.01):       # TransferDone(payload) | TransferFailed
        ...                                            # free the blocks on TransferFailed
    rx.cancel("req-1")                                 # TransferFailed follows

    # prefill worker (sender)
    tx = KVSender(kv, CompatRecord.from_kv_cache(kv, model))
    peer = tx.connect(info)                            # handshake; KVCompatibilityError
    tx.begin("req-1", peer, src_block_ids=[3, 4, 5], dst_block_ids=[7, 8, 9])
    for layer in range(num_layers):
        ...                                            # compute layer `layer`
        tx.send_layer("req-1", layer)                  # returns at once; bytes move meanwhile
    tx.finish("req-1", FirstToken(token_id=42))        # rides to the receiver's TransferDone
    tx.poll()                                          # TransferDone once acknowledged

Guarantees:

- Every `expect` / `begin` ends in exactly one event on that side; timeouts, peer death
  (heartbeats), checksum mismatches, aborts and cancels all end as `TransferFailed`.
- The receiver writes only the blocks registered with `expect`, only for the sender that
  began the request, and emits a request's `TransferFailed` only once nothing can write into
  its blocks any more, so the caller may reuse them at once.
- Only the blocks passed are sent: the caller leaves the receiver's prefix-cache hits out
  of both block lists. Blocks travel whole, one contiguous slice per run of consecutive
  ids, for every layer of the pool.

Transports (`TransferConfig.transports`; the control messages, `kv_transfer.wire`'s typed
structs, travel over ZMQ always):
`shm` (same host: the sender copies into the receiver's pool in a memfd), `zmq` (TCP,
zero-copy frames), `torch_dist` (pairwise gloo group, NCCL when the pool is on CUDA),
`mooncake` (Mooncake's Transfer Engine, TCP or RDMA: the sender writes into the receiver's
registered pool; the `mooncake` extra).
"""

from kv_transfer.compat import CompatRecord, KVCompatibilityError, check_compat
from kv_transfer.config import TRANSPORTS, TransferConfig
from kv_transfer.events import TransferDone, TransferEvent, TransferFailed
from kv_transfer.receiver import KVReceiver
from kv_transfer.sender import KVSender
from kv_transfer.transports.shm import SharedKVPool

__all__ = [
    "TRANSPORTS",
    "CompatRecord",
    "KVCompatibilityError",
    "KVReceiver",
    "KVSender",
    "SharedKVPool",
    "TransferConfig",
    "TransferDone",
    "TransferEvent",
    "TransferFailed",
    "check_compat",
]
