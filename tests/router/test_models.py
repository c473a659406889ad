"""Two models behind one pair of front doors (`router.models.Routers`), each over an engine
of its own: requests go to the model they name, an Abort finds the request in whichever
model runs it, `/metrics` shows each metric once with a series per model, and an unknown
model or a missing one is refused naming the served ones."""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import grpc
import httpx
import pytest

from cluster.engine_backend import EngineBackend
from engine import CacheConfig, LLMEngine, SamplingParams
from router.client import PdClusterClient
from router.router import RouterConfig
from router.servers import Servers, start_servers
from tests.conftest import assert_pool_free
from tests.router.conftest import LoopThread, engine_stalled, wait_for

pytestmark = pytest.mark.server  # starts the servers in-process

PROMPT = "The quick brown fox"


@pytest.fixture(scope="module")
def second() -> Iterator[EngineBackend]:
    backend = EngineBackend(LLMEngine("tiny", cache=CacheConfig(num_blocks=64)), "tiny")
    yield backend
    backend.close()


@pytest.fixture(scope="module")
def two(loop_thread: LoopThread, backend: EngineBackend,
        second: EngineBackend) -> Iterator[Servers]:
    servers = loop_thread.run(start_servers(
        backend, more_models=[(second, RouterConfig(served_model_name="tiny-b"))]))
    yield servers
    loop_thread.run(servers.stop(grace=0.5))
    for each in (backend, second):
        each.loop.call(assert_pool_free)


def test_each_request_reaches_the_model_it_names(two, offline):
    expected = offline.generate(PROMPT, SamplingParams(max_tokens=6, temperature=0.0,
                                                       ignore_eos=True))[0].outputs[0]
    with PdClusterClient(f"127.0.0.1:{two.grpc_port}", timeout=30) as client:
        for name in ("tiny", "tiny-b"):
            outs = list(client.generate(PROMPT, model=name, max_tokens=6, temperature=0.0,
                                        ignore_eos=True))
            assert [t for o in outs for t in o.token_ids] == expected.token_ids
        with pytest.raises(grpc.RpcError) as e:
            list(client.generate(PROMPT, model="other", max_tokens=2))
        assert e.value.code() == grpc.StatusCode.NOT_FOUND
        assert e.value.details() == ("model: 'other' is not served here; the models are "
                                     "'tiny', 'tiny-b'")
        with pytest.raises(grpc.RpcError) as e:
            client.scale(decode=2)
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert e.value.details() == "model: required, this server serves several: tiny, tiny-b"
        assert client.status("tiny-b")["model"] == "tiny-b"
        assert client.status()["models"] == ["tiny", "tiny-b"]
    http = f"http://127.0.0.1:{two.http_port}"
    reply = httpx.post(http + "/v1/completions", timeout=30,
                       json={"model": "tiny-b", "prompt": PROMPT, "max_tokens": 2})
    assert reply.json()["model"] == "tiny-b"
    missing = httpx.post(http + "/tokenize", timeout=30, json={"prompt": PROMPT})
    assert missing.status_code == 400 and missing.json()["error"]["param"] == "model"
    unknown = httpx.post(http + "/detokenize", timeout=30, json={"model": "x", "tokens": [1]})
    assert unknown.status_code == 404
    assert unknown.json()["error"]["code"] == "model_not_found"


def test_abort_finds_the_request_in_the_second_model(two, second):
    with PdClusterClient(f"127.0.0.1:{two.grpc_port}", timeout=30) as client, \
            ThreadPoolExecutor(2) as pool:
        with engine_stalled(second):  # however fast the machine, it is still running
            running = pool.submit(lambda: list(client.generate(
                PROMPT, model="tiny-b", request_id="on-b", max_tokens=1000, ignore_eos=True)))
            b = two.routers.by_name["tiny-b"]
            wait_for(lambda: b.admission.num_running == 1)
            abort = pool.submit(client.abort, "on-b")  # reaches the held engine
        abort.result(timeout=30)
        assert running.result(timeout=30)[-1].finish_reason == "abort"
        with pytest.raises(grpc.RpcError) as e:
            client.abort("on-b")
        assert e.value.code() == grpc.StatusCode.NOT_FOUND


def _generated(http: str) -> dict[str, float]:
    from prometheus_client.parser import text_string_to_metric_families

    families = {f.name: f for f in text_string_to_metric_families(
        httpx.get(http + "/metrics", timeout=10).text)}
    return {s.labels["model_name"]: s.value
            for s in families["pdcluster:generation_tokens"].samples
            if s.name.endswith("_total")}


def test_metrics_show_each_family_once_with_a_series_per_model(two):
    http = f"http://127.0.0.1:{two.http_port}"
    before = _generated(http)
    with PdClusterClient(f"127.0.0.1:{two.grpc_port}", timeout=30) as client:
        list(client.generate(PROMPT, model="tiny-b", max_tokens=3, ignore_eos=True))
    after = _generated(http)
    assert {m: after[m] - before[m] for m in ("tiny", "tiny-b")} == {"tiny": 0, "tiny-b": 3}
    text = httpx.get(http + "/metrics", timeout=10).text
    types = Counter(line.split()[2] for line in text.splitlines()
                    if line.startswith("# TYPE"))
    assert "pdcluster:num_requests_waiting" in types and max(types.values()) == 1
    waiting = [line for line in text.splitlines()
               if line.startswith("pdcluster:num_requests_waiting{")]
    assert sorted(line.split('"')[1] for line in waiting) == ["tiny", "tiny-b"]
