"""The OpenAI HTTP front door, through the `openai` client, against a real tiny engine."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from engine import SamplingParams

PROMPT = "The quick brown fox"
GREEDY = {"temperature": 0.0, "extra_body": {"ignore_eos": True}}
MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": PROMPT}]


def _openai(port: int) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused",
                         max_retries=0, timeout=30)


@pytest.fixture
def api(servers) -> openai.OpenAI:
    return _openai(servers.http_port)


def _reference(offline, **params):
    return offline.generate(PROMPT, SamplingParams(ignore_eos=True, temperature=0,
                                                   **params))[0].outputs[0]


def test_completion(api, offline):
    ref = _reference(offline, max_tokens=12, logprobs=2)
    resp = api.completions.create(model="tiny", prompt=PROMPT, max_tokens=12, logprobs=2,
                                  **GREEDY)
    choice = resp.choices[0]
    assert choice.text == ref.text and choice.finish_reason == "length"
    assert resp.usage.completion_tokens == 12
    assert resp.usage.prompt_tokens == len(offline.tokenizer.encode(PROMPT))
    assert resp.usage.total_tokens == resp.usage.prompt_tokens + 12
    assert choice.logprobs.token_logprobs == pytest.approx(
        [lp[t] for t, lp in zip(ref.token_ids, ref.logprobs, strict=True)], abs=1e-5)
    assert all(len(top) == 2 for top in choice.logprobs.top_logprobs)


def test_completion_streaming(api, offline):
    ref = _reference(offline, max_tokens=12)
    chunks = list(api.completions.create(model="tiny", prompt=offline.tokenizer.encode(PROMPT),
                                         max_tokens=12, stream=True,
                                         stream_options={"include_usage": True}, **GREEDY))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == ref.text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 12


def test_chat(api, offline):
    ref = offline.chat(MESSAGES, SamplingParams(max_tokens=10, temperature=0, ignore_eos=True,
                                                logprobs=1))[0].outputs[0]
    resp = api.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=10,
                                       logprobs=True, top_logprobs=1, **GREEDY)
    choice = resp.choices[0]
    assert choice.message.role == "assistant" and choice.message.content == ref.text
    assert choice.finish_reason == "length" and resp.usage.completion_tokens == 10
    assert [lp.logprob for lp in choice.logprobs.content] == pytest.approx(
        [lp[t] for t, lp in zip(ref.token_ids, ref.logprobs, strict=True)], abs=1e-5)
    assert "".join(lp.token for lp in choice.logprobs.content) == ref.text

    chunks = list(api.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=10,
                                              stream=True, **GREEDY))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == ref.text
    assert chunks[-1].choices[0].finish_reason == "length"


def test_stop_string(api, offline):
    full = _reference(offline, max_tokens=24).text
    stop = full.split()[3]
    resp = api.completions.create(model="tiny", prompt=PROMPT, max_tokens=24, stop=[stop],
                                  **GREEDY)
    assert resp.choices[0].text == full[:full.index(stop)]
    assert resp.choices[0].finish_reason == "stop"


@pytest.mark.parametrize(("body", "param", "status"), [
    ({"prompt": ""}, "prompt", 400),
    ({"prompt": [5] * 1024}, "prompt_token_ids", 400),
    ({"prompt": PROMPT, "temperature": -1}, "temperature", 400),
    ({"prompt": PROMPT, "top_p": 0}, "top_p", 400),
    ({"prompt": PROMPT, "n": 0}, "n", 400),
    ({"prompt": PROMPT, "n": 129}, "n", 400),
    ({"prompt": [PROMPT] * 3, "n": 50}, "n", 400),
    ({"prompt": [], "max_tokens": 2}, "prompt", 400),
    ({"prompt": PROMPT, "echo": True, "logprobs": 1}, "echo", 400),
    ({"prompt": PROMPT, "logit_bias": {"49152": 1}}, "logit_bias", 400),
    ({"prompt": PROMPT, "presence_penalty": 3}, "presence_penalty", 400),
    ({"prompt": PROMPT, "response_format": {"type": "json_schema"}}, "response_format", 400),
    ({"prompt": PROMPT, "response_format": {"type": "yaml"}}, "response_format", 400),
    ({"prompt": PROMPT, "max_tokens": "many"}, "max_tokens", 400),
    ({}, "prompt", 400),
    ({"prompt": PROMPT, "model": "gpt-17"}, "model", 404),
])
def test_bad_completion_request(servers, body, param, status):
    resp = httpx.post(f"http://127.0.0.1:{servers.http_port}/v1/completions", json=body)
    assert resp.status_code == status
    error = resp.json()["error"]
    assert error["param"] == param and error["message"].startswith(param)
    assert error["type"] == "invalid_request_error"
    if status == 404:
        assert error["code"] == "model_not_found"


def test_bad_chat_request_through_openai(api):
    with pytest.raises(openai.BadRequestError) as e:
        api.chat.completions.create(model="tiny", messages=MESSAGES, temperature=-1)
    assert e.value.status_code == 400 and e.value.param == "temperature"
    with pytest.raises(openai.NotFoundError) as e:
        api.chat.completions.create(model="gpt-17", messages=MESSAGES)
    assert e.value.code == "model_not_found"


def test_malformed_json_body(servers):
    resp = httpx.post(f"http://127.0.0.1:{servers.http_port}/v1/chat/completions",
                      content=b'{"messages": [', headers={"content-type": "application/json"})
    assert resp.status_code == 400
    error = resp.json()["error"]
    assert error["message"].startswith("body: malformed JSON")
    assert error["type"] == "invalid_request_error"


def test_queue_full_is_429(make_servers, wait_until):
    # No queue timeout: only an immediate refusal can end the third request.
    servers = make_servers(max_running=1, max_queue=1, queue_timeout_s=None)
    api = _openai(servers.http_port)
    long = {"model": "tiny", "prompt": PROMPT, "max_tokens": 1000, **GREEDY}
    running = api.completions.create(stream=True, **long)
    next(iter(running))
    with ThreadPoolExecutor(1) as pool:
        queued = pool.submit(api.completions.create, model="tiny", prompt=PROMPT, max_tokens=4)
        wait_until(lambda: servers.router.admission.num_waiting == 1)
        with pytest.raises(openai.RateLimitError) as e:
            api.completions.create(**long)
        assert e.value.code == "queue_full"
        assert e.value.response.headers["retry-after"] == "1"
        running.close()  # the client goes away: its request is aborted, the queued one runs
        assert queued.result(timeout=30).choices[0].finish_reason in ("length", "stop")
    registry = servers.router.metrics.registry
    assert registry.get_sample_value("pdcluster:requests_finished_total",
                                     {"model_name": "tiny", "finish_reason": "abort"}) == 1
    assert registry.get_sample_value("pdcluster:generation_tokens_total",
                                     {"model_name": "tiny"}) < 1000


def test_the_sdk_waits_the_retry_after_of_a_full_queue_then_is_served(make_servers,
                                                                      wait_until):
    """The OpenAI SDK retries a 429 after its `retry-after` (1 s); without one it would
    retry after at most 0.5 s. A retry once the slot is free is served."""
    servers = make_servers(max_running=1, max_queue=0, queue_timeout_s=None)
    sent: list[tuple[str, float]] = []

    def on_request(request: httpx.Request) -> None:
        sent.append(("request", time.monotonic()))

    def on_response(response: httpx.Response) -> None:
        sent.append((str(response.status_code), time.monotonic()))

    http = httpx.Client(event_hooks={"request": [on_request], "response": [on_response]})
    patient = openai.OpenAI(base_url=f"http://127.0.0.1:{servers.http_port}/v1",
                            api_key="unused", max_retries=5, timeout=30, http_client=http)
    running = _openai(servers.http_port).completions.create(
        stream=True, model="tiny", prompt=PROMPT, max_tokens=1000, **GREEDY)
    next(iter(running))
    with ThreadPoolExecutor(1) as pool:
        retried = pool.submit(patient.completions.create, model="tiny", prompt=PROMPT,
                              max_tokens=4)
        wait_until(lambda: any(what == "429" for what, _ in sent))
        running.close()  # the slot frees while the SDK waits
        assert retried.result(timeout=30).choices[0].finish_reason in ("length", "stop")
    events = [what for what, _ in sent]
    assert events[-2:] == ["request", "200"]
    assert events[:-2] == ["request", "429"] * (len(events) // 2 - 1) and len(events) >= 4
    waits = [sent[i + 1][1] - sent[i][1] for i, what in enumerate(events) if what == "429"]
    assert min(waits) >= 0.95, waits


def test_models_health_metrics(api, servers):
    assert [m.id for m in api.models.list().data] == ["tiny"]
    base = f"http://127.0.0.1:{servers.http_port}"
    assert httpx.get(f"{base}/health").status_code == 200

    def ttft_count() -> float:
        families = text_string_to_metric_families(httpx.get(f"{base}/metrics").text)
        ttft = next(f for f in families if f.name == "pdcluster:time_to_first_token_seconds")
        return next(s.value for s in ttft.samples if s.name.endswith("_count"))

    before = ttft_count()
    api.completions.create(model="tiny", prompt=PROMPT, max_tokens=2)
    assert ttft_count() == before + 1
