"""The real CLI on the tiny model behind mutual TLS and keys: the refusal to bind every
interface without a key, `status --json`, `scale` resizing the decode pool, `n` with `seed`
across the prefill and decode workers, a decode worker killed under a live gRPC stream and
an HTTP stream, and SIGTERM draining a request that is still running. Each test leaves the
server as it found it (1 prefill + 2 ready decode workers), or stopped: then the next test
gets a new one."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading

import grpc
import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from commands.cli import main
from engine import LLM, CacheConfig, SamplingParams
from router.client import PdClusterClient
from tests.e2e.serving import Served, ServerSlot, wait_for
from tests.pki import make_pki, trusting

pytestmark = pytest.mark.e2e

API_KEY, ADMIN_KEY = "sk-user-e2e", "sk-admin-e2e"
GREEDY = {"temperature": 0.0, "ignore_eos": True}
PROMPT_IDS = list(range(300, 400))  # long enough for the prefill worker


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    return make_pki(tmp_path_factory.mktemp("pki"))


@pytest.fixture(scope="module")
def slot(pki: dict[str, str]):
    # Spelled as `vllm serve` takes it where vLLM has the flag (docs/api.md's table).
    slot = ServerSlot("tiny", "--prefill", "1", "--decode", "2",
                      "--local_prefill_threshold", "8", "--api-key", API_KEY,
                      "--admin-key", ADMIN_KEY, "--drain-timeout", "60",
                      "--ssl-certfile", pki["server.pem"], "--ssl-keyfile", pki["server.key"],
                      "--ssl-ca-certs", pki["ca.pem"])
    yield slot
    slot.close()


@pytest.fixture
def served(slot: ServerSlot) -> Served:
    """The module's server, started again if a test stopped it."""
    return slot.live()


def _tls_flags(pki: dict[str, str]) -> list[str]:
    return ["--tls", "--tls-ca", pki["ca.pem"], "--tls-cert", pki["client.pem"],
            "--tls-key", pki["client.key"]]


def _client(served: Served, pki: dict[str, str]) -> PdClusterClient:
    return PdClusterClient(served.grpc, timeout=300, api_key=API_KEY, tls_ca=pki["ca.pem"],
                           tls_cert=pki["client.pem"], tls_key=pki["client.key"])


def _http(pki: dict[str, str]) -> httpx.Client:
    return httpx.Client(verify=trusting(pki, client_cert=True), timeout=300,
                        headers={"authorization": f"Bearer {API_KEY}"})


def _cli(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    """`pdcluster ARGV` in this process: the parser, the client, the exit codes and the
    output (the entry point as a real process: the refusal test below)."""
    code = main(list(argv))
    out = capsys.readouterr()
    return code, out.out, out.err


def _decode_pool(served: Served, pki: dict[str, str]) -> list[dict]:
    with _client(served, pki) as client:
        return client.status()["pools"].get("decode", [])


def _two_ready_decode_workers(served: Served, pki: dict[str, str]) -> bool:
    return [w["state"] for w in _decode_pool(served, pki)] == ["ready", "ready"]


def _migrations(served: Served, pki: dict[str, str]) -> float:
    with _http(pki) as http:
        text = http.get(served.http + "/metrics").text
    (family,) = [f for f in text_string_to_metric_families(text)
                 if f.name == "pdcluster:migrations"]
    return sum(s.value for s in family.samples if s.name.endswith("_total"))


def test_binding_every_interface_without_a_key_is_refused() -> None:
    """The real process exits 2 with the reason before Ray or a port is touched (the other
    refusals and every flag's destination: tests/unit/test_cli_serve_flags.py)."""
    done = subprocess.run([sys.executable, "-m", "commands.cli", "serve", "--model", "tiny",
                           "--host", "0.0.0.0"], capture_output=True, text=True, timeout=120,
                          env={k: v for k, v in os.environ.items()
                               if k not in ("PDCLUSTER_API_KEY", "PDCLUSTER_ADMIN_KEY")})
    assert done.returncode == 2
    assert "binding '0.0.0.0' without --api-key" in done.stderr
    assert "--allow-unauthenticated" in done.stderr


def test_status_json_names_every_worker(served, pki, capsys, monkeypatch) -> None:
    monkeypatch.setenv("PDCLUSTER_API_KEY", API_KEY)  # the key from the environment
    code, out, err = _cli(capsys, "status", "--json", "--address", served.grpc,
                          *_tls_flags(pki))
    assert code == 0, err
    workers = [w for pool in json.loads(out)["pools"].values() for w in pool]
    assert sorted(w["role"] for w in workers) == ["decode", "decode", "prefill"]
    for w in workers:
        assert w["worker_id"] and w["state"] == "ready" and w["node"]
        assert isinstance(w["pid"], int) and w["pid"] > 0
    monkeypatch.delenv("PDCLUSTER_API_KEY")
    code, _, err = _cli(capsys, "status", "--json", "--address", served.grpc,
                        *_tls_flags(pki))
    assert code == 1 and "UNAUTHENTICATED" in err  # no key
    with PdClusterClient(served.grpc, timeout=30, api_key=API_KEY, tls_ca=pki["ca.pem"],
                         retries=False) as no_certificate:
        with pytest.raises(grpc.RpcError) as e:
            no_certificate.status()
        assert e.value.code() == grpc.StatusCode.UNAVAILABLE  # mutual TLS: no handshake
    with pytest.raises(httpx.TransportError):
        httpx.get(served.http + "/health", verify=trusting(pki))
    with _http(pki) as http:
        assert http.get(served.http + "/health").status_code == 200
    assert served.http.startswith("https://")


def test_scale_resizes_the_decode_pool(served, pki, capsys) -> None:
    before = {w["worker_id"]: w["pid"] for w in _decode_pool(served, pki)}
    code, _, err = _cli(capsys, "scale", "--decode", "3", "--address", served.grpc,
                        "--api-key", API_KEY, *_tls_flags(pki))
    assert code == 1 and "PERMISSION_DENIED" in err
    assert len(_decode_pool(served, pki)) == 2

    code, out, err = _cli(capsys, "scale", "--decode", "3", "--address", served.grpc,
                          "--admin-key", ADMIN_KEY, *_tls_flags(pki))
    assert code == 0, err
    assert "'decode': 3" in out and "'prefill': 1" in out
    grown = _decode_pool(served, pki)
    assert [w["state"] for w in grown] == ["ready"] * 3  # returns once the new one is ready
    (added,) = [w for w in grown if w["worker_id"] not in before]
    assert added["pid"] not in before.values()

    code, _, err = _cli(capsys, "scale", "--decode", "2", "--address", served.grpc,
                        "--admin-key", ADMIN_KEY, *_tls_flags(pki))
    assert code == 0, err
    # The removed worker drains (idle: at once) and stops in the background.
    wait_for(lambda: _two_ready_decode_workers(served, pki), "the decode pool back at 2",
             poll_s=0.2)


def _choices(served: Served, pki: dict[str, str], prompt: list[int], n: int,
             seed: int) -> list[str]:
    body = {"prompt": prompt, "max_tokens": 12, "temperature": 1.0, "ignore_eos": True,
            "n": n, "seed": seed}
    with _http(pki) as http:
        reply = http.post(served.http + "/v1/completions", json=body)
    assert reply.status_code == 200, reply.text
    assert reply.json()["usage"]["completion_tokens"] == 12 * n
    return [c["text"] for c in reply.json()["choices"]]


def test_n_choices_with_a_seed_differ(served, pki) -> None:
    first, second = _choices(served, pki, PROMPT_IDS, 2, 7)
    assert first != second  # seeds 7 and 8


def test_n_choices_with_a_seed_are_the_engines_draws_and_reproducible(served, pki) -> None:
    """Choice j draws with seed + j: exactly the offline engine's sample with that seed,
    whichever worker samples which token, on the first run (the prompt prefilled remotely)
    and on a repeat (the prompt now cached where it was decoded)."""
    prompt = list(range(500, 600))  # no other test sends it: the first run prefills remotely
    params = [SamplingParams(temperature=1.0, seed=seed, max_tokens=12, ignore_eos=True)
              for seed in (7, 8)]
    reference = LLM("tiny", cache=CacheConfig(num_blocks=64))
    expected = [reference.generate([prompt], p)[0].outputs[0].text for p in params]
    assert expected[0] != expected[1]
    assert _choices(served, pki, prompt, 2, 7) == expected
    assert _choices(served, pki, prompt, 2, 7) == expected


class _HttpStream(threading.Thread):
    """A streamed completion read on its own thread; `decoding` is set once two chunks (two
    steps: the request is on its decode worker) are in."""

    def __init__(self, served: Served, pki: dict[str, str]) -> None:
        super().__init__()
        self.served, self.pki = served, pki
        self.texts: list[str] = []
        self.finish: list[str] = []
        self.usage: dict = {}
        self.decoding = threading.Event()

    def run(self) -> None:
        body = {"prompt": PROMPT_IDS, "max_tokens": 300, "temperature": 0.0, "stream": True,
                "ignore_eos": True, "stream_options": {"include_usage": True}}
        try:
            with _http(self.pki) as http, http.stream(
                    "POST", self.served.http + "/v1/completions", json=body) as reply:
                for line in reply.iter_lines():
                    if not line.startswith("data: {"):
                        continue
                    chunk = json.loads(line[6:])
                    self.usage = chunk.get("usage") or self.usage
                    for choice in chunk["choices"]:
                        self.texts.append(choice["text"])
                        if choice["finish_reason"]:
                            self.finish.append(choice["finish_reason"])
                    if len(self.texts) >= 2:
                        self.decoding.set()
        finally:
            self.decoding.set()


def test_decode_worker_killed_under_live_grpc_and_http_streams(served, pki) -> None:
    params = {"max_tokens": 300, **GREEDY}
    migrated_before = _migrations(served, pki)
    with _client(served, pki) as client:
        outs = list(client.generate(prompt_token_ids=PROMPT_IDS, **params))
        expected = [t for o in outs for t in o.token_ids]
        expected_text = "".join(o.text for o in outs)
        stream = client.generate(prompt_token_ids=PROMPT_IDS, **params)
        tokens = []
        while len(tokens) < 5:
            tokens += next(stream).token_ids
        http = _HttpStream(served, pki)
        http.start()
        assert http.decoding.wait(300)
        # Both requests decoding, neither near its end: kill every decode worker holding one.
        busy = [w for w in client.status()["pools"]["decode"] if w["in_flight"]]
        assert busy and sum(w["in_flight"] for w in busy) == 2
        assert len(tokens) < 300 and not http.finish
        for w in busy:
            os.kill(w["pid"], signal.SIGKILL)
        outs = list(stream)
        tokens += [t for o in outs for t in o.token_ids]
        http.join(300)
    assert outs[-1].finish_reason == "length" and tokens == expected
    assert http.finish == ["length"] and http.usage["completion_tokens"] == 300
    assert "".join(http.texts) == expected_text
    assert _migrations(served, pki) - migrated_before == 2
    wait_for(lambda: _two_ready_decode_workers(served, pki), "the killed workers replaced",
             poll_s=0.2)


def test_sigterm_drains_a_running_request(served, pki) -> None:
    """The decode worker holding the one running request is stopped (SIGSTOP) before the
    SIGTERM, so the request is certainly running when the drain starts; new requests are
    refused meanwhile, and once the worker goes on the request ends in full and serve
    exits 0."""
    with _client(served, pki) as client:
        stream = client.generate(prompt_token_ids=PROMPT_IDS, max_tokens=200, **GREEDY)
        first = next(stream)
        (holder,) = [w for w in client.status()["pools"]["decode"] if w["in_flight"]]
        assert holder["in_flight"] == 1
        os.kill(holder["pid"], signal.SIGSTOP)
        try:
            served.proc.send_signal(signal.SIGTERM)
            # The drain has begun once health says so (no request is sent before: one could
            # be placed on the stopped worker and wait for it).
            wait_for(lambda: client.health() == "NOT_SERVING", "the drain to begin")
            with pytest.raises(grpc.RpcError) as e:
                list(client.generate(prompt_token_ids=PROMPT_IDS, max_tokens=1, **GREEDY))
            assert e.value.code() == grpc.StatusCode.UNAVAILABLE
            assert "draining" in e.value.details()
            assert served.proc.poll() is None  # waiting for the running request
        finally:
            os.kill(holder["pid"], signal.SIGCONT)
        rest = list(stream)
    assert rest[-1].finish_reason == "length"
    assert len(first.token_ids) + sum(len(o.token_ids) for o in rest) == 200
    assert served.proc.wait(120) == 0
    assert "requests still running at the drain timeout" not in served.log(100)
