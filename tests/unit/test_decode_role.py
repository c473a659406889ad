"""The decode role on a real engine and KV receiver: reservations that never get their KV."""

import time

from decode_worker import DecodeRole
from engine import CacheConfig, LLMEngine, SchedulerConfig
from kv_transfer import CompatRecord, KVReceiver, TransferConfig
from tests.conftest import assert_pool_free


def _role(kv_wait_timeout_s: float) -> tuple[LLMEngine, DecodeRole, KVReceiver]:
    engine = LLMEngine("tiny", cache=CacheConfig(block_size=4, num_blocks=32),
                       scheduler=SchedulerConfig(role="decode"))
    receiver = KVReceiver(engine.kv_cache, CompatRecord.from_kv_cache(engine.kv_cache, "tiny"),
                          TransferConfig(transports=("zmq",)))
    return engine, DecodeRole(engine, receiver, kv_wait_timeout_s), receiver


def _message(rid: str) -> dict:
    params = {"temperature": 0.0, "max_tokens": 4, "ignore_eos": True}
    return {"request_id": rid, "prompt_token_ids": list(range(100, 130)), "params": params,
            "remote_prefill": True}


def _events_until(receiver: KVReceiver, deadline_s: float) -> list:
    deadline = time.monotonic() + deadline_s
    while time.monotonic() < deadline:
        events = receiver.wait_events(timeout_s=0.1)
        if events:
            return events
    return []


def test_kv_that_never_arrives_ends_the_request_with_error_and_frees_blocks():
    engine, role, receiver = _role(kv_wait_timeout_s=0.5)
    try:
        reply = role.generate(engine, _message("lost"))
        assert reply["type"] == "reserved" and len(reply["dst_block_ids"]) == 8
        assert engine.block_pool.num_free_blocks == 32 - 8
        records = role.on_events(engine, _events_until(receiver, 10))
        assert [r["finish_reason"] for r in records] == ["error"]
        assert "KV transfer failed" in records[0]["error"]
        assert_pool_free(engine)
    finally:
        receiver.close()


def test_abort_while_waiting_for_kv_frees_blocks_once_the_receiver_lets_go():
    engine, role, receiver = _role(kv_wait_timeout_s=600)
    try:
        role.generate(engine, _message("cancel-me"))
        assert role.abort(engine, "cancel-me") is None  # blocks stay until the cancel lands
        assert engine.block_pool.num_free_blocks == 32 - 8
        records = role.on_events(engine, _events_until(receiver, 10))
        assert [r["finish_reason"] for r in records] == ["abort"]
        assert_pool_free(engine)
    finally:
        receiver.close()
