"""KV-transfer benchmark: every transport between two processes, against its peers, in one run.

    python -m experiments.kv_bench [--sizes-mb 1 4 16 64 256] [--repeats 10]

A receiver process offers shm, zmq, torch_dist and mooncake (tcp unless the host has an RDMA
device) on one shared-memory pool, zmq once more with the cluster's CURVE key (`zmq_curve`:
encrypted, what `--internal-auth curve` costs), plus a plain TCP socket that `recv_into`s
the same pool. This process sends each size over each of them and copies the same bytes in-process
with `torch.copy_` (one thread), in rounds that run every method once (`--repeats`
rounds after a warm-up). Bandwidths are medians over rounds; a ratio is the median over
rounds of the two methods' times in that round, so bursts of load on a shared machine hit
both sides; the headline ratios are the worst over sizes of at least 16 MiB. A transfer is
timed from `begin` to the acknowledged `TransferDone` and moves all layers of consecutive
blocks. One-block latency is the median over `--latency-repeats` one-block requests.
Results go to experiments/results/kv_transfer.json and a table on the terminal.

    python -m experiments.kv_bench --cross-host   # root: two hosts joined by a veth bridge

With `--cross-host` the receiver runs in one network namespace and this process in another
(`tests/multinode/netns.py`, the multi-node tests' hosts), so every byte crosses a veth
pair and a bridge as it would cross a link between hosts: zmq, zmq under CURVE, gloo and
mooncake against a raw socket over the same path (no shm), then the exposed transfer
between real SmolLM2 workers on two hosts. Results go to
experiments/results/kv_transfer_cross_host.json.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import json
import multiprocessing as mp
import os
import platform
import socket
import statistics
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import xxhash

from engine.hardware import cpu_paths
from engine.kv_cache import KVCache
from experiments import RESULTS, kv_exposed
from kv_transfer import (
    TRANSPORTS,
    CompatRecord,
    KVReceiver,
    KVSender,
    SharedKVPool,
    TransferConfig,
    TransferDone,
)
from kv_transfer.blocks import as_bytes
from protocol.secure import ClusterKey

# A small model's geometry: 64 KiB per block and layer, 512 KiB per block.
GEOMETRY = {"num_layers": 8, "block_size": 16, "num_kv_heads": 8, "head_dim": 64}
DTYPE = torch.float32
MIB = 1 << 20
OUT = RESULTS / "kv_transfer.json"
TARGETS = {"same_host_over_memcpy": 0.5, "zmq_tcp_over_raw_socket": 0.8,
           "mooncake_tcp_over_raw_socket": 0.8, "exposed_transfer_share_2048": 0.02}


def make_kv(num_blocks: int, allocator: Any = None) -> KVCache:
    return KVCache(num_blocks=num_blocks, dtype=DTYPE, allocator=allocator, **GEOMETRY)


def compat(kv: KVCache) -> CompatRecord:
    return CompatRecord.from_kv_cache(kv, "kv-bench")


CROSS_HOST_TRANSPORTS = ("zmq", "torch_dist", "mooncake")  # shared memory does not cross hosts


def settings(key: ClusterKey | None = None, host: str = "127.0.0.1",
             transports: tuple[str, ...] = TRANSPORTS) -> TransferConfig:
    """`transports` unkeyed; with `key`, zmq alone under CURVE."""
    return TransferConfig(transports=transports if key is None else ("zmq",), host=host,
                          request_timeout_s=120.0, cluster_key=key)


def layer_digests(kv: KVCache, num_blocks: int) -> list[int]:
    return [xxhash.xxh3_64_intdigest(as_bytes(layer[:num_blocks])) for layer in kv.layers]


# ---- receiver process ----

def serve_raw(server: socket.socket, dst: memoryview) -> None:
    """Plain TCP peer: an 8-byte length, that many bytes straight into `dst`, one-byte ack."""
    conn, _ = server.accept()
    conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    with conn:
        while header := conn.recv(8, socket.MSG_WAITALL):
            size, got = int.from_bytes(header, "little"), 0
            while got < size:
                got += conn.recv_into(dst[got:size])
            conn.sendall(b"k")


def receiver_process(conn: Any, num_blocks: int, key: ClusterKey,
                     host: str = "127.0.0.1", netns_pid: int | None = None) -> None:
    """The receiving host: every transport into one pool (shm only when on this host)."""
    if netns_pid is not None:
        from tests.multinode.netns import enter_netns

        enter_netns(netns_pid)
    transports = TRANSPORTS if netns_pid is None else CROSS_HOST_TRANSPORTS
    pool = SharedKVPool() if "shm" in transports else None
    kv = make_kv(num_blocks, allocator=pool)
    server = socket.create_server((host, 0))
    threading.Thread(target=serve_raw, args=(server, as_bytes(kv.buffer)), daemon=True).start()
    with KVReceiver(kv, compat(kv), settings(host=host, transports=transports),
                    shm_pool=pool) as rx, \
            KVReceiver(kv, compat(kv), settings(key, host)) as secure_rx:
        conn.send({"peer_info": rx.peer_info(), "secure_peer_info": secure_rx.peer_info(),
                   "raw": server.getsockname()[:2]})
        while (cmd := conn.recv())[0] != "exit":
            rx.poll()
            secure_rx.poll()
            if cmd[0] == "expect":
                (secure_rx if cmd[3] == "zmq_curve" else rx).expect(cmd[1], range(cmd[2]))
                conn.send("ok")
            elif cmd[0] == "clear":
                kv.buffer.zero_()
                conn.send("ok")
            elif cmd[0] == "digests":
                conn.send(layer_digests(kv, cmd[1]))


# ---- sender side ----

class Bench:
    """This process's ends: a KVSender connected over every transport, one keyed sender
    (zmq under CURVE), and a raw socket."""

    def __init__(self, conn: Any, num_blocks: int, key: ClusterKey, host: str = "127.0.0.1",
                 transports: tuple[str, ...] = TRANSPORTS) -> None:
        self.conn = conn
        self.kv = make_kv(num_blocks)
        self.kv.buffer.copy_(torch.randn(self.kv.buffer.shape))
        hello = conn.recv()
        self.tx = KVSender(self.kv, compat(self.kv), settings(host=host))
        self.secure_tx = KVSender(self.kv, compat(self.kv), settings(key, host))
        self.peers = {t: (self.tx, self.tx.connect(hello["peer_info"], t)) for t in transports}
        self.peers["zmq_curve"] = (self.secure_tx,
                                   self.secure_tx.connect(hello["secure_peer_info"], "zmq"))
        self.raw = socket.create_connection(tuple(hello["raw"]))
        self.raw.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.copy_dst = torch.empty_like(self.kv.buffer.view(-1).view(torch.uint8))
        self._ids = 0

    def ask(self, *cmd: Any) -> Any:
        self.conn.send(cmd)
        return self.conn.recv()

    def transfer(self, transport: str, num_blocks: int) -> float:
        """Seconds from begin to the acknowledged TransferDone of `num_blocks` blocks."""
        self._ids += 1
        rid = f"bench-{self._ids}"
        self.ask("expect", rid, num_blocks, transport)
        tx, peer_id = self.peers[transport]
        start = time.perf_counter()
        tx.begin(rid, peer_id, range(num_blocks), range(num_blocks))
        for layer in range(self.kv.num_layers):
            tx.send_layer(rid, layer)
        tx.finish(rid)
        events = tx.wait_events(120.0)
        elapsed = time.perf_counter() - start
        if events != [TransferDone(rid)]:
            raise RuntimeError(f"{transport} transfer failed: {events}")
        return elapsed

    def raw_socket(self, nbytes: int) -> float:
        start = time.perf_counter()
        self.raw.sendall(nbytes.to_bytes(8, "little"))
        self.raw.sendall(as_bytes(self.kv.buffer)[:nbytes])
        if self.raw.recv(1) != b"k":
            raise RuntimeError("raw socket peer went away")
        return time.perf_counter() - start

    def memcpy(self, nbytes: int) -> float:
        src = self.kv.buffer.view(-1).view(torch.uint8)[:nbytes]
        start = time.perf_counter()
        self.copy_dst[:nbytes].copy_(src)
        return time.perf_counter() - start

    def methods(self, num_blocks: int) -> dict[str, Callable[[], float]]:
        nbytes = num_blocks * self.block_bytes
        timed = {t: (lambda t=t: self.transfer(t, num_blocks)) for t in self.peers}
        return {"memcpy": lambda: self.memcpy(nbytes),
                "raw_socket": lambda: self.raw_socket(nbytes), **timed}

    @property
    def block_bytes(self) -> int:
        return self.kv.num_layers * self.kv.block_bytes

    def verify(self, num_blocks: int) -> dict[str, bool]:
        """Whether each transport really delivered the bytes (largest size)."""
        want = layer_digests(self.kv, num_blocks)
        ok = {}
        for transport in self.peers:
            self.ask("clear")
            self.transfer(transport, num_blocks)
            ok[transport] = self.ask("digests", num_blocks) == want
        return ok

    def close(self) -> None:
        self.tx.close()
        self.secure_tx.close()
        self.raw.close()


Times = dict[str, dict[str, list[float]]]  # method -> size in MiB -> seconds per round


def bandwidth_rounds(bench: Bench, sizes_mb: list[int], repeats: int) -> Times:
    """Seconds per method, size and round; each round runs every method once, in turn."""
    times: Times = {}
    for size in sizes_mb:
        methods = bench.methods(size * MIB // bench.block_bytes)
        for round_ in range(repeats + 1):
            for name, run in methods.items():
                seconds = run()
                if round_:  # round 0 warms up pages and connections
                    times.setdefault(name, {}).setdefault(str(size), []).append(seconds)
        print(f"{size:>5} MiB  " + "  ".join(
            f"{n} {size * MIB / statistics.median(times[n][str(size)]) / 1e9:6.2f}"
            for n in methods))
    return times


def paired_ratio(times: Times, num: str, den: str, size: str) -> float:
    """Median over rounds of `den` time / `num` time: robust to bursts of load."""
    return statistics.median(d / n for n, d in zip(times[num][size], times[den][size],
                                                   strict=True))


def ratios(times: Times, num: str, den: str) -> dict[str, float]:
    return {size: paired_ratio(times, num, den, size) for size in times[num]}


def ratio_spread(times: Times, num: str, den: str) -> dict[str, list[float]]:
    """Per size, the lowest and highest per-round `den` time / `num` time."""
    return {size: [min(r), max(r)] for size in times[num]
            for r in [[d / n for n, d in zip(times[num][size], times[den][size], strict=True)]]}


def latency_us(bench: Bench, repeats: int) -> dict[str, float]:
    """Median microseconds to move one block (all layers) per transport."""
    methods = bench.methods(1)
    times: dict[str, list[float]] = {name: [] for name in methods if name != "memcpy"}
    for _ in range(repeats):
        for name in times:
            times[name].append(methods[name]())
    return {name: statistics.median(t) * 1e6 for name, t in times.items()}


def worst_at_least(per_size: dict[str, float], min_mb: int) -> float | None:
    """The lowest ratio over sizes of at least `min_mb` MiB (None if none was measured)."""
    return min((r for size, r in per_size.items() if int(size) >= min_mb), default=None)


def measure(bench: Bench, args: argparse.Namespace, num_blocks: int) -> dict[str, Any]:
    times = bandwidth_rounds(bench, args.sizes_mb, args.repeats)
    zmq_over_raw = ratios(times, "zmq", "raw_socket")
    mooncake_over_raw = ratios(times, "mooncake", "raw_socket")
    if args.cross_host:
        return {**common_results(bench, args, num_blocks, times),
                "ratios_by_size_mb": {"zmq_over_raw_socket": zmq_over_raw,
                                      "mooncake_over_raw_socket": mooncake_over_raw,
                                      "torch_dist_over_raw_socket": ratios(
                                          times, "torch_dist", "raw_socket"),
                                      "zmq_curve_over_raw_socket": ratios(
                                          times, "zmq_curve", "raw_socket")},
                "zmq_over_raw_socket_round_range": ratio_spread(times, "zmq", "raw_socket"),
                "mooncake_over_raw_socket_round_range": ratio_spread(times, "mooncake",
                                                                     "raw_socket"),
                "zmq_tcp_over_raw_socket": worst_at_least(zmq_over_raw, 16),
                "mooncake_tcp_over_raw_socket": worst_at_least(mooncake_over_raw, 16),
                "targets": TARGETS}
    shm_over_copy = ratios(times, "shm", "memcpy")
    return {
        **common_results(bench, args, num_blocks, times),
        "ratios_by_size_mb": {"shm_over_memcpy": shm_over_copy,
                              "zmq_over_raw_socket": zmq_over_raw,
                              "mooncake_over_raw_socket": mooncake_over_raw,
                              "torch_dist_over_raw_socket": ratios(times, "torch_dist",
                                                                   "raw_socket"),
                              "zmq_curve_over_zmq": ratios(times, "zmq_curve", "zmq")},
        "zmq_curve_over_zmq_round_range": ratio_spread(times, "zmq_curve", "zmq"),
        "mooncake_over_raw_socket_round_range": ratio_spread(times, "mooncake",
                                                             "raw_socket"),
        "same_host_over_memcpy": worst_at_least(shm_over_copy, 16),
        "zmq_tcp_over_raw_socket": worst_at_least(zmq_over_raw, 16),
        "mooncake_tcp_over_raw_socket": worst_at_least(mooncake_over_raw, 16),
        "targets": TARGETS,
    }


def common_results(bench: Bench, args: argparse.Namespace, num_blocks: int,
                   times: Times) -> dict[str, Any]:
    """Machine, geometry, bandwidths, one-block latency and the delivered bytes' check."""
    return {
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform(),
                    "cpu": cpu_paths().describe(), "torch": torch.__version__,
                    "load_average": os.getloadavg()},
        "path": "two network namespaces over a veth bridge" if args.cross_host
        else "two processes on one host",
        "geometry": {**GEOMETRY, "dtype": str(DTYPE), "block_bytes": bench.block_bytes},
        "bandwidth_gbps": {name: {size: int(size) * MIB / statistics.median(t) / 1e9
                                  for size, t in per_size.items()}
                           for name, per_size in times.items()},
        "one_block_latency_us": latency_us(bench, args.latency_repeats),
        "verified": bench.verify(num_blocks),
    }


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Run the benchmark, print a table, write experiments/results/kv_transfer.json.

    Args:
        argv: command line (defaults to sys.argv).

    Returns:
        The results written.
    """
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes-mb", type=int, nargs="+", default=[1, 4, 16, 64, 256])
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--latency-repeats", type=int, default=30)
    parser.add_argument("--out", type=Path, default=OUT,
                        help="default experiments/results/kv_transfer.json")
    parser.add_argument("--skip-exposed", action="store_true",
                        help="skip the SmolLM2 exposed-transfer measurement "
                             "(experiments.kv_exposed)")
    parser.add_argument("--cross-host", action="store_true",
                        help="receiver and sender on two hosts made of network namespaces "
                             "(root); writes experiments/results/kv_transfer_cross_host.json")
    args = parser.parse_args(argv)
    if args.cross_host and args.out == OUT:
        args.out = RESULTS / "kv_transfer_cross_host.json"
    # One thread copies at memory bandwidth already; two stall on each other whenever the
    # shared machine is busy (measured 5-20x slower then), which would flatter every ratio.
    torch.set_num_threads(1)
    num_blocks = max(args.sizes_mb) * MIB // (GEOMETRY["num_layers"] * make_kv(1).block_bytes)
    with contextlib.ExitStack() as stack:
        results = run(stack, args, num_blocks)
    if not args.skip_exposed:
        exposed = kv_exposed.measure([512, 2048], repeats=3, cross_host=args.cross_host)
        results["exposed_transfer"] = exposed
        results["exposed_transfer_share_2048"] = exposed["2048"]["share"]
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=2) + "\n")
    keys = ("one_block_latency_us", "verified", *TARGETS, "exposed_transfer_share_2048",
            "mooncake_over_raw_socket_round_range", "zmq_curve_over_zmq_round_range",
            "zmq_over_raw_socket_round_range")
    print(json.dumps({k: results.get(k) for k in keys}, indent=2))
    return results


def run(stack: contextlib.ExitStack, args: argparse.Namespace, num_blocks: int
        ) -> dict[str, Any]:
    """Start the receiver (on its host with `--cross-host`), measure, stop it."""
    ctx = mp.get_context("spawn")
    ours, theirs = ctx.Pipe()
    key = ClusterKey.generate()
    rx_host, tx_host, netns_pid, transports = "127.0.0.1", "127.0.0.1", None, TRANSPORTS
    if args.cross_host:
        from tests.multinode.netns import CLONE_NEWNET, Hosts, enter_netns, unavailable

        if (why := unavailable()) is not None:
            raise SystemExit(f"--cross-host needs network namespaces: {why}")
        hosts = Hosts(["rx", "tx"])
        stack.callback(hosts.close)
        # Back to this namespace before the hosts are removed (`ip` runs where we are).
        home = os.open("/proc/self/ns/net", os.O_RDONLY)
        stack.callback(os.close, home)
        stack.callback(lambda: ctypes.CDLL(None).setns(home, CLONE_NEWNET))
        rx_host, tx_host = hosts["rx"].ip, hosts["tx"].ip
        netns_pid, transports = hosts["rx"].init_pid, CROSS_HOST_TRANSPORTS
        enter_netns(hosts["tx"].init_pid)
    proc = ctx.Process(target=receiver_process,
                       args=(theirs, num_blocks, key, rx_host, netns_pid), daemon=True)
    proc.start()
    bench = Bench(ours, num_blocks, key, tx_host, transports)
    try:
        return measure(bench, args, num_blocks)
    finally:
        bench.close()
        ours.send(("exit",))
        proc.join(10)


if __name__ == "__main__":
    main()
