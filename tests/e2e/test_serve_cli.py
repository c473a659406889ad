"""The real CLI: `pdcluster serve` on SmolLM2, real gRPC and OpenAI clients, exact tokens."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from collections.abc import Iterator

import pytest

from router.client import PdClusterClient
from tests.conftest import hf_greedy

pytestmark = pytest.mark.slow

CHATS = [
    "What is the capital of France?",
    "Write a haiku about autumn leaves falling in a quiet park.",
    "Give me three tips for writing clear Python code.",
]


class Served:
    def __init__(self, proc: subprocess.Popen, grpc: str, http: str, lines: list[str]) -> None:
        self.proc, self.grpc, self.http, self.lines = proc, grpc, http, lines


def _serve(*flags: str) -> Iterator[Served]:
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "cluster.cli", "serve", "--model", "smollm2", "--grpc-port", "0",
         "--http-port", "0", "--kv-cache-gb", "0.25", *flags],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    lines = []
    deadline = time.monotonic() + 240
    for line in proc.stdout:
        lines.append(line)
        match = re.search(r"gRPC (\S+)\s+OpenAI (\S+)/v1", line)
        if match:
            break
        if time.monotonic() > deadline:
            break
    if match is None:
        proc.kill()
        raise AssertionError("serve did not become ready:\n" + "".join(lines[-30:]))
    try:
        yield Served(proc, match.group(1), match.group(2), lines)
    finally:
        proc.send_signal(2)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()


@pytest.fixture(scope="module")
def disaggregated():
    # CURVE on the internal sockets (on loopback `auto` would leave them plain, as colocated).
    yield from _serve("--prefill", "1", "--decode", "1", "--local-prefill-threshold", "0",
                      "--metrics-compat", "vllm", "--internal-auth", "curve")


@pytest.fixture(scope="module")
def colocated():
    yield from _serve("--mode", "colocated", "--decode", "1")


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


def test_disaggregated_smollm2_matches_transformers_and_colocated(disaggregated, colocated):
    from engine import apply_chat_template, load_tokenizer
    from engine.model_loader import resolve_model_dir

    assert any(line.startswith("Internal sockets: CURVE") for line in disaggregated.lines)
    assert any(line.startswith("Internal sockets: plain TCP") for line in colocated.lines)
    tokenizer = load_tokenizer(resolve_model_dir("smollm2"))
    for content in CHATS:
        tokens, text = _chat_tokens(disaggregated.grpc, content)
        prompt = apply_chat_template(tokenizer, [{"role": "user", "content": content}])
        assert tokens == hf_greedy("smollm2", prompt, 32)
        assert tokens == _chat_tokens(colocated.grpc, content)[0]
        if content == CHATS[0]:
            assert text.startswith("The capital of France is Paris.")
    _pools_free(disaggregated.grpc)
    _pools_free(colocated.grpc)


def test_health_and_openai_http(disaggregated):
    import openai

    with PdClusterClient(disaggregated.grpc, timeout=10) as client:
        assert client.health() == "SERVING"
    http = openai.OpenAI(base_url=disaggregated.http + "/v1", api_key="unused")
    reply = http.chat.completions.create(
        model="smollm2", messages=[{"role": "user", "content": CHATS[0]}], max_tokens=16,
        temperature=0.0)
    assert "Paris" in reply.choices[0].message.content
    chunks = http.chat.completions.create(
        model="smollm2", messages=[{"role": "user", "content": CHATS[0]}], max_tokens=16,
        temperature=0.0, stream=True)
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert streamed == reply.choices[0].message.content
    with pytest.raises(openai.BadRequestError, match="temperature"):
        http.completions.create(model="smollm2", prompt="hi", temperature=-1)
    _pools_free(disaggregated.grpc)


def test_structured_output_and_penalties_across_prefill_and_decode(disaggregated, colocated):
    """The prefill worker samples the first token, the decode worker the rest: grammar and
    penalty state must carry over, so the answer validates and equals the colocated one."""
    import json

    import jsonschema
    import openai

    schema = {"type": "object", "additionalProperties": False, "required": ["city", "country"],
              "properties": {"city": {"type": "string", "maxLength": 20},
                             "country": {"type": "string", "maxLength": 20}}}
    answers = []
    for served in (disaggregated, colocated):
        http = openai.OpenAI(base_url=served.http + "/v1", api_key="unused")
        reply = http.chat.completions.create(
            model="smollm2", messages=[{"role": "user", "content": CHATS[0]}], max_tokens=60,
            temperature=0.0, frequency_penalty=0.3, n=2,
            response_format={"type": "json_schema", "json_schema": {"name": "a",
                                                                    "schema": schema}})
        assert [c.finish_reason for c in reply.choices] == ["stop", "stop"]
        answers.append([c.message.content for c in reply.choices])
    assert answers[0] == answers[1]
    jsonschema.validate(json.loads(answers[0][0]), schema)
    _pools_free(disaggregated.grpc)


def test_metrics_carry_model_name_and_vllm_names(disaggregated):
    import httpx
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


def test_generate_cli_answers_paris(disaggregated):
    out = subprocess.run([sys.executable, "-m", "cluster.cli", "generate",
                          "What is the capital of France?", "--address", disaggregated.grpc],
                         capture_output=True, text=True, timeout=120, check=True)
    assert "Paris" in out.stdout
