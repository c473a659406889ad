"""The prefill role on a real engine and KV sender: a decode worker it cannot reach (a cut
link, a lost host) fails that request's transfer, which the router retries elsewhere,
instead of failing the request."""

from __future__ import annotations

import time

from engine import CacheConfig, LLMEngine, SamplingParams, SchedulerConfig
from kv_transfer import CompatRecord, KVReceiver, KVSender, TransferConfig
from prefill_worker import PrefillRole
from protocol import Failed, Prefill, WireSamplingParams
from tests.conftest import assert_pool_free


def test_a_decode_worker_that_never_answers_the_handshake_fails_the_transfer_only():
    engine = LLMEngine("tiny", cache=CacheConfig(block_size=4, num_blocks=32),
                       scheduler=SchedulerConfig(role="prefill"))
    compat = CompatRecord.from_kv_cache(engine.kv_cache, "tiny")
    sender = KVSender(engine.kv_cache, compat, TransferConfig(transports=("zmq",),
                                                              connect_timeout_s=0.5))
    # A receiver's address with nobody behind it any more: the hello is never welcomed.
    gone = KVReceiver(engine.kv_cache, compat, TransferConfig(transports=("zmq",)))
    peer_info = gone.peer_info()
    gone.close()
    role = PrefillRole("prefill-0", engine, sender)
    params = WireSamplingParams.from_params(SamplingParams(temperature=0.0, max_tokens=1))
    command = Prefill(request_id="r@1", prompt_token_ids=list(range(100, 120)), params=params,
                      peer_info=peer_info, dst_block_ids=[3, 4, 5, 6, 7])
    try:
        role.prepare(command)
        [reply] = role.handle(engine, command)
        assert isinstance(reply, Failed) and reply.transfer_failed
        assert (reply.worker_id, reply.request_id) == ("prefill-0", "r@1")
        assert reply.error.startswith("KV transfer failed: connecting to ")
        assert "no welcome within 0.5s" in reply.error
        assert not engine.has_unfinished_requests()
        assert_pool_free(engine)
    finally:
        sender.close()


def test_the_prefill_time_starts_when_the_command_arrives():
    """The reader thread takes the command (`prepare`) while the engine thread may still be
    in a long step; the prefill's time, which the decode worker subtracts from its KV wait,
    starts then, not when the engine thread gets to it; so does the clock of its TTFT
    budget, whose deadline orders the engine's waiting prompts."""
    prefill = LLMEngine("tiny", cache=CacheConfig(block_size=4, num_blocks=32),
                        scheduler=SchedulerConfig(role="prefill"))
    decode = LLMEngine("tiny", cache=CacheConfig(block_size=4, num_blocks=32),
                       scheduler=SchedulerConfig(role="decode"))
    compat = CompatRecord.from_kv_cache(prefill.kv_cache, "tiny")
    config = TransferConfig(transports=("zmq",))
    sender = KVSender(prefill.kv_cache, compat, config)
    receiver = KVReceiver(decode.kv_cache, compat, config)
    role = PrefillRole("prefill-0", prefill, sender)
    prompt = list(range(100, 120))
    params = WireSamplingParams.from_params(SamplingParams(temperature=0.0, max_tokens=2))
    reserved = decode.reserve_remote("r@1", prompt, params.to_params())
    receiver.expect("r@1", reserved.block_ids)
    command = Prefill(request_id="r@1", prompt_token_ids=prompt, params=params,
                      peer_info=receiver.peer_info(), dst_block_ids=reserved.block_ids,
                      ttft_budget_s=5.0)
    try:
        arrived = time.monotonic()
        role.prepare(command)
        prepared = time.monotonic()
        time.sleep(0.3)  # the engine thread finishing a long step
        assert role.handle(prefill, command) == []
        assert arrived + 5.0 <= prefill.requests["r@1"].ttft_deadline <= prepared + 5.0
        while prefill.has_unfinished_requests():
            assert role.on_outputs(prefill.step(role.layer_hook)) == []
        [done] = receiver.wait_events(10.0)
        first = done.payload
        assert done.request_id == "r@1" and first is not None
        assert 0.3 <= first.prefill_s <= time.monotonic() - arrived
        assert role.on_events(prefill, sender.wait_events(10.0)) == []
        decode.complete_remote("r@1", first.token_id)
        while decode.has_unfinished_requests():
            decode.step()
        assert_pool_free(prefill)
        assert_pool_free(decode)
    finally:
        sender.close()
        receiver.close()
