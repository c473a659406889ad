"""The KV control socket with the cluster's CURVE key: keyed senders transfer bit for bit,
peers without the key (none, or a keypair of their own) are never heard."""

from __future__ import annotations

import threading

import pytest
import torch
import zmq
from kv_peer import (
    RECEIVER_BLOCKS,
    SEED,
    SENDER_BLOCKS,
    collect,
    compat_of,
    config,
    make_kv,
    make_plan,
    run_plan,
)
from zmq.auth.thread import AuthenticationThread

from kv_transfer import KVReceiver, KVSender, SharedKVPool, TransferDone, wire
from protocol.kv import FirstToken
from protocol.secure import ClusterKey
from tests.rogue import FAILED, Rogue


def _hello(rx: KVReceiver, transport: str) -> bytes:
    """A well-formed, compatible handshake: what an unkeyed receiver welcomes."""
    return wire.encode(wire.Hello(transport=transport, compat=rx.compat))


@pytest.mark.parametrize("transport", ["zmq", "shm"])
def test_keyed_peers_transfer_and_rogues_are_never_heard(transport: str) -> None:
    key = ClusterKey.generate()
    pool = SharedKVPool() if transport == "shm" else None
    kv = make_kv(RECEIVER_BLOCKS, allocator=pool)
    src = make_kv(SENDER_BLOCKS, seed=SEED)
    plan = make_plan()
    with KVReceiver(kv, compat_of(kv), config(transport, cluster_key=key), shm_pool=pool) as rx:
        info = rx.peer_info()
        for server_public in (None, key.public):
            with Rogue(info.endpoint, zmq.DEALER, server_public) as rogue:
                rogue.send(_hello(rx, transport))
                assert rogue.handshake() in FAILED
        for rid, _, dst in plan:
            rx.expect(rid, dst)
        with KVSender(src, compat_of(src), config(transport, cluster_key=key)) as tx:
            peer_id = tx.connect(info, transport)
            sender_events = run_plan(tx, peer_id, plan)
        events = collect(rx, len(plan))
        denied = rx._sockets.decisions["denied"]

    assert sorted(map(str, sender_events)) == sorted(str(TransferDone(r)) for r, _, _ in plan)
    assert sorted(map(str, events)) == sorted(
        str(TransferDone(rid, FirstToken(token_id=i), transport))
        for i, (rid, _, _) in enumerate(plan))
    sent, got = src.buffer.view(torch.int16), kv.buffer.view(torch.int16)
    for _, s, d in plan:
        assert torch.equal(got[:, d], sent[:, s])
    assert denied >= 1  # the rogue with a keypair of its own was refused by ZAP
    # Both endpoints stopped their ZAP handlers when they closed.
    assert not [t for t in threading.enumerate() if isinstance(t, AuthenticationThread)]


def test_without_a_key_the_same_rogue_is_welcomed() -> None:
    """The control: the observable above would catch a rogue that got through."""
    kv = make_kv(RECEIVER_BLOCKS)
    with KVReceiver(kv, compat_of(kv), config("zmq")) as rx, \
            Rogue(rx.peer_info().endpoint, zmq.DEALER, None) as rogue:
        rogue.send(_hello(rx, "zmq"))
        assert rogue.handshake() == zmq.EVENT_HANDSHAKE_SUCCEEDED
        assert rogue.sock.poll(30_000)
        assert wire.decode_from_receiver(rogue.sock.recv()) == wire.Welcome(ok=True)


def test_a_sender_without_the_key_cannot_connect() -> None:
    key = ClusterKey.generate()
    kv, src = make_kv(RECEIVER_BLOCKS), make_kv(SENDER_BLOCKS, seed=SEED)
    with KVReceiver(kv, compat_of(kv), config("zmq", cluster_key=key)) as rx, \
            KVSender(src, compat_of(src), config("zmq", connect_timeout_s=1.0)) as tx, \
            pytest.raises(ConnectionError,
                          match=r"over zmq: no welcome within 1s|its handshake failed"):
        tx.connect(rx.peer_info(), "zmq")
