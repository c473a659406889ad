"""The real CLI on the tiny model: keys, `status --json`, `scale`, a decode worker killed under
a live gRPC stream and an HTTP request, and SIGTERM draining."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import grpc
import httpx
import pytest

from router.client import PdClusterClient
from tests.e2e.test_serve_cli import _serve

API_KEY, ADMIN_KEY = "sk-user-e2e", "sk-admin-e2e"
GREEDY = {"temperature": 0.0, "ignore_eos": True}
PROMPT_IDS = list(range(300, 400))  # long enough for the prefill worker


@pytest.fixture(scope="module")
def served():
    yield from _serve("--model", "tiny", "--prefill", "1", "--decode", "2",
                      "--local-prefill-threshold", "8", "--api-key", API_KEY,
                      "--admin-key", ADMIN_KEY, "--drain-timeout", "60")


def _cli(*args: str, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "cluster.cli", *args], capture_output=True,
                          text=True, timeout=300, env={**os.environ, **env})


def _status(served) -> dict:
    out = _cli("status", "--json", "--address", served.grpc, PDCLUSTER_API_KEY=API_KEY)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


def test_status_json_names_every_worker(served):
    denied = _cli("status", "--json", "--address", served.grpc)
    assert denied.returncode == 1 and "UNAUTHENTICATED" in denied.stderr
    workers = [w for pool in _status(served)["pools"].values() for w in pool]
    assert sorted(w["role"] for w in workers) == ["decode", "decode", "prefill"]
    for w in workers:
        assert w["worker_id"] and w["state"] == "ready" and w["node"]
        assert isinstance(w["pid"], int) and w["pid"] > 0


def test_scale_needs_the_admin_key(served):
    user = _cli("scale", "--decode", "3", "--address", served.grpc, PDCLUSTER_API_KEY=API_KEY)
    assert user.returncode == 1 and "PERMISSION_DENIED" in user.stderr
    admin = _cli("scale", "--prefill", "1", "--address", served.grpc, "--admin-key", ADMIN_KEY)
    assert admin.returncode == 0, admin.stderr


def test_decode_worker_killed_under_live_grpc_and_http_requests(served):
    params = {"max_tokens": 300, **GREEDY}
    with PdClusterClient(served.grpc, timeout=300, api_key=API_KEY) as client:
        expected = [t for o in client.generate(prompt_token_ids=PROMPT_IDS, **params)
                    for t in o.token_ids]
        stream = client.generate(prompt_token_ids=PROMPT_IDS, **params)
        tokens = []
        while len(tokens) < 5:
            tokens += next(stream).token_ids
        with ThreadPoolExecutor(1) as pool:
            http = pool.submit(httpx.post, served.http + "/v1/completions", timeout=300,
                               headers={"authorization": f"Bearer {API_KEY}"},
                               json={"prompt": PROMPT_IDS, "max_tokens": 300,
                                     "temperature": 0.0, "ignore_eos": True})
            busy = [w for w in _status(served)["pools"]["decode"] if w["in_flight"]]
            for w in busy:  # every decode worker holding a request
                os.kill(w["pid"], signal.SIGKILL)
            outs = list(stream)
            tokens += [t for o in outs for t in o.token_ids]
            reply = http.result(timeout=300)
    assert outs[-1].finish_reason == "length" and tokens == expected
    assert reply.status_code == 200, reply.text
    assert reply.json()["usage"]["completion_tokens"] == 300
    metrics = httpx.get(served.http + "/metrics").text
    assert "pdcluster:migrations_total" in metrics


def test_sigterm_drains(served):
    with PdClusterClient(served.grpc, timeout=300, api_key=API_KEY) as client:
        stream = client.generate(prompt_token_ids=PROMPT_IDS, max_tokens=200, **GREEDY)
        first = next(stream)
        served.proc.send_signal(signal.SIGTERM)
        with pytest.raises(grpc.RpcError) as e:
            while True:  # until the drain has begun: then new requests are refused
                list(client.generate(prompt_token_ids=PROMPT_IDS, max_tokens=1, **GREEDY))
        assert e.value.code() == grpc.StatusCode.UNAVAILABLE and "draining" in e.value.details()
        rest = list(stream)
    assert rest[-1].finish_reason == "length"
    assert len(first.token_ids) + sum(len(o.token_ids) for o in rest) == 200
    assert served.proc.wait(120) == 0
