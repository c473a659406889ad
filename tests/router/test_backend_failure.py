"""How the front doors render a stream that a backend ends in error, on each protocol.

The backend is a stand-in that fails after one token (what a client sees when a request
cannot be saved, e.g. with `--no-migration`). Real worker deaths, which migrate, are in
`tests/integration/test_faults.py` and `tests/e2e/test_serve_resilience.py`.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from typing import Any

import httpx
import openai
import pytest

from router.backend import Backend, GenerateRequest, ModelInfo, TokenDelta
from router.client import PdClusterClient
from router.servers import Servers, start_servers


class _DyingBackend(Backend):
    """The real backend's model, but every request's worker dies after one token."""

    def __init__(self, real: Backend) -> None:
        self.real = real

    def model_info(self) -> ModelInfo:
        return self.real.model_info()

    async def generate(self, request: GenerateRequest) -> AsyncIterator[TokenDelta]:
        yield TokenDelta(request.request_id, [42])
        yield TokenDelta(request.request_id, [], "error", error="decode worker died")

    async def abort(self, request_id: str) -> bool:
        return False

    async def status(self) -> dict[str, Any]:
        return {"mode": "dying", "pools": {}}

    async def scale(self, num_prefill: int | None, num_decode: int | None) -> dict[str, Any]:
        raise NotImplementedError

    def healthy(self) -> bool:
        return False


@pytest.fixture
def dying(loop_thread, backend) -> Iterator[Servers]:
    servers = loop_thread.run(start_servers(_DyingBackend(backend)))
    yield servers
    loop_thread.run(servers.stop(grace=0.5))


def test_grpc_stream_ends_with_error(dying):
    with PdClusterClient(f"127.0.0.1:{dying.grpc_port}", timeout=30) as client:
        outs = list(client.generate("hello"))
        assert client.health() == "NOT_SERVING"
    assert outs[0].token_ids == [42] and outs[-1].finish_reason == "error"
    assert outs[-1].error == "decode worker died"
    assert outs[-1].usage.completion_tokens == 1


def test_http_error_responses(dying):
    base = f"http://127.0.0.1:{dying.http_port}"
    resp = httpx.post(f"{base}/v1/completions", json={"prompt": "hello"})
    assert resp.status_code == 500
    assert resp.json()["error"] == {"message": "decode worker died", "type": "server_error",
                                    "param": None, "code": None}
    api = openai.OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0)
    with pytest.raises(openai.APIError, match="decode worker died"):
        list(api.completions.create(model="tiny", prompt="hello", stream=True))
    assert httpx.get(f"{base}/health").status_code == 503
