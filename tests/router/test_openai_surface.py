"""The OpenAI surface beyond generation on the tiny model, through the official `openai` client
and raw HTTP against a real server: finish reasons (an abort is an error, never a finish
reason), SSE keep-alive comments, `/tokenize`, `/detokenize`, `/version`."""

from __future__ import annotations

import json
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import ExitStack

import httpx
import openai
import pytest

from engine import SamplingParams
from router.client import PdClusterClient
from router.servers import Servers
from tests.router.conftest import engine_stalled

PROMPT = "The quick brown fox"


def _openai(port: int) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused",
                         max_retries=0, timeout=60)


def _sse_lines(port: int, body: dict, headers: dict | None = None) -> list[str]:
    """Every line of a raw SSE response (comments included), blank lines dropped."""
    with httpx.stream("POST", f"http://127.0.0.1:{port}/v1/completions", json=body,
                      headers=headers, timeout=60) as resp:
        assert resp.status_code == 200
        return [line for line in resp.iter_lines() if line]


def _events(lines: list[str]) -> list[dict]:
    assert lines[-1] == "data: [DONE]"
    return [json.loads(line.removeprefix("data: ")) for line in lines[:-1]
            if line.startswith("data: ")]


def _abort(pool: ThreadPoolExecutor, grpc_client: PdClusterClient, servers: Servers,
           wait_until) -> Future:
    """Abort `abort-me` through the gRPC API; returns once the router took the abort (its
    backend part waits for the stalled engine)."""
    aborted = pool.submit(grpc_client.abort, "abort-me")
    wait_until(lambda: servers.router.metrics.registry.get_sample_value(
        "pdcluster:requests_aborted_total", {"model_name": "tiny", "cause": "api"}) == 1)
    return aborted


@pytest.mark.parametrize("stream", [True, False])
def test_an_aborted_request_is_an_error_not_a_finish_reason(make_servers, backend, wait_until,
                                                             stream):
    servers = make_servers()
    body = {"model": "tiny", "prompt": PROMPT, "max_tokens": 50, "stream": stream}
    with ThreadPoolExecutor(2) as pool, \
            PdClusterClient(f"127.0.0.1:{servers.grpc_port}", timeout=30) as grpc_client:
        with engine_stalled(backend):  # so the request is still running when it is aborted
            if stream:
                answer = pool.submit(_sse_lines, servers.http_port, body,
                                     {"X-Request-Id": "abort-me"})
            else:
                answer = pool.submit(httpx.post, f"http://127.0.0.1:{servers.http_port}"
                                     "/v1/completions", json=body,
                                     headers={"X-Request-Id": "abort-me"}, timeout=60)
            wait_until(lambda: servers.router.admission.num_running == 1)
            aborted = _abort(pool, grpc_client, servers, wait_until)
        aborted.result(timeout=60)
        result = answer.result(timeout=60)
    expected = {"message": "request 'abort-me' was aborted after 0 tokens",
                "type": "server_error", "param": None, "code": "request_aborted"}
    if stream:
        events = _events(result)
        assert events[-1] == {"error": expected}
        assert all(c["finish_reason"] in (None, "stop", "length")
                   for e in events for c in e.get("choices", []))
    else:
        assert result.status_code == 503
        assert result.json() == {"error": expected}


def test_the_openai_client_raises_on_an_aborted_stream(make_servers, backend, wait_until):
    # Keep-alives every 50 ms: the headers come at once, and the client skips the comments.
    servers = make_servers(sse_keepalive_s=0.05)
    api = _openai(servers.http_port)
    with ThreadPoolExecutor(1) as pool, \
            PdClusterClient(f"127.0.0.1:{servers.grpc_port}", timeout=30) as grpc_client:
        with engine_stalled(backend):
            chunks = api.chat.completions.create(
                model="tiny", messages=[{"role": "user", "content": PROMPT}], max_tokens=50,
                stream=True, extra_headers={"X-Request-Id": "abort-me"})
            wait_until(lambda: servers.router.admission.num_running == 1)
            aborted = _abort(pool, grpc_client, servers, wait_until)
        aborted.result(timeout=60)
        with pytest.raises(openai.APIError, match="was aborted"):
            for _ in chunks:
                pass


def test_keep_alive_comments_while_the_first_token_waits(make_servers, backend, offline):
    servers = make_servers(sse_keepalive_s=0.05)
    body = {"model": "tiny", "prompt": PROMPT, "max_tokens": 8, "temperature": 0.0,
            "ignore_eos": True, "stream": True}
    ref = offline.generate(PROMPT, SamplingParams(max_tokens=8, temperature=0,
                                                  ignore_eos=True))[0].outputs[0]
    lines = []
    with ExitStack() as stall:
        stall.enter_context(engine_stalled(backend))  # no token can come until released
        with httpx.stream("POST", f"http://127.0.0.1:{servers.http_port}/v1/completions",
                          json=body, timeout=60) as resp:
            assert resp.status_code == 200  # the headers came without a token
            for line in resp.iter_lines():
                if line == ": keep-alive" and not lines:
                    stall.close()  # the engine goes on once the stream was kept alive
                if line:
                    lines.append(line)
    assert lines[0] == ": keep-alive"
    events = _events(lines)
    assert "".join(e["choices"][0]["text"] for e in events) == ref.text
    assert events[-1]["choices"][0]["finish_reason"] == "length"
