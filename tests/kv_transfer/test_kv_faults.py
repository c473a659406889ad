"""Peer death, timeouts, corruption and refused handshakes end requests cleanly."""

from __future__ import annotations

import msgspec
import pytest
import torch
from kv_peer import (
    BLOCK_SIZE,
    HEAD_DIM,
    NUM_KV_HEADS,
    NUM_LAYERS,
    RECEIVER_BLOCKS,
    SEED,
    SENDER_BLOCKS,
    TRANSPORT_PARAMS,
    NotingReceiver,
    ask,
    child,
    collect,
    compat_of,
    config,
    make_kv,
    receiver_main,
    sender_main,
)

from engine.kv_cache import KVCache
from kv_transfer import (
    KVCompatibilityError,
    KVSender,
    SharedKVPool,
    TransferFailed,
)

SRC, DST = [3, 4, 5, 9], [20, 21, 40, 7]
# Where a test kills the peer, the survivor calls a peer lost after 2 s of silence (ten
# missed heartbeats) instead of 5: the kill is the only silence in those tests, which
# otherwise spend the difference waiting.
LOST_AFTER_S = 2.0


def receiver_for(transport: str, **overrides: float) -> NotingReceiver:
    pool = SharedKVPool() if transport == "shm" else None
    kv = make_kv(RECEIVER_BLOCKS, allocator=pool)
    return NotingReceiver(kv, compat_of(kv), config(transport, **overrides), shm_pool=pool)


def only_failure(events: list, request_id: str) -> str:
    assert len(events) == 1, events
    assert isinstance(events[0], TransferFailed) and events[0].request_id == request_id
    return events[0].reason


@pytest.mark.subprocess
@pytest.mark.parametrize("transport", TRANSPORT_PARAMS)
def test_receiver_killed_mid_transfer_fails_and_releases_the_request(transport: str) -> None:
    kv = make_kv(SENDER_BLOCKS, seed=SEED)
    with KVSender(kv, compat_of(kv), config(transport, peer_timeout_s=LOST_AFTER_S)) as tx, \
            child(receiver_main, transport) as (proc, conn):
        peer_id = tx.connect(ask(conn), transport)
        ask(conn, "expect", "r1", DST)
        tx.begin("r1", peer_id, SRC, DST)
        tx.send_layer("r1", 0)
        tx.send_layer("r1", 1)
        assert ask(conn, "wait_landed", "r1", 2)  # truly mid-transfer: two layers are in
        proc.kill()
        proc.join(5)
        tx.send_layer("r1", 2)
        tx.send_layer("r1", 3)
        tx.finish("r1")
        # Heartbeats notice the loss (the request timeout, 60 s, would say "timed out").
        reason = only_failure(collect(tx, 1, timeout_s=30), "r1")
        assert "lost the decode peer" in reason
        assert not tx.is_connected(peer_id)  # a caller reconnects before sending again
        # Released: the id is free again, and the lost peer fails new requests at once.
        tx.begin("r1", peer_id, SRC, DST)
        assert "lost the decode peer" in only_failure(collect(tx, 1, timeout_s=30), "r1")


@pytest.mark.subprocess
@pytest.mark.parametrize("transport", TRANSPORT_PARAMS)
def test_sender_killed_mid_transfer_fails_on_the_receiver(transport: str) -> None:
    with receiver_for(transport, peer_timeout_s=LOST_AFTER_S) as rx, \
            child(sender_main, transport) as (proc, conn):
        peer_id = ask(conn, "connect", rx.peer_info())
        rx.expect("r1", DST)
        ask(conn, "start", peer_id, "r1", SRC, DST, 2)
        assert rx.wait_landed("r1", 2)  # truly mid-transfer: two of four layers are in
        proc.kill()
        proc.join(5)
        reason = only_failure(collect(rx, 1, timeout_s=30), "r1")
        assert "lost the sender" in reason


@pytest.mark.subprocess
@pytest.mark.parametrize("transport", TRANSPORT_PARAMS)
def test_checksum_mismatch_fails_both_sides(transport: str) -> None:
    with receiver_for(transport) as rx, child(sender_main, transport, True) as (_, conn):
        peer_id = ask(conn, "connect", rx.peer_info())
        rx.expect("r1", DST)
        sender_events = ask(conn, "run", peer_id, [("r1", SRC, DST)])
        reason = only_failure(collect(rx, 1), "r1")
    assert reason.startswith(f"checksum mismatch in layer 1, block {DST[0]}: xxh3_64 0x")
    assert "checksum mismatch" in only_failure(sender_events, "r1")


@pytest.mark.parametrize("transport", TRANSPORT_PARAMS)
def test_mismatched_handshake_is_refused_by_both_sides(transport: str) -> None:
    kv = make_kv(SENDER_BLOCKS, block_size=8)
    with receiver_for(transport) as rx, KVSender(kv, compat_of(kv), config(transport)) as tx:
        info = rx.peer_info()
        with pytest.raises(KVCompatibilityError, match="block_size: 8 here, 4 on the peer"):
            tx.connect(info, transport)
        # A sender that skips its own check is refused by the receiver.
        info = msgspec.structs.replace(info, compat=compat_of(kv))
        with pytest.raises(KVCompatibilityError,
                           match=r"refused the handshake.*block_size: 4 here, 8 on the peer"):
            tx.connect(info, transport)


@pytest.mark.parametrize("transport", ["shm", "zmq"])
def test_int8_pages_are_refused_by_a_peer_of_another_kv_dtype(transport: str) -> None:
    # The same model and geometry: only the pages' format differs, and bytes of one read as
    # the other would be garbage, so the handshake names it before anything moves.
    kv = KVCache(NUM_LAYERS, SENDER_BLOCKS, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM,
                 torch.bfloat16, kv_cache_dtype="int8")
    with receiver_for(transport) as rx, KVSender(kv, compat_of(kv), config(transport)) as tx:
        with pytest.raises(KVCompatibilityError) as err:
            tx.connect(rx.peer_info(), transport)
        assert str(err.value) == ("incompatible KV caches: dtype: 'int8' here, 'bfloat16' "
                                  "on the peer")


def test_compat_error_names_every_field_with_both_values() -> None:
    kv = make_kv(SENDER_BLOCKS)
    with receiver_for("zmq") as rx:
        theirs = msgspec.structs.replace(compat_of(kv), model="other", num_layers=2)
        with KVSender(kv, compat_of(kv), config("zmq")) as tx, \
                pytest.raises(KVCompatibilityError) as err:
            tx.connect(msgspec.structs.replace(rx.peer_info(), compat=theirs))
    assert str(err.value) == ("incompatible KV caches: model: 'tiny-test-model' here, 'other' "
                              "on the peer; num_layers: 4 here, 2 on the peer")
