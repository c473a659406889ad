"""The decode role on a real engine and KV receiver: reservations that never get their KV;
its `decode` spans, received by a real OTLP receiver, end on every ending of a request and
keep the client's W3C `tracestate`."""

import time

import pytest

from decode_worker import DecodeRole
from engine import CacheConfig, LLMEngine, SamplingParams, SchedulerConfig
from kv_transfer import CompatRecord, KVReceiver, TransferConfig, TransferDone
from protocol import FirstToken, Generate, Reserved, Step, WireSamplingParams
from protocol.tracing import Tracer, TracingConfig
from tests.conftest import assert_pool_free
from tests.otlp_receiver import OtlpReceiver

TRACE_ID, PARENT = "4bf92f3577b34da6a3ce929d0e0e4736", "00f067aa0ba902b7"
STATE = "congo=t61rcWkgMzE,rojo=00f067aa0ba902b7"


def _role(kv_wait_timeout_s: float, tracer: Tracer | None = None
          ) -> tuple[LLMEngine, DecodeRole, KVReceiver]:
    engine = LLMEngine("tiny", cache=CacheConfig(block_size=4, num_blocks=32),
                       scheduler=SchedulerConfig(role="decode"))
    receiver = KVReceiver(engine.kv_cache, CompatRecord.from_kv_cache(engine.kv_cache, "tiny"),
                          TransferConfig(transports=("zmq",)))
    return engine, DecodeRole("decode-0", engine, receiver, kv_wait_timeout_s,
                              tracer), receiver


def _message(rid: str, remote_prefill: bool = True, max_tokens: int = 4,
             tracestate: str | None = None) -> Generate:
    params = WireSamplingParams.from_params(
        SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True))
    return Generate(request_id=rid, prompt_token_ids=list(range(100, 130)), params=params,
                    remote_prefill=remote_prefill,
                    traceparent=f"00-{TRACE_ID}-{PARENT}-01", tracestate=tracestate)


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


def test_landed_kv_joins_the_batch_with_the_prefills_first_token():
    """What rides with the KV (`FirstToken`) is the request's first record: the token, its
    logprobs and the prefill's timings, and the request decodes on from there."""
    engine, role, receiver = _role(kv_wait_timeout_s=600)
    try:
        role.handle(engine, _message("r", max_tokens=3))
        first = FirstToken(token_id=42, logprobs={42: -0.5, 7: -1.25}, prefill_s=0.25)
        [record] = _records(role.on_events(engine, [TransferDone("r", first, "zmq")]))
        assert (record.request_id, record.token_ids, record.logprobs, record.transport) == \
            ("r", [42], [{42: -0.5, 7: -1.25}], "zmq")
        assert record.timings["prefill"] == 0.25 and record.timings["transfer"] >= 0.0
        tokens = []
        while engine.has_unfinished_requests():
            tokens += [t for r in _records(role.on_outputs(engine.step())) for t in r.token_ids]
        assert len(tokens) == 2  # max_tokens=3, the first came from the prefill worker
        assert_pool_free(engine)
    finally:
        receiver.close()


def test_kv_without_its_first_token_fails_the_request_and_frees_blocks():
    engine, role, receiver = _role(kv_wait_timeout_s=600)
    try:
        role.handle(engine, _message("r"))
        [record] = _records(role.on_events(engine, [TransferDone("r", None, "zmq")]))
        assert (record.finish_reason, record.error, record.transfer_failed) == \
            ("error", "KV transfer failed: the KV arrived without the first token", True)
        assert_pool_free(engine)
    finally:
        receiver.close()


@pytest.fixture
def traced():
    receiver = OtlpReceiver()
    tracer = Tracer(TracingConfig(receiver.endpoint), "decode", "decode-0")
    yield receiver, tracer
    tracer.shutdown()
    receiver.close()


def test_decode_spans_end_when_requests_finish_are_aborted_or_lose_their_kv(traced):
    otlp, tracer = traced
    engine, role, receiver = _role(kv_wait_timeout_s=0.5, tracer=tracer)
    try:
        role.handle(engine, _message("done", remote_prefill=False))
        role.handle(engine, _message("aborted", remote_prefill=False, max_tokens=1000))
        role.handle(engine, _message("lost"))  # reserved; its KV never comes
        finished = []
        while "done" not in finished:
            finished += [r.request_id for r in _records(role.on_outputs(engine.step()))
                         if r.finish_reason]
        role.abort(engine, "aborted")
        lost = _records(role.on_events(engine, _events_until(receiver, 10)))
        assert [r.finish_reason for r in lost] == ["error"]
        assert_pool_free(engine)
    finally:
        receiver.close()
    tracer.shutdown()
    spans = {s.attributes["pdcluster.request_id"]: s for s in otlp.spans}
    # "lost" never joined the batch: no decode span, and nothing of it is kept.
    assert set(spans) == {"done", "aborted"} and not role._traces and not role._spans
    for rid, reason in (("done", "length"), ("aborted", "abort")):
        span = spans[rid]
        assert (span.name, span.trace_id, span.parent_span_id) == ("decode", TRACE_ID, PARENT)
        assert span.attributes["gen_ai.response.finish_reasons"] == (reason,)
        assert span.attributes["pdcluster.local_prefill"] is True and not span.error
        assert span.resource["service.name"] == "pdcluster-decode"
        assert span.resource["pdcluster.worker_id"] == "decode-0"


def test_decode_spans_keep_the_clients_tracestate(traced):
    """The router's `Generate` carries the client's `tracestate` beside the `traceparent`:
    the span of a request prefilled here and that of one whose KV landed both keep it."""
    otlp, tracer = traced
    engine, role, receiver = _role(kv_wait_timeout_s=600, tracer=tracer)
    try:
        role.handle(engine, _message("here", remote_prefill=False, tracestate=STATE))
        role.handle(engine, _message("landed", tracestate=STATE))
        role.on_events(engine, [TransferDone("landed", FirstToken(token_id=42, prefill_s=0.1),
                                             "zmq")])
        while engine.has_unfinished_requests():
            role.on_outputs(engine.step())
        assert_pool_free(engine)
    finally:
        receiver.close()
    tracer.shutdown()
    spans = {s.attributes["pdcluster.request_id"]: s for s in otlp.spans}
    assert set(spans) == {"here", "landed"}
    for span in spans.values():
        assert (span.trace_id, span.parent_span_id, span.trace_state) == \
            (TRACE_ID, PARENT, STATE)
