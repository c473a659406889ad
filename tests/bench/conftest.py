"""Real gRPC and OpenAI HTTP servers on port 0 over one in-process tiny engine."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator

import pytest

from cluster.engine_backend import EngineBackend
from engine import CacheConfig, LLMEngine
from router.servers import Servers, start_servers
from tests.conftest import assert_pool_free


@pytest.fixture(scope="session")
def tiny_backend() -> Iterator[EngineBackend]:
    backend = EngineBackend(LLMEngine("tiny", cache=CacheConfig(num_blocks=256)), "tiny")
    yield backend
    backend.close()


@pytest.fixture(scope="session")
def tiny_servers(tiny_backend: EngineBackend) -> Iterator[Servers]:
    """Both front doors, served from an event loop on its own thread (the benchmark runs its
    own loop in the test's thread, as the CLI does)."""
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    servers = asyncio.run_coroutine_threadsafe(start_servers(tiny_backend), loop).result(30)
    yield servers
    asyncio.run_coroutine_threadsafe(servers.stop(grace=0.5), loop).result(30)
    loop.call_soon_threadsafe(loop.stop)
    thread.join(10)
    loop.close()


@pytest.fixture
def servers(tiny_servers: Servers, tiny_backend: EngineBackend) -> Iterator[Servers]:
    """The shared servers; the engine's KV pool must be fully free after the test."""
    yield tiny_servers
    tiny_backend.loop.call(assert_pool_free)
