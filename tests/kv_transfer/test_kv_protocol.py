"""Protocol rules, in one process over real sockets: who may write where, and when it ends."""

from __future__ import annotations

import threading
from collections.abc import Iterator

import msgpack
import msgspec
import pytest
import torch
import zmq
from kv_peer import (
    NUM_LAYERS,
    RECEIVER_BLOCKS,
    SEED,
    SENDER_BLOCKS,
    TRANSPORT_PARAMS,
    NotingReceiver,
    collect,
    compat_of,
    config,
    make_kv,
)

from kv_transfer import KVReceiver, KVSender, SharedKVPool, TransferDone, TransferFailed, wire
from protocol.kv import FirstToken

FIRST = FirstToken(token_id=12, prefill_s=0.5)


@pytest.fixture(params=TRANSPORT_PARAMS)
def pair(request: pytest.FixtureRequest) -> Iterator[tuple[KVReceiver, KVSender, str]]:
    """A connected receiver and sender; the receiver's pool must stay all zeros unless a
    test transfers into it."""
    transport = request.param
    pool = SharedKVPool() if transport == "shm" else None
    rx_kv = make_kv(RECEIVER_BLOCKS, allocator=pool)
    tx_kv = make_kv(SENDER_BLOCKS, seed=SEED)
    with NotingReceiver(rx_kv, compat_of(rx_kv), config(transport), shm_pool=pool) as rx, \
            KVSender(tx_kv, compat_of(tx_kv), config(transport)) as tx:
        yield rx, tx, tx.connect(rx.peer_info(), transport)
    if pool is not None:
        pool.close()


def reasons(events: list) -> list[str]:
    assert all(isinstance(e, TransferFailed) for e in events), events
    return [e.reason for e in events]


def send_all(tx: KVSender, rid: str) -> None:
    for layer in range(NUM_LAYERS):
        tx.send_layer(rid, layer)
    tx.finish(rid, FIRST)


def test_unexpected_request_is_refused_and_nothing_written(pair) -> None:
    rx, tx, peer = pair
    tx.begin("nobody-expects", peer, [1, 2], [3, 4])
    send_all(tx, "nobody-expects")
    assert "does not expect this request" in reasons(collect(tx, 1))[0]
    assert rx.poll() == []
    assert not rx.kv.buffer.any()


def test_begin_must_match_the_reserved_blocks(pair) -> None:
    rx, tx, peer = pair
    rx.expect("r1", [3, 4])
    tx.begin("r1", peer, [1, 2], [3, 5])
    send_all(tx, "r1")
    assert "begin does not match the reservation" in reasons(collect(rx, 1))[0]
    assert "begin does not match the reservation" in reasons(collect(tx, 1))[0]
    assert not rx.kv.buffer.any()


def test_expect_and_begin_reject_bad_arguments(pair) -> None:
    rx, tx, peer = pair
    with pytest.raises(ValueError, match=r"ids \[64\] are outside the pool of 64 blocks"):
        rx.expect("r1", [1, RECEIVER_BLOCKS])
    with pytest.raises(ValueError, match="repeated ids"):
        rx.expect("r1", [1, 1])
    rx.expect("r1", [1])
    with pytest.raises(ValueError, match="already in flight"):
        rx.expect("r1", [2])
    with pytest.raises(ValueError, match="1 source blocks but 2 destination blocks"):
        tx.begin("r1", peer, [1], [1, 2])
    with pytest.raises(ValueError, match="unknown peer_id"):
        tx.begin("r1", "no-such-peer", [1], [1])
    with pytest.raises(ValueError, match="out of range"):
        tx.send_layer("r1", NUM_LAYERS)
    with pytest.raises(TypeError, match="payload must be a FirstToken or None, not dict"):
        tx.finish("r1", {"token_id": 5})


def test_fully_cached_prompt_still_delivers_the_payload(pair) -> None:
    rx, tx, peer = pair
    rx.expect("r1", [])
    tx.begin("r1", peer, [], [])
    send_all(tx, "r1")
    assert collect(rx, 1) == [TransferDone("r1", FIRST, *rx.config.transports)]
    assert collect(tx, 1) == [TransferDone("r1")]
    assert not rx.kv.buffer.any()


def test_receiver_times_out_when_nothing_arrives(pair) -> None:
    rx, _, _ = pair
    rx.expect("r1", [1, 2], timeout_s=0.3)
    assert reasons(collect(rx, 1)) == ["timed out after 0.3s with 0 of 4 layers received"]


def test_receiver_cancel_stops_the_sender_first(pair) -> None:
    rx, tx, peer = pair
    rx.expect("r1", [1, 2])
    tx.begin("r1", peer, [1, 2], [1, 2])
    tx.send_layer("r1", 0)
    assert rx.wait_landed("r1", 1)
    rx.cancel("r1")
    assert reasons(collect(rx, 1)) == ["cancelled by the decode side"]
    # The receiver waited for the sender's acknowledgement, so the sender has stopped.
    assert reasons(tx.poll()) == ["the decode side failed it: cancelled by the decode side"]
    tx.send_layer("r1", 1)  # ended requests ignore late calls
    # A whole transfer after it, on the same sender and peer, lands only after anything
    # the late call could have sent.
    rx.expect("r2", [5])
    tx.begin("r2", peer, [5], [5])
    send_all(tx, "r2")
    assert [type(e) for e in collect(rx, 1)] == [TransferDone]
    assert not rx.kv.buffer[1, [1, 2]].any()


def test_sender_abort_and_timeout_reach_the_receiver(pair) -> None:
    rx, tx, peer = pair
    rx.expect("r1", [1])
    rx.expect("r2", [2])
    tx.begin("r1", peer, [1], [1])
    tx.begin("r2", peer, [2], [2], timeout_s=0.3)
    tx.abort("r1")
    assert sorted(reasons(collect(rx, 2))) == ["aborted by the sender: aborted by the prefill side",
                                               "aborted by the sender: timed out after 0.3s"]
    assert sorted(reasons(collect(tx, 2))) == ["aborted by the prefill side",
                                               "timed out after 0.3s"]


def test_a_peer_with_no_connection_left_fails_its_transfers_at_once(pair) -> None:
    """libzmq can end a connection whose handshake failed for good (13-33 % of failed
    handshakes of a DEALER here), leaving the socket nothing to queue on: the sender drops that
    peer and fails its transfers, where a blocking send stalled its IO thread and every
    transfer behind it. The connection is ended here by disconnecting the socket on the
    IO thread, since that race cannot be caused on demand."""
    rx, tx, peer = pair
    endpoint = rx.peer_info().endpoint
    tx._call(lambda: tx._peers[peer].sock.disconnect(endpoint)).result(5)
    tx.begin("r1", peer, [1, 2], [1, 2])
    assert reasons(collect(tx, 1)) == [
        "lost the decode peer: no connection to the decode side (its handshake failed)"]
    tx.begin("r2", peer, [3], [3])  # the peer is gone: later transfers fail too
    assert reasons(collect(tx, 1)) == [f"lost the decode peer {peer}"]
    assert rx.poll() == []
    assert not rx.kv.buffer.any()


def test_finish_with_missing_layers_fails(pair) -> None:
    rx, tx, peer = pair
    rx.expect("r1", [1])
    tx.begin("r1", peer, [1], [1])
    tx.send_layer("r1", 2)
    tx.finish("r1")
    assert reasons(collect(rx, 1)) == ["the sender finished without layers [0, 1, 3]"]


def test_closing_the_receiver_fails_the_senders_requests(pair) -> None:
    rx, tx, peer = pair
    rx.expect("r1", [1])
    tx.begin("r1", peer, [1], [1])
    rx.close()
    assert reasons(collect(rx, 1)) == ["the receiver closed"]
    assert "the decode side left" in reasons(collect(tx, 1))[0]


class GatedSender(KVSender):
    """Holds every layer's transmission until `gate` opens; notes the receiver's begin_ok."""

    def __init__(self, *args: object) -> None:
        super().__init__(*args)
        self.gate = threading.Event()
        self.accepted = threading.Event()

    def _on_begin_ok(self, peer: object, request_id: str) -> None:
        super()._on_begin_ok(peer, request_id)
        self.accepted.set()

    def _transmit(self, req: object, layer: int) -> None:
        self.gate.wait()  # shut until the test opens it: a blocking send_layer would hang
        super()._transmit(req, layer)


def test_send_layer_returns_while_the_transport_is_busy() -> None:
    rx_kv, tx_kv = make_kv(RECEIVER_BLOCKS), make_kv(SENDER_BLOCKS, seed=SEED)
    with KVReceiver(rx_kv, compat_of(rx_kv), config("zmq")) as rx, \
            GatedSender(tx_kv, compat_of(tx_kv), config("zmq")) as tx:
        rx.expect("r1", [1, 2])
        tx.begin("r1", tx.connect(rx.peer_info()), [5, 6], [1, 2])
        assert tx.accepted.wait(30)
        try:
            send_all(tx, "r1")  # returns although no layer can be transmitted yet
            assert rx.poll() == [] and tx.poll() == []
        finally:
            tx.gate.set()
        assert collect(rx, 1) == [TransferDone("r1", FIRST, *rx.config.transports)]
    assert torch.equal(rx_kv.buffer[:, [1, 2]], tx_kv.buffer[:, [5, 6]])


def test_a_payload_the_sender_accepts_reaches_the_receiver() -> None:
    """A map with integer keys (the prefill worker's first-token logprobs, {token id:
    logprob}) reaches the receiver intact: before, the receiver's codec refused such keys
    and every remotely prefilled request asking for logprobs timed out."""
    rx_kv, tx_kv = make_kv(RECEIVER_BLOCKS), make_kv(SENDER_BLOCKS, seed=SEED)
    payload = FirstToken(token_id=5, logprobs={7: -0.25, 9: -1.5}, prefill_s=0.01)
    with NotingReceiver(rx_kv, compat_of(rx_kv), config("zmq")) as rx, \
            KVSender(tx_kv, compat_of(tx_kv), config("zmq")) as tx:
        peer = tx.connect(rx.peer_info(), "zmq")
        rx.expect("r1", [3, 4])
        tx.begin("r1", peer, [1, 2], [3, 4])
        for layer in range(NUM_LAYERS):
            tx.send_layer("r1", layer)
        tx.finish("r1", payload)
        # Two blocks land in milliseconds; waiting longer only delays the expected failure.
        events = collect(rx, 1, timeout_s=1.0)
    assert [type(e) for e in events] == [TransferDone] and events[0].payload == payload


def test_a_hello_of_another_version_is_refused_with_the_reason() -> None:
    """A hello that does not decode (here a compatibility record comparing one field more)
    is answered with why, so that sender's `connect` fails with it instead of timing out;
    the receiver serves a well-formed hello after it as before."""
    rx_kv = make_kv(RECEIVER_BLOCKS)
    hello = msgspec.to_builtins(wire.Hello(compat=compat_of(rx_kv), transport="zmq"))
    hello["compat"]["rope_scaling"] = "yarn"
    ctx = zmq.Context()
    try:
        with KVReceiver(rx_kv, compat_of(rx_kv), config("zmq")) as rx:
            sock = ctx.socket(zmq.DEALER)
            sock.connect(rx.peer_info().endpoint)
            sock.send(msgpack.packb(hello))
            assert sock.poll(30_000)
            refusal = wire.decode_from_receiver(sock.recv())
            sock.send(wire.encode(wire.Hello(compat=compat_of(rx_kv), transport="zmq")))
            assert sock.poll(30_000)
            welcome = wire.decode_from_receiver(sock.recv())
            sock.close(linger=0)
    finally:
        ctx.term()
    assert refusal == wire.Welcome(
        ok=False, kind="protocol",
        error="undecodable hello: Object contains unknown field `rope_scaling` - at `$.compat`")
    assert welcome == wire.Welcome(ok=True)
    with pytest.raises(ConnectionError, match="refused the handshake: undecodable hello"):
        KVSender._check_welcome(refusal)
