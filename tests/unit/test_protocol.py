"""The router <-> worker protocol: every message round-trips; garbage is refused, not guessed."""

from __future__ import annotations

import dataclasses
import pickle

import msgpack
import msgspec
import pytest

from engine import SamplingParams
from engine.stats import EngineStats
from protocol import (
    Abort,
    CompatRecord,
    Failed,
    Generate,
    KVPeerInfo,
    Prefill,
    Rejected,
    Reserved,
    Role,
    Stats,
    Step,
    TokenRecord,
    Utilization,
    WireSamplingParams,
    WorkerInfo,
    WorkerStats,
    decode_command,
    decode_reply,
    encode,
)
from protocol.kv import MooncakeHandle, ShmHandle, StoreAddress

PARAMS = WireSamplingParams.from_params(SamplingParams(max_tokens=4, stop=["x"]))
PEER_INFO = KVPeerInfo(
    receiver_id="a", endpoint="tcp://10.0.0.2:4000",
    compat=CompatRecord(model="/models/m", dtype="bfloat16", block_size=16, num_layers=30,
                        num_kv_heads=3, head_dim=64),
    num_blocks=512, transports=("shm", "zmq", "torch_dist", "mooncake"),
    verify_checksums=False, locality="boot/pid:[4026531836]",
    shm=ShmHandle(pid=41, fd=17, nbytes=1 << 30), store=StoreAddress(host="10.0.0.2", port=4001),
    mooncake=MooncakeHandle(session="10.0.0.2:4002", protocol="tcp", base=2**47, nbytes=1 << 30))
COMMANDS = [
    Generate(request_id="r@1", prompt_token_ids=[1, 2, 3], params=PARAMS, remote_prefill=True),
    Prefill(request_id="r@1", prompt_token_ids=[1, 2], params=PARAMS, peer_info=PEER_INFO,
            dst_block_ids=[7, 8], num_cached_tokens=16),
    Prefill(request_id="r@1", prompt_token_ids=[1, 2], params=PARAMS,
            peer_info=msgspec.structs.replace(PEER_INFO, shm=None, store=None, mooncake=None,
                                              transports=("zmq",)),
            dst_block_ids=[7, 8]),
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


def _generate(params: dict) -> bytes:
    """A `Generate` as raw msgpack, its params replaced."""
    good = msgspec.to_builtins(COMMANDS[0])
    return msgpack.packb({**good, "params": params})


def test_sampling_params_of_another_shape_are_refused():
    """A field of the wrong type, a field missing, or one this version does not know fails
    the decode (the worker logs and drops the message) rather than meaning something else."""
    good = msgspec.to_builtins(PARAMS)
    assert decode_command(_generate(good)).params == PARAMS
    for params, error in [({**good, "temperature": "hot"}, "Expected `float`, got `str`"),
                          ({k: v for k, v in good.items() if k != "top_p"},
                           "missing required field `top_p`"),
                          ({**good, "beam_width": 4}, "unknown field `beam_width`"),
                          ({**good, "logit_bias": [[1, 2, 3]]}, "Expected `array` of length 2")]:
        with pytest.raises(msgspec.ValidationError, match=error):
            decode_command(_generate(params))


def test_sampling_params_the_engine_refuses_fail_where_the_worker_builds_them():
    wire = decode_command(_generate({**msgspec.to_builtins(PARAMS), "top_p": 1.5})).params
    with pytest.raises(ValueError, match=r"top_p must be in \(0, 1\], got 1.5"):
        wire.to_params()


# A value other than the default for every field of SamplingParams.
EVERY_FIELD = SamplingParams(
    max_tokens=50, min_tokens=3, temperature=0.7, top_k=40, top_p=0.9, min_p=0.05, seed=1234,
    stop=["\n\n", "END"], stop_token_ids=[2, 7], ignore_eos=True, logprobs=5,
    skip_special_tokens=False, presence_penalty=0.5, frequency_penalty=-0.25,
    repetition_penalty=1.1, logit_bias={"7": -3.5, 2: 1.0}, json_schema='{"type": "object"}')


def test_every_sampling_param_survives_the_wire():
    """Exact both ways, field by field: a field added to `SamplingParams` and not to
    `WireSamplingParams` (or the other way) fails here."""
    fields = [f.name for f in dataclasses.fields(SamplingParams)]
    assert fields == list(WireSamplingParams.__struct_fields__)
    defaults = SamplingParams()
    assert [f for f in fields if getattr(EVERY_FIELD, f) == getattr(defaults, f)] == []
    wire = decode_command(encode(Generate(
        request_id="r", prompt_token_ids=[1],
        params=WireSamplingParams.from_params(EVERY_FIELD)))).params
    assert wire.to_params() == EVERY_FIELD
    for field in fields:
        assert getattr(wire.to_params(), field) == getattr(EVERY_FIELD, field), field
    assert EVERY_FIELD.logit_bias == ((2, 1.0), (7, -3.5))


def test_the_workers_info_survives_ray():
    """Ray pickles what an actor returns; the info keeps its types (the role an enum, the
    peer info a struct)."""
    info = WorkerInfo(worker_id="decode-0", role=Role.DECODE, endpoint="tcp://10.0.0.2:5000",
                      host="10.0.0.2", pid=41, node_id="n1", model_dir="/models/m",
                      max_model_len=2048, vocab_size=49152, block_size=16, num_blocks=512,
                      block_bytes=737280, torch_threads=2, peer_info=PEER_INFO)
    again = pickle.loads(pickle.dumps(info))
    assert again == info and again.role is Role.DECODE and again.peer_info.store.port == 4001


def test_engine_stats_are_worker_stats():
    """A worker sends its engine's stats inside `WorkerStats`: every figure has a field."""
    kinds = {"str": lambda i: f"v{i}", "int": lambda i: i, "float": lambda i: i + 0.5,
             "list[int]": lambda i: [i, i + 1]}
    values = {f.name: kinds[f.type](i) for i, f in enumerate(dataclasses.fields(EngineStats))}
    assert set(values) <= set(WorkerStats.__struct_fields__)
    wire = decode_reply(encode(Stats(worker_id="w", stats=WorkerStats(
        **dataclasses.asdict(EngineStats(**values)))))).stats
    assert {name: getattr(wire, name) for name in values} == values


def test_a_command_is_not_a_reply():
    with pytest.raises(msgspec.DecodeError):
        decode_reply(encode(Abort(request_id="r")))


def test_roles():
    assert Role("decode") is Role.DECODE and Role.MIXED.decodes and not Role.PREFILL.decodes
    with pytest.raises(ValueError):
        Role("router")
