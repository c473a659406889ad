"""The real CLI: `pdcluster serve` on SmolLM2 (1 prefill + 1 decode worker, CURVE inside,
traces to an OTLP receiver in this process), real gRPC and OpenAI clients, exact tokens
against `transformers` and the offline engine.

Colocated serving is covered by the integration tests (a mixed Ray worker streams the
engine's exact tokens), `--mode colocated` reaching the cluster by `test_cli_flags` below,
and SmolLM2 in the colocated (mixed) role by the unit tests against `transformers`.
"""

from __future__ import annotations

import importlib.metadata
import json
import math
import secrets
import time

import httpx
import pytest

from commands.cli import main
from engine import SamplingParams, apply_chat_template
from router.client import PdClusterClient
from tests.conftest import SMOL_CHATS, hf_greedy
from tests.e2e.serving import serve
from tests.otlp_receiver import OtlpReceiver

pytestmark = [pytest.mark.slow, pytest.mark.e2e]


@pytest.fixture(scope="module")
def otlp():
    receiver = OtlpReceiver()
    yield receiver
    receiver.close()


@pytest.fixture(scope="module")
def disaggregated(otlp):
    # CURVE on the internal sockets (on loopback `auto` would leave them plain); spans
    # exported every 0.2 s instead of 5 s, so the trace test waits less; a TTFT objective,
    # so every request carries its budget to both workers' schedulers.
    with serve("--model", "smollm2", "--prefill", "1", "--decode", "1",
               "--local-prefill-threshold", "0", "--metrics-compat", "vllm",
               "--slo", "ttft_p90_ms=60000,tpot_p90_ms=5000",
               "--internal-auth", "curve", "--otlp-traces-endpoint", otlp.endpoint,
               env={"OTEL_BSP_SCHEDULE_DELAY": "200"}) as served:
        yield served


def _chat_tokens(address: str, content: str, n: int = 32) -> tuple[list[int], str]:
    with PdClusterClient(address, timeout=120) as client:
        tokens, text = [], ""
        for out in client.generate(messages=[{"role": "user", "content": content}],
                                   max_tokens=n, temperature=0.0, ignore_eos=True):
            tokens += out.token_ids
            text += out.text
            assert out.finish_reason in (None, "length")
    return tokens, text


def _pools_free(address: str, timeout: float = 20) -> None:
    deadline = time.monotonic() + timeout
    with PdClusterClient(address, timeout=10) as client:
        while True:
            workers = [w for ws in client.status()["pools"].values() for w in ws]
            if workers and all(w["num_free_blocks"] == w["num_blocks"] and not w["num_running"]
                               for w in workers):
                return
            if time.monotonic() > deadline:
                raise AssertionError(f"pools not free: {workers}")
            time.sleep(0.2)


def test_disaggregated_smollm2_matches_transformers(disaggregated, smollm2):
    assert any(line.startswith("Internal sockets: CURVE") for line in disaggregated.lines)
    for content in SMOL_CHATS:
        tokens, text = _chat_tokens(disaggregated.grpc, content)
        prompt = apply_chat_template(smollm2.tokenizer, [{"role": "user", "content": content}])
        assert tokens == hf_greedy("smollm2", prompt, 32)
        if content == SMOL_CHATS[0]:
            assert text.startswith("The capital of France is Paris.")
    _pools_free(disaggregated.grpc)


def test_health_and_openai_http(disaggregated):
    import openai

    with PdClusterClient(disaggregated.grpc, timeout=10) as client:
        assert client.health() == "SERVING"
    # No retries: a 5xx or a timeout must fail the test, not be tried again.
    http = openai.OpenAI(base_url=disaggregated.http + "/v1", api_key="unused", max_retries=0,
                         timeout=120)
    reply = http.chat.completions.create(
        model="smollm2", messages=[{"role": "user", "content": SMOL_CHATS[0]}], max_tokens=16,
        temperature=0.0)
    assert "Paris" in reply.choices[0].message.content
    chunks = http.chat.completions.create(
        model="smollm2", messages=[{"role": "user", "content": SMOL_CHATS[0]}], max_tokens=16,
        temperature=0.0, stream=True)
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert streamed == reply.choices[0].message.content
    with pytest.raises(openai.BadRequestError, match="temperature"):
        http.completions.create(model="smollm2", prompt="hi", temperature=-1)
    _pools_free(disaggregated.grpc)


def test_structured_output_and_penalties_across_prefill_and_decode(disaggregated, smollm2):
    """The prefill worker samples the first token, the decode worker the rest: grammar and
    penalty state must carry over, so the answer validates and equals the offline engine's
    (one engine, no hand-over): its text over OpenAI HTTP (`response_format`, n=2), its
    tokens over gRPC."""
    import jsonschema
    import openai

    schema = {"type": "object", "additionalProperties": False, "required": ["city", "country"],
              "properties": {"city": {"type": "string", "maxLength": 20},
                             "country": {"type": "string", "maxLength": 20}}}
    messages = [{"role": "user", "content": SMOL_CHATS[0]}]
    offline = smollm2.chat(messages, SamplingParams(
        temperature=0.0, max_tokens=60, frequency_penalty=0.3,
        json_schema=json.dumps(schema)))[0].outputs[0]
    assert offline.finish_reason == "stop"
    jsonschema.validate(json.loads(offline.text), schema)
    http = openai.OpenAI(base_url=disaggregated.http + "/v1", api_key="unused", max_retries=0,
                         timeout=120)
    reply = http.chat.completions.create(
        model="smollm2", messages=messages, max_tokens=60, temperature=0.0,
        frequency_penalty=0.3, n=2,
        response_format={"type": "json_schema", "json_schema": {"name": "a", "schema": schema}})
    assert [c.finish_reason for c in reply.choices] == ["stop", "stop"]
    assert [c.message.content for c in reply.choices] == [offline.text] * 2
    with PdClusterClient(disaggregated.grpc, timeout=120) as client:
        outs = list(client.generate(messages=messages, max_tokens=60, temperature=0.0,
                                    frequency_penalty=0.3, json_schema=json.dumps(schema)))
    assert [t for o in outs for t in o.token_ids] == offline.token_ids
    assert outs[-1].finish_reason == "stop"
    _pools_free(disaggregated.grpc)


def test_forced_tool_call_tokenize_and_version(disaggregated, smollm2):
    """A named tool call is its function's parameters grammar, carried from the prefill
    worker to the decode worker: the arguments equal the offline engine's output under that
    schema on the same prompt, which `/tokenize` gives (tools included)."""
    import jsonschema
    import openai

    weather = {"type": "object", "additionalProperties": False, "required": ["city", "unit"],
               "properties": {"city": {"type": "string", "maxLength": 30},
                              "unit": {"enum": ["celsius", "fahrenheit"]}}}
    tools = [{"type": "function", "function": {
        "name": "get_weather", "description": "The current weather in a city.",
        "parameters": weather}}]
    messages = [{"role": "user", "content": "What is the weather like in Paris today?"}]
    http = openai.OpenAI(base_url=disaggregated.http + "/v1", api_key="unused", max_retries=0,
                         timeout=120)
    reply = http.chat.completions.create(
        model="smollm2", messages=messages, tools=tools, max_tokens=60, temperature=0.0,
        tool_choice={"type": "function", "function": {"name": "get_weather"}})
    assert reply.choices[0].finish_reason == "tool_calls"
    (call,) = reply.choices[0].message.tool_calls
    jsonschema.validate(json.loads(call.function.arguments), weather)
    tokenized = httpx.post(disaggregated.http + "/tokenize", timeout=60, json={
        "model": "smollm2", "messages": messages, "tools": tools}).json()
    assert tokenized["count"] == reply.usage.prompt_tokens
    offline = smollm2.generate(tokenized["tokens"], SamplingParams(
        temperature=0.0, max_tokens=60, json_schema=json.dumps(weather)))[0].outputs[0]
    assert call.function.arguments == offline.text
    detokenized = httpx.post(disaggregated.http + "/detokenize", timeout=60,
                             json={"tokens": tokenized["tokens"]}).json()
    assert detokenized == {"prompt": smollm2.tokenizer.decode(tokenized["tokens"])}
    assert httpx.get(disaggregated.http + "/version", timeout=10).json() == {
        "version": importlib.metadata.version("pdcluster")}
    _pools_free(disaggregated.grpc)


def test_metrics_carry_model_name_and_vllm_names(disaggregated):
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(disaggregated.http + "/metrics", timeout=10).text
    families = {f.name: f for f in text_string_to_metric_families(text)}
    usage = families["vllm:kv_cache_usage_perc"].samples
    with PdClusterClient(disaggregated.grpc, timeout=10) as client:
        workers = {w["worker_id"] for ws in client.status()["pools"].values() for w in ws}
    assert len(workers) == 2 and {s.labels["engine"] for s in usage} == workers
    assert all(s.labels["model_name"] == "smollm2" and 0 <= s.value <= 1 for s in usage)
    assert any(s.labels.get("engine") == "router"
               for s in families["vllm:num_requests_waiting"].samples)
    ttft = families["pdcluster:time_to_first_token_seconds"].samples
    assert ttft and all(s.labels["model_name"] == "smollm2" for s in ttft)
    # The cluster's own series too, once a request's KV went from prefill to decode.
    _chat_tokens(disaggregated.grpc, SMOL_CHATS[1], n=2)
    text = httpx.get(disaggregated.http + "/metrics", timeout=10).text
    families = {f.name: f for f in text_string_to_metric_families(text)}
    transfer = families["pdcluster:kv_transfer_bytes"].samples
    assert transfer and all(s.labels["model_name"] == "smollm2" for s in transfer)


def test_traces_follow_a_request_through_prefill_and_decode(disaggregated, otlp, smollm2):
    """One OpenAI request with the client's `traceparent`: every span of it, from the
    router, the prefill worker and the decode worker processes, is in the client's trace,
    a child of the router's request span, which is a child of the client's span, and keeps
    the client's `tracestate`."""
    import openai

    trace_id, client_span = secrets.token_hex(16), secrets.token_hex(8)
    http = openai.OpenAI(base_url=disaggregated.http + "/v1", api_key="unused", max_retries=0,
                         timeout=120)
    reply = http.chat.completions.create(
        model="smollm2", messages=[{"role": "user", "content": "Name three kinds of tree."}],
        max_tokens=8, temperature=0.0,
        extra_headers={"traceparent": f"00-{trace_id}-{client_span}-01",
                       "tracestate": "congo=t61rcWkgMzE"})
    names = {"request", "admission", "placement", "prefill", "kv_transfer", "decode",
             "response"}
    spans = otlp.trace(trace_id, names)
    assert sorted(s.name for s in spans) == sorted(names)  # each once
    span = {s.name: s for s in spans}
    request = span["request"]
    assert request.parent_span_id == client_span and not request.error
    assert all(span[name].parent_span_id == request.span_id for name in names - {"request"})
    assert {s.trace_state for s in spans} == {"congo=t61rcWkgMzE"}
    assert request.attributes["gen_ai.usage.completion_tokens"] == \
        reply.usage.completion_tokens == 8
    with PdClusterClient(disaggregated.grpc, timeout=10) as client:
        pids = {pool: ws[0]["pid"] for pool, ws in client.status()["pools"].items()}
    where = {name: (s.resource["service.name"], s.resource["process.pid"])
             for name, s in span.items()}
    router = ("pdcluster-router", disaggregated.proc.pid)
    assert where == {"request": router, "admission": router, "placement": router,
                     "response": router, "prefill": ("pdcluster-prefill", pids["prefill"]),
                     "kv_transfer": ("pdcluster-prefill", pids["prefill"]),
                     "decode": ("pdcluster-decode", pids["decode"])}
    # The blocks the decode worker lacked: the chat template's system prompt may be cached.
    cached = reply.usage.prompt_tokens_details.cached_tokens
    blocks = math.ceil(reply.usage.prompt_tokens / 16) - cached // 16
    assert span["prefill"].attributes["pdcluster.cached_tokens"] == cached
    engine = smollm2.engine
    transfer = span["kv_transfer"].attributes
    assert (transfer["pdcluster.kv.transport"], transfer["pdcluster.kv.blocks"],
            transfer["pdcluster.kv.bytes"]) == (
        "shm", blocks, blocks * engine.kv_cache.block_bytes * engine.model_config.num_layers)
    assert span["decode"].attributes["pdcluster.local_prefill"] is False
    assert span["placement"].attributes["pdcluster.remote_prefill"] is True


def test_generate_cli_answers_paris(disaggregated, capsys):
    assert main(["generate", SMOL_CHATS[0], "--address", disaggregated.grpc,
                 "--max-tokens", "16"]) == 0
    assert "Paris" in capsys.readouterr().out


def test_bench_says_where_each_requests_time_went(disaggregated, tmp_path, capsys):
    """Over gRPC the router's clocks come back with each request: every prompt here was
    prefilled on the prefill worker (threshold 0), so each request's remote prefill, its KV
    wait and the rest of its first token are the decode worker's and the router's figures,
    and the parts add up to the client's TTFT and E2E."""
    out = tmp_path / "bench"
    assert main(["bench", "--backend", "grpc", "--address", disaggregated.grpc,
                 "--num-requests", "6", "--rate", "20", "--prompt-len", "20:60",
                 "--output-len", "4:8", "--seed", "3", "--out", str(out)]) == 0
    assert "time in kv transfer: mean / p90 (ms)" in capsys.readouterr().out
    report = json.loads((out / "report.json").read_text())
    for record in report["requests"]:
        server = record["server"]
        client_ttft = record["chunks"][0][0] - record["send"]
        assert server["prefill"] > 0 and server["transfer"] >= 0 and server["queue"] >= 0
        # the prefill and the KV wait lie between the decode worker's reservation (after
        # admission) and the first token reaching the router, which the client sees later
        assert server["queue"] + server["prefill"] + server["transfer"] <= server["ttft"]
        assert server["ttft"] <= client_ttft
        assert server["e2e"] - server["ttft"] >= 0
    parts = report["summary"]["breakdown"]
    assert parts["requests"] == 6
    means = {part: stats["mean"] for part, stats in parts["ms"].items()}
    assert means["prefill"] > 0 and means["first_token_other"] >= 0
    assert sum(means[p] for p in ("queue", "prefill", "kv_transfer", "first_token_other",
                                  "client_first")) == pytest.approx(
        report["summary"]["ttft_ms"]["mean"])
    assert sum(means.values()) == pytest.approx(report["summary"]["e2e_ms"]["mean"])
    _pools_free(disaggregated.grpc)
