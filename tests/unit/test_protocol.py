"""The router <-> worker protocol: every message round-trips; garbage is refused, not guessed."""

from __future__ import annotations

import msgpack
import msgspec
import pytest

from protocol import (
    Abort,
    Failed,
    Generate,
    Prefill,
    Rejected,
    Reserved,
    Role,
    Stats,
    Step,
    TokenRecord,
    Utilization,
    WorkerStats,
    decode_command,
    decode_reply,
    encode,
)

COMMANDS = [
    Generate(request_id="r@1", prompt_token_ids=[1, 2, 3], params={"max_tokens": 4, "stop": ["x"]},
             remote_prefill=True),
    Prefill(request_id="r@1", prompt_token_ids=[1, 2], params={}, peer_info={"receiver_id": "a"},
            dst_block_ids=[7, 8], num_cached_tokens=16),
    Abort(request_id="r@2"),
]
REPLIES = [
    Reserved(worker_id="decode-0", request_id="r@1", dst_block_ids=[3], num_cached_tokens=0),
    Rejected(worker_id="decode-0", request_id="r@1", reason="full"),
    Step(worker_id="decode-0", outputs=[
        TokenRecord(request_id="r@1", token_ids=[5], logprobs=[{5: -0.1, 9: -2.5}],
                    timings={"prefill": 0.1, "transfer": 0.01}),
        TokenRecord(request_id="q@1", finish_reason="error", error="KV transfer failed: x",
                    transfer_failed=True)]),
    Failed(worker_id="prefill-1", request_id="r@1", error="boom", transfer_failed=True),
    Stats(worker_id="prefill-1", stats=WorkerStats(
        num_free_blocks=3, step_totals={"decode_1": [2.0, 0.1, 0.005, 40.0]},
        utilization=Utilization(busy=0.5))),
]


@pytest.mark.parametrize("message", COMMANDS)
def test_commands_round_trip(message):
    assert decode_command(encode(message)) == message


@pytest.mark.parametrize("message", REPLIES)
def test_replies_round_trip(message):
    assert decode_reply(encode(message)) == message


@pytest.mark.parametrize("data", [
    b"", b"\xc1", b"garbage", msgpack.packb({"type": "generate"}),  # fields missing
    msgpack.packb({"type": "launch_missiles", "request_id": "r"}),  # unknown type
    msgpack.packb({"type": "abort", "request_id": 5}),  # wrong field type
    msgpack.packb([1, 2, 3]),
])
def test_garbage_is_refused(data):
    with pytest.raises(msgspec.DecodeError):
        decode_command(data)
    with pytest.raises(msgspec.DecodeError):
        decode_reply(data)


def test_stats_with_a_mistyped_field_are_refused():
    """A worker's stats are a typed struct: a figure of the wrong type is a decode error
    (the message is dropped and logged), not a key read later by name."""
    good = msgspec.to_builtins(Stats(worker_id="w", stats=WorkerStats(num_running=2)))
    assert decode_reply(msgpack.packb(good)).stats.num_running == 2
    for stats in ({"num_running": "two"}, {"utilization": {"busy": "x"}}):
        with pytest.raises(msgspec.DecodeError):
            decode_reply(msgpack.packb({**good, "stats": stats}))


def test_a_command_is_not_a_reply():
    with pytest.raises(msgspec.DecodeError):
        decode_reply(encode(Abort(request_id="r")))


def test_roles():
    assert Role("decode") is Role.DECODE and Role.MIXED.decodes and not Role.PREFILL.decodes
    with pytest.raises(ValueError):
        Role("router")
