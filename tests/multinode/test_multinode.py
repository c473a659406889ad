"""pdcluster across hosts: a Ray head and three Ray worker nodes, each in network, mount and
pid namespaces of its own (`tests/multinode/netns.py`), SmolLM2 served with the prefill
pool on one node and the decode pool on others, the test talking to the front door over
the bridge as a client on another machine would.

The tests run in order on one cluster: exact tokens across the boundary (never over shared
memory), CURVE refusing a keyless peer on another node, scaling that adds a decode worker
on the other decode node, the prefill node's link cut in the middle of transfers, the loss
of a whole decode node, and then gloo (`--transport torch`) and Mooncake's Transfer Engine
over TCP (`--transport mooncake`) between nodes.
"""

from __future__ import annotations

import importlib.util
import json
import re
import signal
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from engine import LLM, apply_chat_template
from kv_transfer.config import TransferConfig
from protocol.status import WorkerStatus, workers
from router.client import PdClusterClient
from tests.conftest import SMOL_CHATS, hf_greedy
from tests.multinode import netns

pytestmark = [pytest.mark.multinode, pytest.mark.slow, pytest.mark.e2e]

WHY_NOT = netns.unavailable()

API_KEY, ADMIN_KEY = "sk-user-multinode", "sk-admin-multinode"
GRPC_PORT, HTTP_PORT = 50051, 8000
# Ray nodes: the head runs the front door only; the pools go where their resource is.
NODES = {"head": {}, "pf": {"prefill_host": 1}, "d1": {"decode_host": 1},
         "d2": {"decode_host": 1}}
CPUS = {"head": 0, "pf": 1, "d1": 1, "d2": 1}  # one worker per node
READY = re.compile(r"gRPC (\S+)\s+OpenAI (\S+)/v1")
LONG = [(7 * i) % 4000 + 300 for i in range(1200)]  # prompts are cut from it


class Cluster:
    """The hosts, their Ray cluster, and the `pdcluster serve` running on the head."""

    def __init__(self, hosts: netns.Hosts) -> None:
        self.hosts = hosts
        self.head = hosts["head"].ip
        self.serve_proc = None
        self.grpc = f"{self.head}:{GRPC_PORT}"

    def start_ray(self) -> None:
        ray = [str(Path(sys.executable).parent / "ray"), "start", "--disable-usage-stats"]
        self.hosts.run("head", [*ray, "--head", f"--node-ip-address={self.head}",
                                "--port=6379", "--num-cpus=0", "--include-dashboard=false"])
        starts = [self.hosts.popen(name, [
            *ray, f"--address={self.head}:6379", f"--node-ip-address={self.hosts[name].ip}",
            f"--num-cpus={CPUS[name]}", f"--resources={json.dumps(NODES[name])}"], "ray.log")
            for name in NODES if name != "head"]
        for proc in starts:
            assert proc.wait(120) == 0, "a Ray worker node did not start"
        # One Ray client on the head, polling until every node has joined (a client per
        # poll would start a Python process and connect each time).
        out = self.hosts.run("head", [sys.executable, "-c", (
            "import time, ray; ray.init(address='auto', logging_level='ERROR')\n"
            "deadline = time.monotonic() + 120\n"
            f"while sum(n['Alive'] for n in ray.nodes()) < {len(NODES)} "
            "and time.monotonic() < deadline:\n"
            "    time.sleep(0.2)\n"
            "print(sum(n['Alive'] for n in ray.nodes()))")], timeout_s=180).stdout
        assert int(out.split()[-1]) == len(NODES), "the Ray nodes did not all join"

    def serve(self, *flags: str, timeout_s: float = 300.0) -> None:
        """`pdcluster serve` on the head, joined to the Ray cluster, ready for clients."""
        log = self.hosts["head"].dir / "serve.log"
        start = log.stat().st_size if log.exists() else 0
        self.serve_proc = self.hosts.popen("head", [
            sys.executable, "-m", "commands.cli", "serve", "--model", "smollm2",
            "--address", f"{self.head}:6379", "--host", self.head,
            "--grpc-port", str(GRPC_PORT), "--http-port", str(HTTP_PORT),
            "--api-key", API_KEY, "--admin-key", ADMIN_KEY, "--kv-cache-gb", "0.25",
            "--dtype", "float32", "--local-prefill-threshold", "0",
            "--prefill-resource", "prefill_host", "--decode-resource", "decode_host", *flags],
            "serve.log")
        deadline = time.monotonic() + timeout_s
        while not READY.search(log.read_text()[start:]):
            if self.serve_proc.poll() is not None or time.monotonic() > deadline:
                raise AssertionError("serve did not start:\n" + log.read_text()[start:][-3000:])
            time.sleep(0.2)

    def stop_serve(self) -> None:
        if self.serve_proc is not None and self.serve_proc.poll() is None:
            self.hosts.signal(self.serve_proc, signal.SIGINT)
            self.serve_proc.wait(60)

    def serve_log(self) -> str:
        return (self.hosts["head"].dir / "serve.log").read_text()

    def client(self, timeout: float = 300) -> PdClusterClient:
        return PdClusterClient(self.grpc, timeout=timeout, api_key=API_KEY, admin_key=ADMIN_KEY)

    def workers(self) -> list[WorkerStatus]:
        with self.client(timeout=30) as client:
            return workers(client.status())

    def counter(self, name: str) -> list[tuple[dict[str, str], float]]:
        """The front door's `pdcluster:NAME_total` samples: (labels, value)."""
        text = httpx.get(f"http://{self.head}:{HTTP_PORT}/metrics", timeout=30,
                         headers={"authorization": f"Bearer {API_KEY}"}).text
        return [(s.labels, s.value) for family in text_string_to_metric_families(text)
                for s in family.samples if s.name == f"pdcluster:{name}_total"]

    def transfer_bytes(self) -> dict[str, float]:
        """KV bytes shipped so far, by transport."""
        return {labels["transport"]: value for labels, value in self.counter("kv_transfer_bytes")}

    def wait_pools_free(self, timeout_s: float = 60.0) -> list[WorkerStatus]:
        """Every live worker idle with its whole KV pool free (prefix-cached blocks count
        as free); fails naming the workers otherwise."""
        deadline = time.monotonic() + timeout_s
        while True:
            ws = self.workers()
            if ws and all(w.num_free_blocks == w.num_blocks and not w.num_running
                          and not w.num_parked and not w.in_flight for w in ws):
                return ws
            if time.monotonic() > deadline:
                raise AssertionError(f"KV pools not free: {ws}")
            time.sleep(0.3)


@pytest.fixture(scope="module")
def cluster() -> Iterator[Cluster]:
    # Each test skips here (a failure in CI, tests/conftest.py), not the module at import:
    # every test that could not run is named.
    if WHY_NOT is not None:
        pytest.skip(f"multi-node tests need network namespaces: {WHY_NOT}")
    hosts = netns.Hosts(list(NODES))
    try:
        c = Cluster(hosts)
        c.start_ray()
        c.serve()
        yield c
        c.stop_serve()
    finally:
        hosts.close()


def _greedy(c: Cluster, n: int, **prompt) -> tuple[list[int], str | None, str | None]:
    """(tokens, finish_reason, error) of one greedy request over gRPC."""
    tokens: list[int] = []
    finish = error = None
    with c.client() as client:
        for out in client.generate(**prompt, max_tokens=n, temperature=0.0, ignore_eos=True):
            tokens += out.token_ids
            finish, error = out.finish_reason or finish, out.error or error
    return tokens, finish, error


def _ip(c: Cluster, name: str) -> str:
    return c.hosts[name].ip


def test_pd_across_nodes_matches_transformers_over_zmq(cluster: Cluster, smollm2: LLM) -> None:
    ws = cluster.workers()
    assert sorted(w.role for w in ws) == ["decode", "prefill"]
    assert {w.role: w.host for w in ws}["prefill"] == _ip(cluster, "pf")
    assert {w.role: w.host for w in ws}["decode"] in (_ip(cluster, "d1"), _ip(cluster, "d2"))
    assert "Internal sockets: CURVE" in cluster.serve_log()  # auto: more than one node
    for content in SMOL_CHATS:
        messages = [{"role": "user", "content": content}]
        tokens, finish, _ = _greedy(cluster, 24, messages=messages)
        reference = hf_greedy("smollm2", apply_chat_template(smollm2.tokenizer, messages), 24)
        assert (tokens, finish) == (reference, "length")
    # Shared memory is never picked between hosts: every byte went over zmq.
    shipped = cluster.transfer_bytes()
    assert set(shipped) == {"zmq"} and shipped["zmq"] > 0
    cluster.wait_pools_free()
    # One log line per request, naming the workers on both hosts and never the text.
    ids = {w.role: w.worker_id for w in ws}
    lines = [line for line in cluster.serve_log().splitlines() if "pdcluster.requests" in line]
    assert len(lines) == len(SMOL_CHATS)
    assert all(f"workers={ids['decode']},{ids['prefill']}" in line and "status=length" in line
               and SMOL_CHATS[0] not in line for line in lines)


def test_curve_refuses_a_keyless_peer_on_another_node(cluster: Cluster) -> None:
    decode = next(w for w in cluster.workers() if w.role == "decode")
    probe = ("import sys, zmq\n"
             "from tests.rogue import FAILED, Rogue\n"
             "for endpoint, kind in ((sys.argv[1], zmq.PUSH), (sys.argv[2], zmq.DEALER)):\n"
             "    with Rogue(endpoint, kind, None) as rogue:\n"
             "        rogue.send(b'forged')\n"
             "        print(endpoint, rogue.handshake() in FAILED)\n")
    out = cluster.hosts.run("d2", [sys.executable, "-c", probe, decode.endpoint,
                                   decode.kv_endpoint]).stdout.split()
    assert out == [decode.endpoint, "True", decode.kv_endpoint, "True"]
    tokens, finish, _ = _greedy(cluster, 8, prompt_token_ids=LONG[:200])
    assert (tokens, finish) == (hf_greedy("smollm2", LONG[:200], 8), "length")


def test_scaling_up_adds_a_decode_worker_on_the_other_node(cluster: Cluster) -> None:
    with cluster.client() as client:
        client.scale(decode=2)
    hosts = sorted(w.host for w in cluster.workers() if w.role == "decode")
    assert hosts == sorted([_ip(cluster, "d1"), _ip(cluster, "d2")])  # one CPU per node
    cluster.wait_pools_free()


def test_link_cut_mid_transfer_fails_over_with_exact_tokens_and_leaks_nothing(
        cluster: Cluster) -> None:
    _cut_the_prefill_link_mid_transfer(cluster, "zmq")


def _cut_the_prefill_link_mid_transfer(cluster: Cluster, transport: str) -> None:
    """The prefill node's only link goes down while long prompts are prefilled and shipped,
    and comes back once the router has heard nothing from that node for longer than the
    transfers' peer timeout (both ends of every transfer it had in flight have declared the
    other lost by then; Ray's node-death timeout is far longer). A request whose transfer
    failed is prefilled again, once, on its decode worker (a second failure would end it
    in error), so every request ends with the reference tokens: the retries number at
    least one (the cut hit the transfers of the requests already on the prefill worker)
    and at most one per request. No KV block stays held on either side, and long prompts
    are prefilled remotely again."""
    prompts = [(LONG[i:] + LONG[:i])[:400] for i in (0, 100, 200)]  # ~2.5 s of prefill each
    results: list[tuple[list[int], str | None, str | None]] = [([], None, None)] * 3
    silent_s = TransferConfig().peer_timeout_s + 1.0  # and a stats interval or two

    def run(i: int) -> None:
        results[i] = _greedy(cluster, 8, prompt_token_ids=prompts[i])

    threads = [threading.Thread(target=run, args=(i,)) for i in range(3)]
    for t in threads:
        t.start()
    # The router's own view (not the workers' periodic stats): a request is on the prefill
    # worker from its placement there until its KV has landed on the decode worker.
    deadline = time.monotonic() + 60
    while not any(w.role == "prefill" and w.in_flight for w in cluster.workers()):
        assert time.monotonic() < deadline, "no request reached the prefill worker"
        time.sleep(0.02)
    retries = _total(cluster, "transfer_retries")
    cluster.hosts.set_link("pf", up=False)
    try:
        deadline = time.monotonic() + 60
        while next(w for w in cluster.workers() if w.role == "prefill").stats_age_s < silent_s:
            assert time.monotonic() < deadline, "the prefill node's stats kept coming"
            time.sleep(0.2)
    finally:
        cluster.hosts.set_link("pf", up=True)
    for t in threads:
        t.join(300)
        assert not t.is_alive(), "a request did not end"
    for prompt, (tokens, finish, error) in zip(prompts, results, strict=True):
        assert (finish, error) == ("length", None)
        assert tokens == hf_greedy("smollm2", prompt, 8)
    assert 1 <= _total(cluster, "transfer_retries") - retries <= len(prompts)
    cluster.wait_pools_free()
    before = cluster.transfer_bytes().get(transport, 0.0)
    tokens, finish, _ = _greedy(cluster, 8, prompt_token_ids=LONG[700:1000])
    assert (tokens, finish) == (hf_greedy("smollm2", LONG[700:1000], 8), "length")
    assert cluster.transfer_bytes()[transport] > before  # the prefill node serves again
    cluster.wait_pools_free()


def _total(cluster: Cluster, name: str) -> float:
    return sum(value for _, value in cluster.counter(name))


def test_losing_a_decode_node_resumes_its_streams_elsewhere(cluster: Cluster) -> None:
    """Four streams decode on the two decode nodes. Both nodes hang (every process stopped),
    so what each holds is fixed; the one holding more is then lost (killed) and the other
    goes on. Each stream the lost node held is placed again exactly once on the other (the
    migrations counter grows by exactly that many), and every stream ends with the
    reference tokens; the lost node's replacement has no node to go to."""
    prompts = [LONG[i:i + 120] for i in range(0, 480, 120)]
    results: list[tuple[list[int], str | None, str | None]] = [([], None, None)] * 4
    first: list[threading.Event] = [threading.Event() for _ in prompts]

    def run(i: int) -> None:
        tokens: list[int] = []
        finish = error = None
        with cluster.client() as client:
            for out in client.generate(prompt_token_ids=prompts[i], max_tokens=40,
                                       temperature=0.0, ignore_eos=True):
                tokens += out.token_ids
                if tokens:
                    first[i].set()
                finish, error = out.finish_reason or finish, out.error or error
        results[i] = (tokens, finish, error)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for event in first:
        assert event.wait(120), "a stream produced no token"
    migrations = _total(cluster, "migrations")
    nodes = ("d1", "d2")
    for name in nodes:
        cluster.hosts.pause(name)
    try:
        held = {w.host: w.in_flight for w in cluster.workers() if w.role == "decode"}
        lost = max(nodes, key=lambda name: held.get(_ip(cluster, name), 0))
        cluster.hosts.kill(lost)
    finally:
        for name in nodes:
            if cluster.hosts[name].alive:
                cluster.hosts.pause(name, paused=False)
    for t in threads:
        t.join(300)
        assert not t.is_alive(), "a stream did not end"
    for prompt, (tokens, finish, error) in zip(prompts, results, strict=True):
        assert (finish, error) == ("length", None)
        assert tokens == hf_greedy("smollm2", prompt, 40)
    assert held[_ip(cluster, lost)] >= 1
    assert _total(cluster, "migrations") - migrations == held[_ip(cluster, lost)]
    ws = cluster.wait_pools_free(timeout_s=120)
    assert [w.role for w in ws if w.host == _ip(cluster, lost)] == []
    assert [w.role for w in ws].count("decode") == 1  # its replacement has no node to go to


def test_gloo_between_nodes_matches_transformers(cluster: Cluster) -> None:
    cluster.stop_serve()
    cluster.serve("--transport", "torch", "--decode", "1")
    ws = cluster.workers()
    assert {w.role: w.host for w in ws}["prefill"] == _ip(cluster, "pf")
    assert sorted(w.role for w in ws) == ["decode", "prefill"]
    tokens, finish, _ = _greedy(cluster, 16, prompt_token_ids=LONG[:400])
    assert (tokens, finish) == (hf_greedy("smollm2", LONG[:400], 16), "length")
    shipped = cluster.transfer_bytes()
    assert set(shipped) == {"torch_dist"} and shipped["torch_dist"] > 0
    cluster.wait_pools_free()


@pytest.mark.skipif(importlib.util.find_spec("mooncake") is None,
                    reason="the mooncake extra is not installed: pip install 'pdcluster[mooncake]'")
def test_mooncake_between_nodes_matches_transformers(cluster: Cluster) -> None:
    cluster.stop_serve()
    cluster.serve("--transport", "mooncake", "--mooncake-protocol", "tcp", "--decode", "1")
    ws = cluster.workers()
    assert {w.role: w.host for w in ws}["prefill"] == _ip(cluster, "pf")
    assert {w.role: w.host for w in ws}["decode"] != _ip(cluster, "pf")
    tokens, finish, _ = _greedy(cluster, 16, prompt_token_ids=LONG[:400])
    assert (tokens, finish) == (hf_greedy("smollm2", LONG[:400], 16), "length")
    shipped = cluster.transfer_bytes()
    assert set(shipped) == {"mooncake"} and shipped["mooncake"] > 0
    cluster.wait_pools_free()
    # A write blocked by the cut lands when the link is back unless the decode side has
    # unregistered its request's blocks by then (kv_transfer/transports/mooncake.py).
    _cut_the_prefill_link_mid_transfer(cluster, "mooncake")
