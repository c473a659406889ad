"""`pdcluster serve --detach` on a real Ray cluster (this test process is its head): the
launcher SIGKILLed, the front door's process SIGKILLed and restarted by Ray with the same workers,
the launcher run again, `pdcluster drain` under a live stream, then `pdcluster stop`."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time

import grpc
import httpx
import pytest
import ray

from cluster.frontdoor import NAMESPACE, frontdoor_name
from router.client import PdClusterClient
from tests.conftest import hf_greedy
from tests.e2e.serving import wait_for

pytestmark = [pytest.mark.e2e, pytest.mark.cluster]

READY = re.compile(r"gRPC (\S+)\s+OpenAI (\S+)/v1")
GREEDY = {"temperature": 0.0, "ignore_eos": True}
PROMPT_IDS = list(range(300, 340))  # long enough for the prefill worker (threshold 8)
# Generous: Ray's restart of the actor plus the servers' start (measured: a few seconds).
BACK_WITHIN_S = 120.0


@pytest.fixture(scope="module")
def ray_head():
    """A Ray cluster the launcher joins and outlives (this process is its driver)."""
    started = not ray.is_initialized()
    if started:
        ray.init(num_cpus=6, include_dashboard=False, log_to_driver=False,
                 namespace=NAMESPACE)
    yield ray.get_runtime_context().gcs_address
    if started:
        ray.shutdown()


def _cli(*argv: str) -> list[str]:
    return [sys.executable, "-m", "commands.cli", *argv]


def _greedy_tokens(grpc_address: str, max_tokens: int) -> list[int]:
    with PdClusterClient(grpc_address, timeout=120) as client:
        outs = list(client.generate(prompt_token_ids=PROMPT_IDS, max_tokens=max_tokens,
                                    **GREEDY))
    return [t for o in outs for t in o.token_ids]


def _workers(grpc_address: str, retries: bool = True) -> dict[str, dict]:
    with PdClusterClient(grpc_address, timeout=30, retries=retries) as client:
        return {w["worker_id"]: w for ws in client.status()["pools"].values() for w in ws}


def _pools_free(grpc_address: str) -> bool:
    workers = _workers(grpc_address).values()
    return bool(workers) and all(w["num_free_blocks"] == w["num_blocks"]
                                 and not w["num_running"] for w in workers)


def _health(http_base: str) -> int | None:
    try:
        return httpx.get(http_base + "/health", timeout=2).status_code
    except httpx.HTTPError:
        return None


class _Stream(threading.Thread):
    """A long greedy HTTP stream; `decoding` once tokens flow, `error` how it ended."""

    def __init__(self, http_base: str, max_tokens: int = 900) -> None:
        super().__init__(daemon=True)
        self.http_base = http_base
        self.max_tokens = max_tokens
        self.decoding = threading.Event()
        self.finish: list[str] = []
        self.ended: float | None = None  # monotonic seconds at the finish reason
        self.error: BaseException | None = None

    def run(self) -> None:
        body = {"prompt": PROMPT_IDS, "max_tokens": self.max_tokens, "stream": True, **GREEDY}
        try:
            with httpx.stream("POST", self.http_base + "/v1/completions", json=body,
                              timeout=60) as reply:
                assert reply.status_code == 200, reply.read()
                for line in reply.iter_lines():
                    if line.startswith("data: {"):
                        chunk = json.loads(line[6:])
                        self.finish += [c["finish_reason"] for c in chunk["choices"]
                                        if c["finish_reason"]]
                        if self.finish and self.ended is None:
                            self.ended = time.monotonic()
                        self.decoding.set()
        except httpx.HTTPError as e:
            self.error = e
        finally:
            self.decoding.set()


class _Command(threading.Thread):
    """The CLI run to its end: its output (stdout and stderr) line by line as it comes, its
    exit code, and `ended` when it exited (monotonic seconds)."""

    def __init__(self, *argv: str) -> None:
        super().__init__(daemon=True)
        self.argv = argv
        self.lines: list[str] = []
        self.returncode: int | None = None
        self.ended: float | None = None

    def run(self) -> None:
        with subprocess.Popen(_cli(*self.argv), stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True,
                              env={**os.environ, "PYTHONUNBUFFERED": "1"}) as process:
            assert process.stdout is not None
            self.lines.extend(process.stdout)
            self.returncode = process.wait(180)
        self.ended = time.monotonic()

    @property
    def output(self) -> str:
        return "".join(self.lines)


def test_detached_cluster_outlives_its_launcher_and_its_front_door(ray_head):
    name = f"fd{os.getpid()}"
    flags = ["serve", "--detach", "--name", name, "--address", ray_head, "--model", "tiny",
             "--prefill", "1", "--decode", "1", "--kv-cache-gb", "0.25", "--dtype", "float32",
             "--local-prefill-threshold", "8", "--grpc-port", "0", "--http-port", "0"]
    # The real CLI, whose process then stays connected to Ray until it is SIGKILLed.
    launcher = subprocess.Popen(
        [sys.executable, "-c", "import sys, time; from commands.cli import main; "
         f"code = main({flags!r}); print('launched', code, flush=True); time.sleep(3600)"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"})
    try:
        lines = []
        assert launcher.stdout is not None
        for line in launcher.stdout:
            lines.append(line)
            if line.startswith("launched"):
                break
        assert lines and lines[-1].strip() == "launched 0", "".join(lines[-30:])
        grpc_address, http_base = READY.search("".join(lines)).groups()

        # 1. The launcher SIGKILLed: the cluster serves on, exact greedy tokens.
        assert launcher.poll() is None
        launcher.send_signal(signal.SIGKILL)
        launcher.wait(30)
        expected = hf_greedy("tiny", PROMPT_IDS, 16)
        assert _greedy_tokens(grpc_address, 16) == expected
        before = {wid: w["pid"] for wid, w in _workers(grpc_address).items()}
        assert sorted(before) == ["decode-0", "prefill-1"]

        # 2. The front door's process SIGKILLed under a live stream: Ray restarts it on the
        # same ports, it adopts the same worker processes, the stream ends in an error.
        door = ray.get_actor(frontdoor_name(name), namespace=NAMESPACE)
        first_pid = ray.get(door.ready.remote())["pid"]
        stream = _Stream(http_base)
        stream.start()
        assert stream.decoding.wait(60)
        killed = time.monotonic()
        os.kill(first_pid, signal.SIGKILL)  # as the OOM killer would
        stream.join(60)
        assert stream.error is not None and not stream.finish
        wait_for(lambda: _health(http_base) == 200, "the HTTP port to answer again",
                 timeout_s=BACK_WITHIN_S, poll_s=0.1)
        back_s = time.monotonic() - killed
        print(f"front door back after {back_s:.1f} s")
        restarted = ray.get(door.ready.remote())
        assert restarted["restarted"] and restarted["pid"] != first_pid
        after = {wid: w["pid"] for wid, w in _workers(grpc_address).items()}
        assert after == before  # the same workers, not new ones
        wait_for(lambda: _pools_free(grpc_address), "every KV pool free", timeout_s=30)
        assert _greedy_tokens(grpc_address, 16) == expected
        # `scale` through the new front door: the new worker's id follows the adopted ones.
        with PdClusterClient(grpc_address, timeout=300) as client:
            pools = client.scale(decode=2)["pools"]
        assert sorted(w["worker_id"] for w in pools["decode"]) == ["decode-0", "decode-2"]

        # 3. The launcher run again (a Kubernetes Job's retry) finds it and changes nothing.
        again = subprocess.run(_cli(*flags), capture_output=True, text=True, timeout=300)
        assert again.returncode == 0, again.stderr
        assert "already runs" in again.stdout
        assert READY.search(again.stdout).groups() == (grpc_address, http_base)
        assert ray.get(door.ready.remote())["pid"] == restarted["pid"]

        # 4. `pdcluster drain`, as the front-door pod's preStop hook runs it, under a live
        # stream, held in flight by SIGSTOPping the decode workers until the drain has
        # begun: health NOT_SERVING and new requests refused at once, no answer from the
        # command while the stream cannot end; the stream ends with all its tokens, then
        # the command returns 0; the workers go on.
        workers = {wid: w["pid"] for wid, w in _workers(grpc_address).items()}
        stream = _Stream(http_base, max_tokens=300)
        stream.start()
        assert stream.decoding.wait(60)
        paused = [pid for wid, pid in workers.items() if wid.startswith("decode-")]
        try:
            for pid in paused:
                os.kill(pid, signal.SIGSTOP)
            drain = _Command("drain", "--address", ray_head, "--name", name)
            drain.start()
            wait_for(lambda: _health(http_base) == 503, "the front door to drain",
                     timeout_s=60, poll_s=0.05)
            draining = time.monotonic()
            refused_http = httpx.post(http_base + "/v1/completions", timeout=30, json={
                "prompt": PROMPT_IDS, "max_tokens": 4, **GREEDY})
            assert refused_http.status_code == 503, refused_http.text
            assert refused_http.headers["retry-after"] == "5"
            assert refused_http.json()["error"]["code"] == "draining"
            with PdClusterClient(grpc_address, timeout=30) as client:
                assert client.health() == "NOT_SERVING"
                with pytest.raises(grpc.RpcError) as refused:
                    list(client.generate(prompt_token_ids=PROMPT_IDS, max_tokens=4, **GREEDY))
                assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
            # A drain that did not wait would have answered by now (it takes milliseconds).
            time.sleep(max(draining + 1.0 - time.monotonic(), 0.0))
            assert not stream.finish
            assert not [line for line in drain.lines if line.startswith("drained")], \
                drain.output
        finally:
            for pid in paused:
                os.kill(pid, signal.SIGCONT)
        stream.join(120)
        drain.join(120)
        assert stream.error is None and stream.finish == ["length"]
        assert drain.returncode == 0, drain.output
        assert stream.ended < drain.ended, "the drain returned before the stream ended"
        assert _health(http_base) == 503  # drained until its process ends
        assert {wid: w["pid"] for wid, w in _workers(grpc_address).items()} == workers
        assert ray.get(door.ready.remote())["pid"] == restarted["pid"]

        # 5. `pdcluster stop` drains and removes every actor of the cluster.
        done = subprocess.run(_cli("stop", "--address", ray_head, "--name", name),
                              capture_output=True, text=True, timeout=180)
        assert done.returncode == 0, done.stderr
        assert not [n for n in ray.util.list_named_actors() if n.startswith(name)]
        with pytest.raises(grpc.RpcError) as refused:
            _workers(grpc_address, retries=False)
        assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
        commands = [_Command(c, "--address", ray_head, "--name", name)
                    for c in ("stop", "drain")]
        for command in commands:
            command.start()
        for command in commands:
            command.join(180)
            assert command.returncode == 1, command.output
            assert f"no detached cluster named {name!r}" in command.output
    finally:
        launcher.kill()
        launcher.wait(30)
        subprocess.run(_cli("stop", "--address", ray_head, "--name", name),
                       capture_output=True, timeout=180)
