"""The small pure pieces: block runs, config validation, the control messages' codec."""

from __future__ import annotations

import msgpack
import msgspec
import pytest
import torch

from kv_transfer import CompatRecord, TransferConfig, wire
from kv_transfer.blocks import as_bytes, block_runs, check_block_ids, copy_runs, dst_runs
from kv_transfer.transports.zmq_tcp import frame_slices
from protocol.kv import FirstToken


def test_block_runs_merge_blocks_consecutive_on_both_sides() -> None:
    assert block_runs([4, 5, 6, 9, 10, 2], [0, 1, 7, 8, 9, 3]) == [
        (4, 0, 2), (6, 7, 1), (9, 8, 2), (2, 3, 1)]
    assert block_runs([], []) == []


def test_dst_runs_checks_the_senders_split() -> None:
    assert dst_runs([0, 1, 7, 8, 9], [2, 3]) == [(0, 2), (7, 3)]
    with pytest.raises(ValueError, match="do not cover 5 blocks"):
        dst_runs([0, 1, 7, 8, 9], [2, 2])
    with pytest.raises(ValueError, match="not consecutive"):
        dst_runs([0, 1, 7, 8, 9], [3, 2])


def test_check_block_ids() -> None:
    assert check_block_ids(torch.tensor([3, 1]).tolist(), 4, "ids") == [3, 1]
    with pytest.raises(ValueError, match=r"ids: ids \[-1, 4\] are outside the pool of 4"):
        check_block_ids([-1, 2, 4], 4, "ids")


def test_frame_slices_cut_runs_at_the_frame_size() -> None:
    assert frame_slices([(10, 5), (40, 2)], 2) == [(10, 2), (12, 2), (14, 1), (40, 2)]


def test_copy_runs_moves_exactly_the_runs() -> None:
    src = torch.arange(6 * 4, dtype=torch.bfloat16).view(6, 4)
    dst = torch.zeros(6, 4, dtype=torch.bfloat16)
    copy_runs(dst, src, block_runs([0, 1, 4], [3, 4, 0]))
    assert torch.equal(dst[[3, 4, 0]], src[[0, 1, 4]])
    assert not dst[[1, 2, 5]].any()
    assert bytes(as_bytes(src[1])) == src[1].view(torch.uint8).numpy().tobytes()


def test_config_is_validated_where_built() -> None:
    with pytest.raises(ValueError, match="subset of"):
        TransferConfig(transports=("rdma",))
    with pytest.raises(ValueError, match="heartbeat_s must be > 0"):
        TransferConfig(heartbeat_s=0)
    with pytest.raises(ValueError, match="must exceed heartbeat_s"):
        TransferConfig(heartbeat_s=2, peer_timeout_s=1)


COMPAT = CompatRecord(model="m", dtype="bfloat16", block_size=4, num_layers=2,
                      num_kv_heads=2, head_dim=8)
FROM_SENDER = [
    wire.Hello(compat=COMPAT, transport="zmq"),
    wire.Begin(rid="r1", dst=[7, 8, 9], runs=[2, 1]),
    wire.Layer(rid="r1", layer=3, sums=[0, 2**64 - 1], frame_blocks=16),
    wire.Layer(rid="r1", layer=0, dist_tag=12),
    wire.Finish(rid="r1", payload=FirstToken(token_id=5, logprobs={7: -0.25}, prefill_s=0.5)),
    wire.Finish(rid="r2"),
    wire.Abort(rid="r1", reason="acknowledged"),
    wire.Ping(),
    wire.Bye(reason="the sender closed"),
]
FROM_RECEIVER = [
    wire.Welcome(ok=True),
    wire.Welcome(ok=False, kind="compat", error="incompatible KV caches: ..."),
    wire.BeginOk(rid="r1"),
    wire.Done(rid="r1"),
    wire.Fail(rid="r1", reason="cancelled by the decode side"),
    wire.Ping(),
    wire.Bye(reason="the receiver closed"),
]


@pytest.mark.parametrize("message", FROM_SENDER)
def test_sender_messages_round_trip(message: wire.SenderMessage) -> None:
    assert wire.decode_from_sender(wire.encode(message)) == message


@pytest.mark.parametrize("message", FROM_RECEIVER)
def test_receiver_messages_round_trip(message: wire.ReceiverMessage) -> None:
    assert wire.decode_from_receiver(wire.encode(message)) == message


def test_messages_are_msgpack_maps_tagged_by_op() -> None:
    assert msgpack.unpackb(wire.encode(wire.Begin(rid="r", dst=[1], runs=[1]))) == {
        "op": "begin", "rid": "r", "dst": [1], "runs": [1]}
    # Optional fields a transport did not set stay off the wire.
    assert msgpack.unpackb(wire.encode(wire.Layer(rid="r", layer=2))) == {
        "op": "layer", "rid": "r", "layer": 2}


GOOD_HELLO = {"op": "hello", "transport": "zmq", "compat": msgspec.to_builtins(COMPAT)}


@pytest.mark.parametrize("data", [
    b"", b"\xc1", msgpack.packb([1, 2]),
    msgpack.packb({"rid": "r1"}),  # no op
    msgpack.packb({"op": "launch", "rid": "r1"}),  # unknown op
    msgpack.packb({"op": "layer", "rid": "r1"}),  # a field missing
    msgpack.packb({"op": "layer", "rid": "r1", "layer": "0"}),  # a field of the wrong type
    msgpack.packb({"op": "begin", "rid": "r1", "dst": [1, None], "runs": [2]}),
    msgpack.packb({"op": "finish", "rid": "r1", "payload": {"first_token": 5}}),
    msgpack.packb({**GOOD_HELLO, "compat": {"model": "m"}}),  # a record missing fields
    # A record of another version that compares one more field is not taken as ours.
    msgpack.packb({**GOOD_HELLO, "compat": {**GOOD_HELLO["compat"], "rope": "yarn"}}),
    msgpack.packb({"op": "welcome", "ok": True}),  # a receiver's message
])
def test_malformed_sender_messages_are_refused(data: bytes) -> None:
    with pytest.raises(msgspec.DecodeError):
        wire.decode_from_sender(data)


def test_a_well_formed_hello_decodes_to_its_struct() -> None:
    """The control for the refusals above."""
    assert wire.decode_from_sender(msgpack.packb(GOOD_HELLO)) == wire.Hello(
        compat=COMPAT, transport="zmq")


@pytest.mark.parametrize("data", [
    b"\xc1", msgpack.packb({"op": "welcome"}),
    msgpack.packb({"op": "welcome", "ok": False, "kind": "weather"}),
    msgpack.packb({"op": "done"}), msgpack.packb({"op": "hello"}),
])
def test_malformed_receiver_messages_are_refused(data: bytes) -> None:
    with pytest.raises(msgspec.DecodeError):
        wire.decode_from_receiver(data)
