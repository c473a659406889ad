"""The mooncake transport's own rules: registration, layout, protocols, a missing extra.

The shared behaviour (bit-identical bytes between processes, faults, aborts and cancels)
is in the transport-parametrized tests beside this file.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import msgspec
import pytest
import torch
import zmq
from kv_peer import (
    NEEDS_MOONCAKE,
    NUM_LAYERS,
    RECEIVER_BLOCKS,
    SEED,
    SENDER_BLOCKS,
    ask,
    child,
    collect,
    compat_of,
    config,
    make_kv,
    receiver_main,
)

from kv_transfer import KVReceiver, KVSender, TransferDone
from kv_transfer.transports.mooncake import MooncakePool, MooncakeSendChannel, engine
from kv_transfer.wire import Layer, decode_from_sender


@NEEDS_MOONCAKE
@pytest.mark.subprocess
def test_the_engine_accepts_writes_into_a_request_only_while_it_is_in_flight() -> None:
    """A write held up on the network (a cut link) can arrive after its request ended and
    its blocks went to another request; the receiver's engine must refuse it. Such a late
    write is issued here by hand, through this process's engine, at addresses computed as
    the sender computes them."""
    kv = make_kv(SENDER_BLOCKS, seed=SEED)
    with KVSender(kv, compat_of(kv), config("mooncake")) as tx, \
            child(receiver_main, "mooncake") as (_, conn):
        info = ask(conn)
        peer = tx.connect(info, "mooncake")
        handle, te = info.mooncake, engine("127.0.0.1", "tcp")
        block_bytes = kv.layers[0][0].nbytes

        def late_write(layer: int, block: int) -> int:
            dst = handle.base + (layer * RECEIVER_BLOCKS + block) * block_bytes
            return te.te.transfer_sync_write(handle.session, kv.buffer.data_ptr(), dst,
                                             block_bytes)

        assert late_write(0, 20) != 0  # nothing expected, nothing accepted
        ask(conn, "expect", "r1", [20, 21])
        tx.begin("r1", peer, [3, 4], [20, 21])
        tx.send_layer("r1", 0)
        assert ask(conn, "wait_landed", "r1", 1)
        assert late_write(3, 21) == 0  # in flight: its blocks accept writes
        tx.abort("r1")
        (event,) = ask(conn, "events", 1)
        assert event.reason == "aborted by the sender: aborted by the prefill side"
        assert late_write(2, 20) != 0 and late_write(3, 21) != 0  # ended: refused
        assert ask(conn, "nonzero") == [(0, 20), (0, 21), (3, 21)]


@NEEDS_MOONCAKE
def test_blocks_land_at_the_receivers_layout_not_the_senders() -> None:
    # Pools of different sizes: a layer's stride is the receiver's, so the last layer's
    # last block is where an address computed from the sender's own size would miss.
    rx_kv, tx_kv = make_kv(RECEIVER_BLOCKS), make_kv(SENDER_BLOCKS, seed=SEED)
    last = RECEIVER_BLOCKS - 1
    offered = config("mooncake", transports=("mooncake", "zmq"))
    with KVReceiver(rx_kv, compat_of(rx_kv), offered) as rx, \
            KVSender(tx_kv, compat_of(tx_kv), config("mooncake")) as tx:
        peer = tx.connect(rx.peer_info())  # picked over zmq (the event names it)
        rx.expect("r1", [last, 0])
        tx.begin("r1", peer, [SENDER_BLOCKS - 1, 7], [last, 0])
        for layer in range(NUM_LAYERS):
            tx.send_layer("r1", layer)
        tx.finish("r1")
        assert collect(rx, 1) == [TransferDone("r1", None, "mooncake")]
    assert torch.equal(rx_kv.buffer[:, [last, 0]], tx_kv.buffer[:, [SENDER_BLOCKS - 1, 7]])
    assert not rx_kv.buffer[:, 1:last].any()


@NEEDS_MOONCAKE
def test_a_protocol_or_layout_mismatch_is_refused_at_connect() -> None:
    rx_kv, tx_kv = make_kv(RECEIVER_BLOCKS), make_kv(SENDER_BLOCKS, seed=SEED)
    with KVReceiver(rx_kv, compat_of(rx_kv), config("mooncake")) as rx, \
            KVSender(tx_kv, compat_of(tx_kv), config("mooncake")) as tx:
        info = rx.peer_info()
        rdma = msgspec.structs.replace(
            info, mooncake=msgspec.structs.replace(info.mooncake, protocol="rdma"))
        with pytest.raises(ValueError, match="speaks rdma, this one tcp"):
            tx.connect(rdma, "mooncake")
        with pytest.raises(ValueError, match="is not 4 layers of 63 blocks"):
            tx.connect(msgspec.structs.replace(info, num_blocks=RECEIVER_BLOCKS - 1), "mooncake")


@NEEDS_MOONCAKE
def test_one_engine_per_process_refuses_another_host() -> None:
    engine("127.0.0.1", "tcp")
    with pytest.raises(RuntimeError, match=r"runs on 127\.0\.0\.1 over tcp, not 127\.0\.0\.2"):
        engine("127.0.0.2", "tcp")


@pytest.mark.subprocess
def test_without_the_extra_the_transport_and_serve_say_what_to_install() -> None:
    hide = "import sys; sys.modules['mooncake'] = None; "  # `import mooncake` fails as absent
    receiver = subprocess.run(
        [sys.executable, "-c", hide + "from kv_peer import *; kv = make_kv(4); "
         "KVReceiver(kv, compat_of(kv), config('mooncake'))"],
        capture_output=True, text=True, timeout=120, cwd=Path(__file__).parent)
    assert receiver.returncode == 1
    assert ("RuntimeError: the mooncake transport needs pip install 'pdcluster[mooncake]' "
            "(mooncake-transfer-engine) and apt-get install -y libibverbs1") in receiver.stderr
    serve = subprocess.run(
        [sys.executable, "-c", hide + "from commands.cli import main; "
         "sys.exit(main(['serve', '--transport', 'mooncake']))"],
        capture_output=True, text=True, timeout=120)
    assert serve.returncode == 2
    assert serve.stderr.startswith("error: the mooncake transport needs pip install "
                                   "'pdcluster[mooncake]'")


@NEEDS_MOONCAKE
def test_layers_in_flight_together_send_their_headers_only_once_all_landed() -> None:
    """`send_layer` submits; the channel's `flush` waits for the writes in order, then sends
    the headers, and a failed write sends none of them."""
    src, dst = make_kv(SENDER_BLOCKS, seed=SEED), make_kv(RECEIVER_BLOCKS)
    pool = MooncakePool(dst.buffer, "127.0.0.1", "tcp")
    channel = MooncakeSendChannel(src.buffer, pool.handle(), RECEIVER_BLOCKS, "127.0.0.1",
                                  "tcp")
    ctx = zmq.Context.instance()
    out, into = ctx.socket(zmq.PAIR), ctx.socket(zmq.PAIR)
    into.bind("inproc://mooncake-headers")
    out.connect("inproc://mooncake-headers")
    keys = pool.admit([(10, 3)])
    try:
        for layer in range(NUM_LAYERS):
            channel.send_layer(out, Layer(rid="r1", layer=layer),
                               src.layers[layer], [(5, 10, 3)])
        assert into.poll(0) == 0  # submitted, no header yet
        channel.flush(out)
        assert [decode_from_sender(into.recv()).layer for _ in range(NUM_LAYERS)] == \
            list(range(NUM_LAYERS))
        for layer in range(NUM_LAYERS):
            assert torch.equal(dst.layers[layer][10:13], src.layers[layer][5:8])
        # Block 40 is not admitted: the engine refuses the write, no header leaves.
        channel.send_layer(out, Layer(rid="r2", layer=0), src.layers[0],
                           [(1, 40, 1)])
        with pytest.raises(ConnectionError, match="mooncake write"):
            channel.flush(out)
        assert into.poll(0) == 0
    finally:
        pool.revoke(keys)
        channel.close()
        out.close(linger=0)
        into.close(linger=0)
