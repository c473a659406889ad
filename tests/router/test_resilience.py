"""Deadlines, drain, client disconnects and bad input at the front doors (real tiny engine).

Every test ends with the engine's KV pool fully free (the fixtures check it).
"""

from __future__ import annotations

import asyncio
import json
import socket
import threading
from concurrent.futures import ThreadPoolExecutor

import grpc
import httpx
import pytest

from router.client import PdClusterClient
from tests.router.conftest import engine_stalled

PROMPT = "The quick brown fox"
# Far more tokens than a test lets the engine produce: these requests end by a deadline, an
# abort or a disconnect, and the engine is held (`engine_stalled`) where timing matters.
LONG = {"max_tokens": 1000, "temperature": 0.0, "ignore_eos": True}


def _finished(servers, reason: str) -> float:
    return _sample(servers, "requests_finished", finish_reason=reason)


def _sample(servers, name: str, **labels: str) -> float:
    metrics = servers.router.metrics
    return metrics.registry.get_sample_value(
        f"pdcluster:{name}_total", {"model_name": metrics.model_name, **labels}) or 0.0


def test_grpc_deadline_aborts_the_request_everywhere(make_servers, backend, wait_until):
    servers = make_servers()
    with PdClusterClient(f"127.0.0.1:{servers.grpc_port}") as client, engine_stalled(backend):
        with pytest.raises(grpc.RpcError) as e:  # only the deadline can end it
            list(client.generate(PROMPT, timeout=0.5, **LONG))
        assert e.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        wait_until(lambda: not servers.router.admission.num_running)
    assert _finished(servers, "abort") == 1
    # Released, the engine takes the request and then its abort: the fixture finds the pool
    # free.


def test_http_request_timeout(make_servers, backend, wait_until):
    servers = make_servers(request_timeout_s=1.0)
    base = f"http://127.0.0.1:{servers.http_port}/v1"
    body = {"prompt": PROMPT, **LONG}
    with engine_stalled(backend):
        resp = httpx.post(f"{base}/completions", json=body, timeout=60)
    assert resp.status_code == 504 and resp.json()["error"]["code"] == "deadline_exceeded"
    with httpx.stream("POST", f"{base}/completions", json={**body, "stream": True},
                      timeout=60) as resp:
        lines = resp.iter_lines()
        events = [next(line for line in lines if line.startswith("data: "))]  # streaming
        with engine_stalled(backend):  # then held until the deadline ends it mid-stream
            events += [line for line in lines if line.startswith("data: ")]
    assert json.loads(events[0][6:])["choices"][0]["text"]
    assert json.loads(events[-2][6:])["error"]["code"] == "deadline_exceeded"
    assert events[-1] == "data: [DONE]"
    wait_until(lambda: not servers.router.admission.num_running)
    assert _finished(servers, "abort") == 2


def test_client_leaving_a_non_streaming_request_aborts_it(servers, backend, wait_until):
    """The client closes its connection while its request is admitted and the engine is
    held: it leaves before any token, whatever the machine's speed, and once the engine
    goes on the request ends as an abort (never `length`)."""
    before = _finished(servers, "abort")
    disconnects = _sample(servers, "requests_aborted", cause="disconnect")
    body = json.dumps({"prompt": PROMPT, **LONG}).encode()
    with engine_stalled(backend):
        with socket.create_connection(("127.0.0.1", servers.http_port)) as sock:
            sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: "
                         b"application/json\r\nContent-Length: %d\r\n\r\n%s"
                         % (len(body), body))
            wait_until(lambda: servers.router.admission.num_running == 1)
        assert _finished(servers, "abort") == before  # nothing ended it yet
    wait_until(lambda: not servers.router.admission.num_running)
    assert _finished(servers, "abort") == before + 1
    assert _sample(servers, "requests_aborted", cause="disconnect") == disconnects + 1


def test_drain_refuses_new_requests_and_lets_running_ones_finish(make_servers, backend,
                                                                 loop_thread, wait_until):
    servers = make_servers()
    client = PdClusterClient(f"127.0.0.1:{servers.grpc_port}", timeout=60)
    base = f"http://127.0.0.1:{servers.http_port}"
    with ThreadPoolExecutor(1) as pool:
        with engine_stalled(backend):  # the request cannot finish before the drain starts
            running = pool.submit(lambda: list(client.generate(
                PROMPT, max_tokens=200, temperature=0.0, ignore_eos=True)))
            wait_until(lambda: servers.router.admission.num_running == 1)
            draining = asyncio.run_coroutine_threadsafe(servers.drain(60), loop_thread.loop)
            wait_until(lambda: servers.router.draining)
            assert servers.router.admission.num_running == 1  # running as the drain starts
            assert client.health() == "NOT_SERVING"
            with pytest.raises(grpc.RpcError) as e:
                list(client.generate(PROMPT, max_tokens=4))
            assert e.value.code() == grpc.StatusCode.UNAVAILABLE
            assert httpx.post(f"{base}/v1/completions",
                              json={"prompt": PROMPT}).status_code == 503
            assert httpx.get(f"{base}/health").status_code == 503
            assert not draining.done()  # waiting for the running request
        outs = running.result(60)
    assert outs[-1].finish_reason == "length"
    assert sum(len(o.token_ids) for o in outs) == 200
    assert draining.result(60) == 0  # nothing left running when the drain ended
    client.close()


def test_a_drain_that_times_out_reports_what_is_left_and_stop_aborts_it(
        make_servers, backend, loop_thread, wait_until):
    """What `serve` does on SIGTERM when a request outlives the drain timeout: the drain
    returns after the timeout with one request left, and stopping the servers ends it (the
    client's call ends UNAVAILABLE, the engine aborts it, the fixture finds the pool free)."""
    servers = make_servers()
    client = PdClusterClient(f"127.0.0.1:{servers.grpc_port}", timeout=60)
    aborted = _finished(servers, "abort")
    with ThreadPoolExecutor(1) as pool:
        with engine_stalled(backend):  # it cannot finish: only the timeout ends the drain
            running = pool.submit(lambda: list(client.generate(PROMPT, **LONG)))
            wait_until(lambda: servers.router.admission.num_running == 1)
            assert loop_thread.run(servers.drain(0.3)) == 1
            loop_thread.run(servers.stop(grace=0.3))
        with pytest.raises(grpc.RpcError) as e:
            running.result(30)
    assert e.value.code() == grpc.StatusCode.UNAVAILABLE
    assert e.value.details() == "Cancelling all calls"
    wait_until(lambda: not servers.router.admission.num_running)
    assert _finished(servers, "abort") == aborted + 1
    client.close()


def test_lone_surrogate_is_a_400(servers):
    base = f"http://127.0.0.1:{servers.http_port}/v1"
    for path, body in (("completions", {"prompt": "a\ud800b"}),
                       ("chat/completions", {"messages": [{"role": "user",
                                                           "content": "\udfff"}]})):
        resp = httpx.post(f"{base}/{path}", content=json.dumps(body),
                          headers={"content-type": "application/json"})
        assert resp.status_code == 400, resp.text
        assert "not valid Unicode" in resp.json()["error"]["message"]


def test_max_tokens_beyond_the_context_is_rejected(servers, client):
    base = f"http://127.0.0.1:{servers.http_port}/v1"
    resp = httpx.post(f"{base}/completions", json={"prompt": PROMPT, "max_tokens": 100000000})
    assert resp.status_code == 400
    assert resp.json()["error"]["param"] == "max_tokens"
    with pytest.raises(grpc.RpcError) as e:
        list(client.generate(PROMPT, max_tokens=5000))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    # Chat without max_tokens runs to the end of the context, which fits by definition.
    resp = httpx.post(f"{base}/chat/completions", timeout=60, json={
        "messages": [{"role": "user", "content": PROMPT}], "stop": ["e"]})
    assert resp.status_code == 200


def test_many_clients_disconnecting_mid_stream_leak_nothing(servers, backend, wait_until):
    """Eight clients each read their first chunk, then the engine is held and they all
    leave: every request is still running when its client goes (none can finish), and the
    router ends each one as an abort while no token comes."""
    base = f"http://127.0.0.1:{servers.http_port}/v1"
    aborted = _finished(servers, "abort")
    first_chunks, leave = threading.Semaphore(0), threading.Event()

    def leave_after_first_chunk(i: int) -> None:
        with httpx.stream("POST", f"{base}/completions", timeout=60, json={
                "prompt": f"{PROMPT} {i}", "stream": True, **LONG}) as resp:
            for line in resp.iter_lines():
                if line.startswith("data: "):
                    first_chunks.release()
                    assert leave.wait(60)
                    return  # closes the connection mid-stream

    with ThreadPoolExecutor(8) as pool:
        clients = [pool.submit(leave_after_first_chunk, i) for i in range(8)]
        for _ in clients:
            assert first_chunks.acquire(timeout=60), "a stream sent no first chunk"
        with engine_stalled(backend):
            assert servers.router.admission.num_running == 8
            leave.set()
            for client in clients:
                client.result(60)
            wait_until(lambda: not servers.router.admission.num_running)
    assert _finished(servers, "abort") == aborted + 8  # and the fixture finds the pool free
