"""The prefill role on a real engine and KV sender: a decode worker it cannot reach (a cut
link, a lost host) fails that request's transfer, which the router retries elsewhere,
instead of failing the request."""

from __future__ import annotations

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
