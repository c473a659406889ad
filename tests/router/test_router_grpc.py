"""The gRPC front door against a real tiny engine: exact tokens, errors, queueing, aborts."""

from __future__ import annotations

import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest
from grpc_reflection.v1alpha.proto_reflection_descriptor_database import (
    ProtoReflectionDescriptorDatabase,
)

from engine import SamplingParams
from router.client import PdClusterClient
from router.servers import start_servers
from tests.router.conftest import engine_stalled

PROMPT = "The quick brown fox"
GREEDY = {"temperature": 0.0, "ignore_eos": True}
LONG = {"max_tokens": 1000, **GREEDY}  # more than a test lets the engine produce


def _reference(offline, prompt, **params):
    return offline.generate(prompt, SamplingParams(**params))[0].outputs[0]


@pytest.mark.parametrize("kind", ["prompt", "prompt_token_ids", "messages"])
def test_stream_matches_offline_greedy(client, offline, kind):
    messages = [{"role": "user", "content": PROMPT}]
    if kind == "messages":
        ref = offline.chat(messages, SamplingParams(max_tokens=20, **GREEDY))[0].outputs[0]
        outs = list(client.generate(messages=messages, max_tokens=20, **GREEDY))
    else:
        prompt = PROMPT if kind == "prompt" else offline.tokenizer.encode(PROMPT)
        ref = _reference(offline, prompt, max_tokens=20, **GREEDY)
        outs = list(client.generate(**{kind: prompt}, max_tokens=20, **GREEDY))
    assert [t for out in outs for t in out.token_ids] == ref.token_ids
    assert "".join(out.text for out in outs) == ref.text
    final = outs[-1]
    assert final.finish_reason == "length" and all(not o.finished for o in outs[:-1])
    assert final.usage.completion_tokens == 20 and final.usage.prompt_tokens > 0
    assert 0 < final.timings.ttft <= final.timings.e2e
    if kind == "prompt":
        assert client.generate_text(PROMPT, max_tokens=20, **GREEDY) == ref.text


def test_logprobs_match_offline(client, offline):
    ref = _reference(offline, PROMPT, max_tokens=5, logprobs=3, **GREEDY)
    outs = list(client.generate(PROMPT, max_tokens=5, logprobs=3, **GREEDY))
    logprobs = [lp for out in outs for lp in out.logprobs or []]
    assert [lp.token_id for lp in logprobs] == ref.token_ids
    for lp, expected in zip(logprobs, ref.logprobs, strict=True):
        assert len(lp.top_logprobs) == 3
        assert lp.logprob == pytest.approx(expected[lp.token_id], abs=1e-5)
        assert lp.logprob == pytest.approx(max(lp.top_logprobs.values()), abs=1e-6)  # greedy


def test_penalties_bias_and_schema_match_offline(client, offline):
    """The gRPC SamplingParams carry the logits-processing fields to the engine unchanged."""
    fields = {"max_tokens": 24, "presence_penalty": 0.5, "frequency_penalty": 1.0,
              "repetition_penalty": 1.3, "logit_bias": {4242: 6.0, 17: -50.0},
              "json_schema": '{"type": "object"}', "temperature": 0.0}
    ref = _reference(offline, PROMPT, **fields)
    outs = list(client.generate(PROMPT, **fields))
    assert [t for out in outs for t in out.token_ids] == ref.token_ids
    assert outs[-1].finish_reason == ref.finish_reason


def test_stop_string_ends_text(client, offline):
    full = _reference(offline, PROMPT, max_tokens=24, **GREEDY).text
    stop = full.split()[3]
    ref = _reference(offline, PROMPT, max_tokens=24, stop=[stop], **GREEDY)
    outs = list(client.generate(PROMPT, max_tokens=24, stop=[stop], **GREEDY))
    text = "".join(out.text for out in outs)
    assert text == ref.text == full[:full.index(stop)]
    assert [t for out in outs for t in out.token_ids] == ref.token_ids
    assert outs[-1].finish_reason == "stop" and outs[-1].usage.completion_tokens < 24


@pytest.mark.parametrize(("inputs", "field"), [
    ({"prompt": ""}, "prompt"),
    ({"prompt_token_ids": [5] * 1024}, "prompt_token_ids: 1024 tokens is too long; the limit "
                                       "is 1023"),
    ({"prompt_token_ids": [5, 49152]}, "prompt_token_ids: token id 49152 is outside"),
    ({"prompt": PROMPT, "temperature": -1.0}, "temperature"),
    ({"prompt": PROMPT, "top_p": 0.0}, "top_p"),
    ({"prompt": PROMPT, "max_tokens": 0}, "max_tokens"),
    ({"messages": [{"role": "robot", "content": "hi"}]}, "messages[0]"),
    ({}, "prompt"),
])
def test_bad_input_is_invalid_argument(client, inputs, field):
    with pytest.raises(grpc.RpcError) as e:
        list(client.generate(**inputs))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert e.value.details().startswith(field)


def test_client_refuses_two_inputs(client):
    with pytest.raises(ValueError, match="only one"):
        list(client.generate(PROMPT, prompt_token_ids=[1, 2]))


def test_unknown_model_is_not_found(client):
    with pytest.raises(grpc.RpcError) as e:
        list(client.generate(PROMPT, model="gpt-17"))
    assert e.value.code() == grpc.StatusCode.NOT_FOUND
    assert "model" in e.value.details() and "gpt-17" in e.value.details()


def test_queue_full_rejects_at_once_and_queued_abort(make_servers, backend, wait_until):
    # No queue timeout: only an immediate refusal can end the third request. The engine is
    # held, so the running request keeps its slot however fast the machine.
    servers = make_servers(max_running=1, max_queue=1, queue_timeout_s=None)
    client = PdClusterClient(f"127.0.0.1:{servers.grpc_port}", timeout=30)
    with ThreadPoolExecutor(3) as pool:
        with engine_stalled(backend):
            running = pool.submit(lambda: list(client.generate(PROMPT, request_id="running",
                                                               **LONG)))
            wait_until(lambda: servers.router.admission.num_running == 1)
            queued = pool.submit(lambda: list(client.generate(PROMPT, request_id="queued",
                                                              max_tokens=4)))
            wait_until(lambda: servers.router.admission.num_waiting == 1)
            with pytest.raises(grpc.RpcError) as e:
                list(client.generate(PROMPT, **LONG))
            assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            aborts = [pool.submit(client.abort, "queued")]
            outs = queued.result(timeout=10)
            aborts.append(pool.submit(client.abort, "running"))  # reaches the held engine
        [abort.result(timeout=30) for abort in aborts]
        assert running.result(timeout=30)[-1].finish_reason == "abort"
    assert outs[-1].finish_reason == "abort" and outs[-1].usage.completion_tokens == 0


def test_queue_deadline(make_servers, backend, wait_until):
    servers = make_servers(max_running=1, max_queue=1, queue_timeout_s=0.2)
    client = PdClusterClient(f"127.0.0.1:{servers.grpc_port}", timeout=30)
    with ThreadPoolExecutor(2) as pool:
        with engine_stalled(backend):  # the running request holds the one slot throughout
            running = pool.submit(lambda: list(client.generate(PROMPT, request_id="running",
                                                               **LONG)))
            wait_until(lambda: servers.router.admission.num_running == 1)
            with pytest.raises(grpc.RpcError) as e:
                list(client.generate(PROMPT, max_tokens=4))
            assert e.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
            assert e.value.details().startswith("deadline")
            assert servers.router.admission.num_waiting == 0
            abort = pool.submit(client.abort, "running")  # reaches the held engine
        abort.result(timeout=30)
        assert running.result(timeout=30)[-1].finish_reason == "abort"


def test_abort_mid_stream(client):
    stream = client.generate(PROMPT, request_id="abort-me", **LONG)
    first = next(stream)
    with pytest.raises(grpc.RpcError) as e:  # the id is taken while the request lives
        list(client.generate(PROMPT, request_id="abort-me"))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    client.abort("abort-me")
    outs = [first, *stream]
    assert outs[-1].finish_reason == "abort"
    assert 0 < outs[-1].usage.completion_tokens < 1000
    assert outs[-1].usage.completion_tokens == sum(len(o.token_ids) for o in outs)


def test_abort_unknown_is_not_found(client):
    with pytest.raises(grpc.RpcError) as e:
        client.abort("no-such-request")
    assert e.value.code() == grpc.StatusCode.NOT_FOUND
    assert "no-such-request" in e.value.details()


def test_client_disconnect_aborts(client, servers, backend, wait_until):
    registry = servers.router.metrics.registry
    labels = {"model_name": "tiny", "cause": "disconnect"}
    before = registry.get_sample_value("pdcluster:requests_aborted_total", labels) or 0
    stream = client.generate(PROMPT, **LONG)
    next(stream)
    stream.close()  # cancels the call
    wait_until(lambda: servers.router.admission.num_running == 0)
    assert not backend.loop.call(lambda engine: engine.has_unfinished_requests())
    assert registry.get_sample_value("pdcluster:requests_aborted_total", labels) == before + 1


def test_status_health_reflection(client, servers):
    status = client.status()
    assert status["model"] == "tiny" and status["mode"] == "engine"
    worker = status["pools"]["mixed"][0]
    assert worker["worker_id"] == "engine-0" and worker["role"] == "mixed"
    assert worker["num_blocks"] == worker["num_free_blocks"] == 256
    assert worker["num_parked"] == 0  # carried in extra_json
    assert status["router"] == {"num_running": 0, "num_waiting": 0, "max_running": 256,
                                "max_queue": 1024}
    assert client.health() == "SERVING" and client.health("pdcluster.v1.PdCluster") == "SERVING"
    with grpc.insecure_channel(f"127.0.0.1:{servers.grpc_port}") as channel:
        db = ProtoReflectionDescriptorDatabase(channel)
        assert {"pdcluster.v1.PdCluster", "grpc.health.v1.Health"} <= set(db.get_services())
        proto = db.FindFileContainingSymbol("pdcluster.v1.PdCluster")
        assert proto.name == "pdcluster/v1/pdcluster.proto"


def test_scale(client):
    with pytest.raises(grpc.RpcError) as e:
        client.scale(decode=2)
    assert e.value.code() == grpc.StatusCode.UNIMPLEMENTED
    with pytest.raises(grpc.RpcError) as e:
        client.scale(prefill=-1)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert e.value.details().startswith("prefill")


def test_status_waits_out_a_server_that_is_restarting(loop_thread, backend):
    """A front door that is down for a moment (restarting): `status` is retried while the
    port refuses, and answers once a server listens there again; `generate` is never sent
    twice, so it fails at once."""
    held = socket.socket()  # bound, not listening: the port refuses, and stays ours
    held.bind(("127.0.0.1", 0))
    port = held.getsockname()[1]
    started: list = []

    def restart() -> None:
        held.close()
        started.append(loop_thread.run(start_servers(backend, grpc_port=port)))

    with PdClusterClient(f"127.0.0.1:{port}", timeout=20) as client:
        with pytest.raises(grpc.RpcError) as refused:
            list(client.generate(prompt_token_ids=[1, 2, 3], max_tokens=1))
        assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
        timer = threading.Timer(1.0, restart)
        timer.start()
        try:
            t0 = time.monotonic()
            assert client.status()["model"] == "tiny"
            assert time.monotonic() - t0 >= 0.9  # it did wait for the server
        finally:
            timer.join()
            held.close()
            for servers in started:
                loop_thread.run(servers.stop(grace=0.5))
