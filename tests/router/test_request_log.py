"""One log line per finished request (no prompt or output text unless `--log-prompts`), with
the client's trace id when it sent a `traceparent`, and the text/JSON formats."""

from __future__ import annotations

import io
import json
import logging

import httpx
import pytest

from protocol.logs import JsonFormatter, TextFormatter, configure_logging
from router.logs import REQUEST_LOGGER, log_request

PROMPT = "a secret prompt about zebras"


def test_one_line_per_finished_request(servers, offline, caplog):
    caplog.set_level(logging.INFO, logger=REQUEST_LOGGER)
    resp = httpx.post(f"http://127.0.0.1:{servers.http_port}/v1/completions", json={
        "model": "tiny", "prompt": PROMPT, "max_tokens": 5, "ignore_eos": True},
        headers={"X-Request-Id": "log-me"}, timeout=30)
    assert resp.status_code == 200
    text = resp.json()["choices"][0]["text"]
    (record,) = [r for r in caplog.records if r.name == REQUEST_LOGGER
                 and r.request["request_id"] == "log-me"]
    fields = record.request
    assert {k: fields[k] for k in ("model", "status", "prompt_tokens", "output_tokens",
                                   "cached_tokens", "workers")} == {
        "model": "tiny", "status": "length", "prompt_tokens": len(offline.tokenizer.encode(
            PROMPT)), "output_tokens": 5, "cached_tokens": 0, "workers": ["engine-0"]}
    assert 0 < fields["ttft_s"] <= fields["e2e_s"] and fields["tpot_s"] >= 0
    assert "trace_id" not in fields  # no traceparent came with it
    readable = TextFormatter().format(record)
    assert " INFO pdcluster.requests: finished request_id=log-me model=tiny status=length " \
        in readable
    line = JsonFormatter().format(record)
    assert json.loads(line)["request_id"] == "log-me" and json.loads(line)["output_tokens"] == 5
    for written in (readable, line):
        assert PROMPT not in written and (not text.strip() or text not in written)


def test_log_prompts_adds_the_prompt_and_the_output(make_servers, offline, caplog):
    caplog.set_level(logging.INFO, logger=REQUEST_LOGGER)
    servers = make_servers(log_prompts=True)
    resp = httpx.post(f"http://127.0.0.1:{servers.http_port}/v1/completions", json={
        "model": "tiny", "prompt": PROMPT, "max_tokens": 6, "ignore_eos": True},
        headers={"X-Request-Id": "log-prompt"}, timeout=30)
    assert resp.status_code == 200
    (record,) = [r for r in caplog.records if r.name == REQUEST_LOGGER
                 and r.request["request_id"] == "log-prompt"]
    assert record.request["prompt"] == PROMPT
    assert record.request["output"] == resp.json()["choices"][0]["text"] != ""
    assert f"prompt={PROMPT} " in TextFormatter().format(record)


def test_the_line_carries_the_clients_trace_id(servers, caplog):
    caplog.set_level(logging.INFO, logger=REQUEST_LOGGER)
    trace = "0af7651916cd43dd8448eb211c80319c"
    resp = httpx.post(f"http://127.0.0.1:{servers.http_port}/v1/completions", json={
        "model": "tiny", "prompt": PROMPT, "max_tokens": 2},
        headers={"X-Request-Id": "traced-line", "traceparent": f"00-{trace}-b7ad6b7169203331-01"},
        timeout=30)
    assert resp.status_code == 200
    (record,) = [r for r in caplog.records if r.name == REQUEST_LOGGER
                 and r.request["request_id"] == "traced-line"]
    assert json.loads(JsonFormatter().format(record))["trace_id"] == trace
    assert f"request_id=traced-line trace_id={trace} model=tiny" in \
        TextFormatter().format(record)


def test_configure_json_and_text(root_logging):
    out = io.StringIO()
    configure_logging("debug", "json", out)
    log_request({"request_id": "r1", "status": "stop", "workers": ["p-0", "d-1"]})
    logging.getLogger("some.module").debug("hello %s", "there")
    first, second = (json.loads(line) for line in out.getvalue().splitlines())
    assert first["logger"] == REQUEST_LOGGER and first["level"] == "INFO"
    assert first["request_id"] == "r1" and first["workers"] == ["p-0", "d-1"]
    assert second["message"] == "hello there" and second["level"] == "DEBUG"
    out = io.StringIO()
    configure_logging("WARNING", "text", out)
    log_request({"request_id": "r2", "status": "stop"})  # INFO: below the level
    logging.getLogger("x").warning("careful")
    assert out.getvalue().endswith(" WARNING x: careful\n") and "r2" not in out.getvalue()


@pytest.mark.parametrize(("level", "fmt", "message"), [
    ("loud", "text", "log level: 'loud' is not one of DEBUG, INFO"),
    ("info", "yaml", "log format: 'yaml' is not one of text, json"),
])
def test_bad_logging_settings(root_logging, level, fmt, message):
    with pytest.raises(ValueError, match=message):
        configure_logging(level, fmt)
