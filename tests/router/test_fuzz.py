"""Property test: whatever a client sends over gRPC or HTTP, the router answers with a clear
status (never a crash, a 500 or a hang) and the engine's KV pool ends fully free.

Runs against the real routers over the tiny engine; example counts keep it well under a
minute.
"""

from __future__ import annotations

import datetime
import json
import math

import grpc
import httpx
import pytest
from hypothesis import HealthCheck, find, given, seed, settings
from hypothesis import strategies as st

from router.proto.pdcluster.v1 import pdcluster_pb2 as pb
from router.proto.pdcluster.v1 import pdcluster_pb2_grpc as pb_grpc

# A new sample of inputs every day, the same sample all day: a failure comes back on a rerun
# of the same commit that day, and prints its falsifying input and a @reproduce_failure
# blob, while over the weeks the suite sends far more than one fixed set of 40 inputs (with
# `derandomize=True` it sent the same 40 forever). Purely random seeds would explore as much
# but make a rerun a different test; no example database, so nothing but the date carries
# over between runs.
DAILY_SEED = int(datetime.date.today().strftime("%Y%m%d"))
_SETTINGS = settings(max_examples=40, deadline=None, database=None, print_blob=True,
                     suppress_health_check=[HealthCheck.function_scoped_fixture,
                                            HealthCheck.too_slow])


def fuzz(test):
    return _SETTINGS(seed(DAILY_SEED)(test))


# What a well-behaved server may answer to arbitrary input; 5xx and UNKNOWN/INTERNAL are bugs.
HTTP_OK = {200, 400, 404, 413, 422, 429}
GRPC_OK = {grpc.StatusCode.OK, grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.NOT_FOUND,
           grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.OUT_OF_RANGE}

weird_text = st.one_of(
    st.text(max_size=40),
    st.text(st.characters(codec="utf-8"), max_size=20),
    st.sampled_from(["", "\ud800", "a\udfffb", "\x00", "\u202e", "🦀" * 30, "\n" * 10]))
weird_number = st.one_of(
    st.integers(-5, 40), st.integers(-2**70, 2**70),
    st.floats(allow_nan=True, allow_infinity=True),
    st.sampled_from([0, -1, 2**31, 2**63, 1e308, -0.0]))
weird_value = st.one_of(st.none(), st.booleans(), weird_number, weird_text,
                        st.lists(st.integers(-2**40, 2**40), max_size=5),
                        st.lists(weird_text, max_size=3), st.dictionaries(weird_text, st.none(),
                                                                          max_size=2))
small_max_tokens = st.one_of(st.integers(1, 12), weird_value)

completion_body = st.fixed_dictionaries({
    "prompt": st.one_of(weird_text, st.lists(st.integers(-10, 70000), max_size=30),
                        weird_value)}, optional={
    "max_tokens": small_max_tokens, "min_tokens": weird_value, "temperature": weird_value,
    "top_p": weird_value, "top_k": weird_value, "min_p": weird_value, "seed": weird_value,
    "stop": weird_value, "stop_token_ids": weird_value, "n": weird_value,
    "logprobs": weird_value, "stream": st.booleans(), "model": weird_value,
    "ignore_eos": weird_value, "echo": weird_value, "logit_bias": weird_value,
    "presence_penalty": weird_value})
chat_body = st.fixed_dictionaries({
    "messages": st.one_of(
        st.lists(st.fixed_dictionaries({"role": st.sampled_from(["user", "system", "bot"]),
                                        "content": st.one_of(weird_text, weird_value)}),
                 max_size=3),
        weird_value)}, optional={
    "max_tokens": small_max_tokens, "temperature": weird_value, "stream": st.booleans(),
    "top_logprobs": weird_value, "logprobs": weird_value, "response_format": weird_value})


def _post(base: str, path: str, content: bytes) -> int:
    resp = httpx.post(f"{base}{path}", content=content, timeout=60,
                      headers={"content-type": "application/json"})
    resp.read()
    return resp.status_code


@fuzz
@given(body=st.one_of(completion_body.map(lambda b: ("/v1/completions", b)),
                      chat_body.map(lambda b: ("/v1/chat/completions", b))),
       cut=st.one_of(st.none(), st.integers(0, 200)))
def test_http_any_body_gets_a_clear_answer(servers, body, cut):
    path, fields = body
    data = json.dumps(fields, allow_nan=True).encode("utf-8", "surrogatepass")
    if cut is not None:
        data = data[:cut]  # truncated or malformed JSON
    status = _post(f"http://127.0.0.1:{servers.http_port}", path, data)
    assert status in HTTP_OK, (status, data[:300])


@fuzz
@given(data=st.binary(max_size=200))
def test_http_arbitrary_bytes(servers, data):
    assert _post(f"http://127.0.0.1:{servers.http_port}", "/v1/completions", data) in HTTP_OK


def _int32(x: int) -> int:
    return max(min(x, 2**31 - 1), -2**31)


grpc_params = st.builds(
    dict, max_tokens=st.one_of(st.none(), st.integers(-3, 12), st.sampled_from([2**31 - 1])),
    min_tokens=st.one_of(st.none(), st.integers(-3, 20)),
    temperature=st.one_of(st.none(), st.floats(allow_nan=True, allow_infinity=True)),
    top_k=st.one_of(st.none(), st.integers(-2**31, 2**31 - 1)),
    top_p=st.one_of(st.none(), st.floats(allow_nan=True, allow_infinity=True)),
    min_p=st.one_of(st.none(), st.floats(allow_nan=True, allow_infinity=True)),
    seed=st.one_of(st.none(), st.integers(-2**63, 2**63 - 1)),
    stop=st.lists(st.text(max_size=5), max_size=3),
    stop_token_ids=st.lists(st.integers(-2**31, 2**31 - 1), max_size=3),
    logprobs=st.one_of(st.none(), st.integers(-3, 30)))


@fuzz
@given(which=st.sampled_from(["prompt", "ids", "messages", "none"]),
       text=st.text(max_size=40), ids=st.lists(st.integers(-2**31, 2**31 - 1), max_size=30),
       params=grpc_params, model=st.sampled_from(["", "tiny", "gpt-17"]),
       request_id=st.one_of(st.none(), st.text(max_size=10)))
def test_grpc_any_request_gets_a_clear_status(servers, which, text, ids, params, model,
                                              request_id):
    sampling = pb.SamplingParams(**{k: v for k, v in params.items() if v is not None})
    request = pb.GenerateRequest(model=model, request_id=request_id, sampling_params=sampling)
    if which == "prompt":
        request.prompt = text
    elif which == "ids":
        request.prompt_token_ids.CopyFrom(pb.TokenIds(ids=ids))
    elif which == "messages":
        request.messages.CopyFrom(pb.ChatMessages(messages=[pb.ChatMessage(role="user",
                                                                           content=text)]))
    with grpc.insecure_channel(f"127.0.0.1:{servers.grpc_port}") as channel:
        call = pb_grpc.PdClusterStub(channel).Generate(request, timeout=60)
        try:
            outs = list(call)
            code = grpc.StatusCode.OK
        except grpc.RpcError as e:
            code = e.code()
    assert code in GRPC_OK, (code, request)
    if code == grpc.StatusCode.OK:
        assert outs[-1].finish_reason in ("stop", "length"), outs[-1]


@fuzz
@given(data=st.binary(max_size=100))
def test_grpc_malformed_protobuf(servers, data):
    with grpc.insecure_channel(f"127.0.0.1:{servers.grpc_port}") as channel:
        call = channel.unary_stream("/pdcluster.v1.PdCluster/Generate",
                                    request_serializer=lambda b: b)(data, timeout=60)
        try:
            list(call)
            code = grpc.StatusCode.OK
        except grpc.RpcError as e:
            code = e.code()
    assert code in GRPC_OK, code


def test_strategies_reach_the_interesting_cases():
    """The generators above do produce NaN, infinities, surrogates and huge integers.
    (`find` stops at the first such input; `.example()` of the filtered strategy would
    draw until it has a hundred.)"""
    search = settings(database=None, max_examples=5000)
    assert math.isnan(find(weird_number, lambda x: isinstance(x, float) and x != x,
                           settings=search))
    assert "\ud800" in find(weird_text, lambda t: "\ud800" in t, settings=search)


pytestmark = pytest.mark.filterwarnings("ignore::hypothesis.errors.NonInteractiveExampleWarning")
