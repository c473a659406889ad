"""The decode role on a real engine and KV receiver: reservations that never get their KV."""

import time

from decode_worker import DecodeRole
from engine import CacheConfig, LLMEngine, SchedulerConfig
from kv_transfer import CompatRecord, KVReceiver, TransferConfig
from protocol import Generate, Reserved, Step
from tests.conftest import assert_pool_free


def _role(kv_wait_timeout_s: float) -> tuple[LLMEngine, DecodeRole, KVReceiver]:
    engine = LLMEngine("tiny", cache=CacheConfig(block_size=4, num_blocks=32),
                       scheduler=SchedulerConfig(role="decode"))
    receiver = KVReceiver(engine.kv_cache, CompatRecord.from_kv_cache(engine.kv_cache, "tiny"),
                          TransferConfig(transports=("zmq",)))
    return engine, DecodeRole("decode-0", engine, receiver, kv_wait_timeout_s), receiver


def _message(rid: str) -> Generate:
    params = {"temperature": 0.0, "max_tokens": 4, "ignore_eos": True}
    return Generate(request_id=rid, prompt_token_ids=list(range(100, 130)), params=params,
                    remote_prefill=True)


def _records(replies: list) -> list:
    assert all(isinstance(r, Step) and r.worker_id == "decode-0" for r in replies)
    return [record for step in replies for record in step.outputs]


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
        [reply] = role.handle(engine, _message("lost"))
        assert isinstance(reply, Reserved) and len(reply.dst_block_ids) == 8
        assert engine.block_pool.num_free_blocks == 32 - 8
        records = _records(role.on_events(engine, _events_until(receiver, 10)))
        assert [r.finish_reason for r in records] == ["error"]
        assert "KV transfer failed" in records[0].error and records[0].transfer_failed
        assert_pool_free(engine)
    finally:
        receiver.close()


def test_abort_while_waiting_for_kv_frees_blocks_once_the_receiver_lets_go():
    engine, role, receiver = _role(kv_wait_timeout_s=600)
    try:
        role.handle(engine, _message("cancel-me"))
        assert role.abort(engine, "cancel-me") == []  # blocks stay until the cancel lands
        assert engine.block_pool.num_free_blocks == 32 - 8
        records = _records(role.on_events(engine, _events_until(receiver, 10)))
        assert [r.finish_reason for r in records] == ["abort"]
        assert_pool_free(engine)
    finally:
        receiver.close()
