"""Real servers on port 0 over one real tiny engine, run in a background event loop."""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from collections.abc import Callable, Coroutine, Iterator
from typing import Any

import pytest

from cluster.engine_backend import EngineBackend
from engine import LLM, CacheConfig, LLMEngine
from protocol.tracing import Tracer
from router.auth import SecurityConfig
from router.client import PdClusterClient
from router.router import RouterConfig
from router.servers import Servers, start_servers
from tests.conftest import assert_pool_free


class LoopThread:
    """An asyncio loop on its own thread, so tests can use blocking clients."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self._thread.start()

    def run(self, coro: Coroutine[Any, Any, Any], timeout: float = 30.0) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(10)
        self.loop.close()


@pytest.fixture(scope="session")
def loop_thread() -> Iterator[LoopThread]:
    thread = LoopThread()
    yield thread
    thread.close()


@pytest.fixture(scope="session")
def engine() -> LLMEngine:
    return LLMEngine("tiny", cache=CacheConfig(num_blocks=256))


@pytest.fixture(scope="session")
def backend(engine: LLMEngine) -> Iterator[EngineBackend]:
    backend = EngineBackend(engine, "tiny")
    yield backend
    backend.close()


def wait_for(condition: Callable[[], bool], timeout: float = 10.0) -> None:
    """Poll a condition that has no event to wait on (e.g. another thread's queue depth)."""
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise TimeoutError("condition not met in time")
        time.sleep(0.005)


@contextlib.contextmanager
def engine_stalled(backend: EngineBackend) -> Iterator[None]:
    """The engine thread held (as a stalled worker would be) until the block ends: requests
    are admitted and queued for the engine, but none advances, however fast the machine.
    Commands sent meanwhile (add, abort) run in order once it is released."""
    held, release = threading.Event(), threading.Event()

    def hold(_engine: LLMEngine) -> None:
        held.set()
        release.wait(120)

    backend.loop.submit(hold)
    assert held.wait(30), "the engine thread never picked up the hold"
    try:
        yield
    finally:
        release.set()


def _idle(servers: Servers) -> bool:
    return not servers.router.admission.num_running and not servers.router.admission.num_waiting


@pytest.fixture(scope="session")
def shared_servers(loop_thread: LoopThread, backend: EngineBackend) -> Iterator[Servers]:
    servers = loop_thread.run(start_servers(backend))
    yield servers
    loop_thread.run(servers.stop(grace=0.5))


@pytest.fixture
def make_servers(loop_thread: LoopThread, backend: EngineBackend
                 ) -> Iterator[Callable[..., Servers]]:
    """Start servers with the given RouterConfig fields (and `security`, keys and TLS;
    `tracer`, the router's spans); stopped after the test, and the engine's pool must then
    be fully free."""
    started: list[Servers] = []

    def make(security: SecurityConfig | None = None, tracer: Tracer | None = None,
             **config: Any) -> Servers:
        servers = loop_thread.run(start_servers(backend, config=RouterConfig(**config),
                                                security=security, tracer=tracer))
        started.append(servers)
        return servers

    yield make
    for servers in started:
        loop_thread.run(servers.stop(grace=0.5))
    backend.loop.call(assert_pool_free)


@pytest.fixture
def servers(shared_servers: Servers, backend: EngineBackend) -> Iterator[Servers]:
    """The shared servers (default config); the engine's pool must be fully free after."""
    yield shared_servers
    # A cancelled stream leaves the router a moment after the client lets go.
    wait_for(lambda: _idle(shared_servers))
    # Runs on the engine thread after every abort the finished streams submitted.
    backend.loop.call(assert_pool_free)


@pytest.fixture
def client(servers: Servers) -> Iterator[PdClusterClient]:
    with PdClusterClient(f"127.0.0.1:{servers.grpc_port}", timeout=30) as client:
        yield client


@pytest.fixture(scope="session")
def offline() -> LLM:
    """The offline engine on the same weights: the reference output."""
    return LLM("tiny", cache=CacheConfig(num_blocks=256))


@pytest.fixture(scope="module")
def smollm2_servers(loop_thread: LoopThread, smollm2: LLM) -> Iterator[Servers]:
    """Servers over the session's SmolLM2 engine, on an engine thread the module stops again
    (the offline tests drive the same engine from their own thread afterwards)."""
    backend = EngineBackend(smollm2.engine, "smollm2")
    servers = loop_thread.run(start_servers(backend))
    yield servers
    loop_thread.run(servers.stop(grace=0.5))
    backend.loop.call(assert_pool_free)
    backend.close()


@pytest.fixture
def wait_until() -> Callable[..., None]:
    return wait_for
