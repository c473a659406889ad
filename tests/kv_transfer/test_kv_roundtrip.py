"""KV crosses a real process boundary bit for bit, on every transport."""

from __future__ import annotations

import pytest
import torch
from kv_peer import (
    RECEIVER_BLOCKS,
    SEED,
    SENDER_BLOCKS,
    TRANSPORT_PARAMS,
    ask,
    child,
    collect,
    compat_of,
    config,
    make_kv,
    make_plan,
    sender_main,
)

from kv_transfer import KVReceiver, SharedKVPool, TransferDone
from protocol.kv import FirstToken

# Every transport with pages of the model's dtype; int8 pages (their scales inside each
# row) on the two transports that carry them in CI.
ROUND_TRIPS = [pytest.param(*p.values, "auto", marks=p.marks, id=f"{p.values[0]}-auto")
               for p in TRANSPORT_PARAMS] + \
    [pytest.param(t, "int8", id=f"{t}-int8") for t in ("shm", "zmq")]


@pytest.mark.subprocess
@pytest.mark.parametrize(("transport", "kv_cache_dtype"), ROUND_TRIPS)
def test_received_kv_is_bit_identical(transport: str, kv_cache_dtype: str) -> None:
    # Blocks travel whole, so a partly filled last block arrives with its unused slots too.
    pool = SharedKVPool() if transport == "shm" else None
    kv = make_kv(RECEIVER_BLOCKS, allocator=pool, kv_cache_dtype=kv_cache_dtype)
    plan = make_plan()
    with KVReceiver(kv, compat_of(kv), config(transport), shm_pool=pool) as rx, \
            child(sender_main, transport, False, kv_cache_dtype) as (_, conn):
        peer_id = ask(conn, "connect", rx.peer_info())
        for rid, _, dst in plan:
            rx.expect(rid, dst)
        sender_events = ask(conn, "run", peer_id, plan)
        events = collect(rx, len(plan))

    assert sorted(sender_events, key=str) == sorted(
        (TransferDone(rid) for rid, _, _ in plan), key=str)
    assert sorted(events, key=str) == sorted(
        (TransferDone(rid, FirstToken(token_id=i), transport)
         for i, (rid, _, _) in enumerate(plan)),
        key=str)
    # bytes of [L, N, 2, bs, H, D] (int8: D + 4, each row's scale after it)
    sent = make_kv(SENDER_BLOCKS, seed=SEED, kv_cache_dtype=kv_cache_dtype).buffer.view(
        torch.uint8)
    got = kv.buffer.view(torch.uint8)
    for _, src, dst in plan:
        assert torch.equal(got[:, dst], sent[:, src])
    written = {b for _, _, dst in plan for b in dst}
    untouched = [b for b in range(RECEIVER_BLOCKS) if b not in written]
    assert not got[:, untouched].any()
