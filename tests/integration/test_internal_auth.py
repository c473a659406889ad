"""Internal sockets with the cluster's CURVE key (`internal_auth="curve"`, on loopback).

The cluster serves exactly the engine's greedy tokens over the zmq KV transport and the
default one; a peer without the key (none at all, or a keypair of its own) is never heard
by the router's PULL socket, a worker's command socket or a KV receiver, and what it sent
would have ended two streams: with `internal_auth="off"` the same messages get through (the
control that shows the observables can fail). The `off` cluster is also the zmq KV
transport's exact-token check (tests/integration/test_transports.py has the others).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import threading
import time

import pytest
import zmq
from zmq.auth.thread import AuthenticationThread

from engine import SamplingParams
from kv_transfer import wire
from protocol import Abort, Failed, encode
from router.backend import GenerateRequest
from tests.integration.conftest import (
    collect,
    collect_all,
    expected_tokens,
    random_prompts,
    start_cluster,
    wait_pools_free,
)
from tests.rogue import FAILED, Rogue

pytestmark = pytest.mark.cluster

GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
LONG = SamplingParams(temperature=0.0, max_tokens=400, ignore_eos=True)


def _zap_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if isinstance(t, AuthenticationThread)]


def _serves_the_engines_tokens(backend, loop_thread, reference) -> None:
    prompts = random_prompts(4, seed=21, low=40, high=150)

    got = collect_all(loop_thread, backend, prompts, GREEDY, "c")
    assert [tokens for tokens, _ in got] == expected_tokens(reference, prompts, GREEDY)
    assert all("transfer" in last.timings for _, last in got)  # prefilled remotely
    wait_pools_free(loop_thread, backend)


def test_curve_cluster_serves_the_engines_tokens_over_shared_memory(ray_local, loop_thread,
                                                                     reference):
    """The default transports under CURVE (zmq alone: the test below)."""
    backend = start_cluster(loop_thread, num_prefill=1, num_decode=1, transports=("shm", "zmq"),
                            internal_auth="curve")
    try:
        assert backend.pool.cluster_key is not None
        assert "CURVE" in backend.internal_security
        _serves_the_engines_tokens(backend, loop_thread, reference)
    finally:
        loop_thread.run(backend.close())
    assert _zap_threads() == []  # the router's ZAP handler stopped with the cluster


async def _stream(backend, rid, prompt, started: asyncio.Event):
    tokens, last = [], None
    async for delta in backend.generate(GenerateRequest(rid, prompt, LONG, time.monotonic())):
        tokens.extend(delta.token_ids)
        last = delta
        if len(tokens) >= 4:
            started.set()
    started.set()
    return tokens, last


@pytest.mark.parametrize("internal_auth", ["curve", "off"])
def test_peers_without_the_key_are_never_heard(ray_local, loop_thread, reference,
                                               internal_auth):
    backend = start_cluster(loop_thread, num_prefill=1, num_decode=1, transports=("zmq",),
                            internal_auth=internal_auth)
    try:
        curve = internal_auth == "curve"
        assert (backend.pool.cluster_key is not None) == curve
        assert backend.internal_security.startswith("CURVE" if curve else "plain TCP")
        _serves_the_engines_tokens(backend, loop_thread, reference)
        (decode,) = [h for h in backend.workers.values() if h.role.decodes]
        prompts = random_prompts(2, seed=22, low=40, high=150)
        started = [asyncio.Event(), asyncio.Event()]
        futures = [asyncio.run_coroutine_threadsafe(
            _stream(backend, f"s{i}", p, started[i]), loop_thread.loop)
            for i, p in enumerate(prompts)]
        for event in started:
            loop_thread.run(event.wait())
        # s0: a forged failure sent to the router; s1: a forged abort sent to the worker;
        # and a compatible KV handshake to the worker's receiver.
        forged = [(backend.pool.endpoint, zmq.PUSH,
                   encode(Failed(worker_id=decode.worker_id, request_id="s0@1", error="rogue"))),
                  (decode.info.endpoint, zmq.PUSH, encode(Abort(request_id="s1@1"))),
                  (decode.info.peer_info.endpoint, zmq.DEALER,
                   wire.encode(wire.Hello(transport="zmq",
                                          compat=decode.info.peer_info.compat)))]
        key = backend.pool.cluster_key
        server_keys = [None] if key is None else [None, key.public]
        with contextlib.ExitStack() as rogues_open:
            # The decode worker is stopped while the forgeries go out, so neither stream can
            # end on its own before they would land. Nothing between the two signals blocks:
            # a send only queues, and a rogue whose handshake already failed queues nothing.
            os.kill(decode.info.pid, signal.SIGSTOP)
            try:
                rogues = [rogues_open.enter_context(Rogue(endpoint, kind, key))
                          for key in server_keys for endpoint, kind, _ in forged]
                queued = [rogue.send(data) for rogue, (_, _, data)
                          in zip(rogues, forged * len(server_keys), strict=True)]
            finally:
                os.kill(decode.info.pid, signal.SIGCONT)
            outcomes = [rogue.handshake() for rogue in rogues]
            results = [f.result(300) for f in futures]
        expected = expected_tokens(reference, prompts, LONG)
        if internal_auth == "curve":
            # Every rogue was refused. Whether its forgery was queued does not matter: a send
            # can find no peer to queue for once the handshake has failed (libzmq drops the
            # pipe; seen once in CI even towards the stopped worker), and either way the
            # streams below show that nothing got through.
            assert all(outcome in FAILED for outcome in outcomes), outcomes
            assert [tokens for tokens, _ in results] == expected
            assert [last.finish_reason for _, last in results] == ["length", "length"]
            assert backend.pool.sockets.decisions["denied"] >= 1  # the rogue with its own keypair
        else:
            assert queued == [True] * 3
            assert outcomes == [zmq.EVENT_HANDSHAKE_SUCCEEDED] * 3
            assert (results[0][1].finish_reason, results[0][1].error) == ("error", "rogue")
            assert results[1][1].finish_reason == "abort"
        tokens, _ = loop_thread.run(collect(backend, "after", prompts[0], GREEDY))
        assert tokens == expected_tokens(reference, prompts[:1], GREEDY)[0]
        assert all(h.state == "ready" for h in backend.workers.values())
        wait_pools_free(loop_thread, backend)
    finally:
        loop_thread.run(backend.close())
    assert _zap_threads() == []
