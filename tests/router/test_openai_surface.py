"""The OpenAI surface beyond generation on the tiny model, through the official `openai` client
and raw HTTP against a real server: finish reasons (an abort is an error, never a finish
reason), SSE keep-alive comments, `/tokenize`, `/detokenize`, `/version`."""

from __future__ import annotations

import json
import tomllib
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import ExitStack
from pathlib import Path

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
           backend, wait_until) -> Future:
    """Abort `abort-me` through the gRPC API once its add waits in the stalled engine's
    queue (so the abort runs after it, before any step); returns once the router took the
    abort and its backend part waits in the stalled engine's queue behind the add (the
    router counts the abort before its thread queues it there)."""
    wait_until(lambda: backend.loop.num_pending == 1)
    aborted = pool.submit(grpc_client.abort, "abort-me")
    wait_until(lambda: servers.router.metrics.registry.get_sample_value(
        "pdcluster:requests_aborted_total", {"model_name": "tiny", "cause": "api"}) == 1)
    wait_until(lambda: backend.loop.num_pending == 2)
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
            aborted = _abort(pool, grpc_client, servers, backend, wait_until)
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
        assert result.headers["x-should-retry"] == "false"


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
            aborted = _abort(pool, grpc_client, servers, backend, wait_until)
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


# ---- /tokenize, /detokenize, /version --------------------------------------------------------

MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": PROMPT}]


def _post(servers, path: str, body: dict) -> httpx.Response:
    return httpx.post(f"http://127.0.0.1:{servers.http_port}{path}", json=body, timeout=30)


def test_tokenize_a_prompt_then_detokenize(servers, offline):
    # (These tokenizers add no special token to a prompt, so `add_special_tokens` changes
    # nothing here.)
    text = "Hello, wörld! 123"
    resp = _post(servers, "/tokenize", {"model": "tiny", "prompt": text}).json()
    expected = offline.tokenizer.encode(text)
    assert resp == {"count": len(expected), "tokens": expected, "token_strs": None,
                    "max_model_len": offline.engine.model_config.max_model_len}
    assert _post(servers, "/detokenize", {"model": "tiny", "tokens": expected}).json() == {
        "prompt": text}


def test_tokenize_messages_counts_what_the_chat_endpoint_runs(servers, offline):
    resp = _post(servers, "/tokenize", {"messages": MESSAGES, "return_token_strs": True}).json()
    expected = offline.tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True,
                                                     tokenize=True, return_dict=False)
    assert resp["tokens"] == list(expected) and resp["count"] == len(expected)
    assert resp["token_strs"] == offline.tokenizer.convert_ids_to_tokens(list(expected))
    chat = _openai(servers.http_port).chat.completions.create(
        model="tiny", messages=MESSAGES, max_tokens=1)
    assert chat.usage.prompt_tokens == resp["count"]
    without = _post(servers, "/tokenize", {"messages": MESSAGES,
                                           "add_generation_prompt": False}).json()
    generation = offline.tokenizer.encode("<|im_start|>assistant\n", add_special_tokens=False)
    assert without["tokens"] + generation == resp["tokens"]


@pytest.mark.parametrize(("path", "body", "message"), [
    ("/tokenize", {}, "prompt: give exactly one of prompt or messages"),
    ("/tokenize", {"prompt": "a", "messages": MESSAGES},
     "prompt: give exactly one of prompt or messages"),
    ("/tokenize", {"prompt": 5}, "prompt: Input should be a valid string"),
    ("/tokenize", {"messages": MESSAGES, "add_generation_prompt": True,
                   "continue_final_message": True},
     "continue_final_message: cannot be set together with add_generation_prompt"),
    ("/tokenize", {"messages": [{"role": "robot", "content": "hi"}]}, "messages.0.role: "),
    ("/detokenize", {"tokens": [1, -3]}, "tokens: -3 is not a token id"),
    ("/detokenize", {"tokens": [10**9]}, "tokens: 1000000000 is not a token id"),
    ("/detokenize", {"tokens": "1 2"}, "tokens: Input should be a valid list"),
    ("/detokenize", {"prompt": "x", "tokens": [1]}, "prompt: not supported by this server"),
])
def test_bad_tokenize_requests_are_400(servers, path, body, message):
    resp = _post(servers, path, body)
    assert resp.status_code == 400
    assert resp.json()["error"]["message"].startswith(message)
    assert resp.json()["error"]["type"] == "invalid_request_error"


def test_tokenize_an_unknown_model_is_404(servers):
    resp = _post(servers, "/tokenize", {"model": "gpt-4", "prompt": "a"})
    assert resp.status_code == 404 and resp.json()["error"]["code"] == "model_not_found"


def test_version(servers):
    resp = httpx.get(f"http://127.0.0.1:{servers.http_port}/version")
    assert resp.status_code == 200
    # The version pyproject.toml declares (the installed metadata is what the server reads).
    declared = tomllib.loads((Path(__file__).parents[2] / "pyproject.toml").read_text())
    assert resp.json() == {"version": declared["project"]["version"]}
