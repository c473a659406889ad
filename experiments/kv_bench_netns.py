"""KV transfer between two hosts: zmq and mooncake (tcp) against a raw socket, over a veth.

    sudo python -m experiments.kv_bench_netns [--sizes-mb 1 4 16 64] [--repeats 10]

Two hosts from the multi-node harness (`tests/multinode/netns.py`: network namespaces
joined by veth pairs and a bridge; needs root), a receiver on one and a sender on the
other, each a fresh process. The receiver offers zmq and mooncake on one pool and `expect`s
every planned transfer up front; a plain TCP socket `recv_into`s the same pool. The sender
runs each size in rounds that move it once over the raw socket and once over each transport
(`--repeats` rounds after a warm-up); a ratio is the median over rounds of the raw time over
the transport's time in that round, as in `experiments.kv_bench`. Results go to
experiments/results/kv_transfer_netns.json.
"""

from __future__ import annotations

import argparse
import json
import pickle
import socket
import statistics
import sys
import threading
import time
from pathlib import Path
from typing import Any

import torch

from experiments import RESULTS
from experiments.kv_bench import GEOMETRY, MIB, compat, make_kv, serve_raw
from kv_transfer import KVReceiver, KVSender, TransferConfig, TransferDone
from kv_transfer.blocks import as_bytes

OUT = RESULTS / "kv_transfer_netns.json"
TRANSPORTS = ("zmq", "mooncake")
BLOCK_BYTES = GEOMETRY["num_layers"] * make_kv(1).block_bytes


def settings(host: str) -> TransferConfig:
    return TransferConfig(transports=TRANSPORTS, host=host, request_timeout_s=900.0,
                          peer_timeout_s=30.0, mooncake_protocol="tcp")


def plan(sizes_mb: list[int], repeats: int) -> list[tuple[str, str, int]]:
    """(request id, transport, blocks) of every transfer, in the order they run."""
    return [(f"{t}-{size}-{r}", t, size * MIB // BLOCK_BYTES)
            for size in sizes_mb for r in range(repeats + 1) for t in TRANSPORTS]


def receiver(host: str, work: Path, sizes_mb: list[int], repeats: int) -> None:
    torch.set_num_threads(1)
    kv = make_kv(max(sizes_mb) * MIB // BLOCK_BYTES)
    server = socket.create_server((host, 0))
    threading.Thread(target=serve_raw, args=(server, as_bytes(kv.buffer)), daemon=True).start()
    with KVReceiver(kv, compat(kv), settings(host)) as rx:
        for rid, _, blocks in plan(sizes_mb, repeats):
            rx.expect(rid, range(blocks))
        (work / "peer.pkl").write_bytes(pickle.dumps((rx.peer_info(), server.getsockname())))
        while not (work / "done").exists():
            rx.poll()
            time.sleep(0.2)


def sender(host: str, work: Path, sizes_mb: list[int], repeats: int) -> None:
    torch.set_num_threads(1)
    info, raw_addr = pickle.loads((work / "peer.pkl").read_bytes())
    kv = make_kv(max(sizes_mb) * MIB // BLOCK_BYTES)
    kv.buffer.copy_(torch.randn(kv.buffer.shape))
    raw = socket.create_connection(raw_addr)
    raw.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    view = as_bytes(kv.buffer)
    times: dict[str, dict[str, list[float]]] = {}
    with KVSender(kv, compat(kv), settings(host)) as tx:
        peers = {t: tx.connect(info, t) for t in TRANSPORTS}
        for rid, transport, blocks in plan(sizes_mb, repeats):
            size, round_ = rid.split("-")[1:]
            if transport == TRANSPORTS[0]:
                start = time.perf_counter()
                raw.sendall((blocks * BLOCK_BYTES).to_bytes(8, "little"))
                raw.sendall(view[:blocks * BLOCK_BYTES])
                if raw.recv(1) != b"k":
                    raise RuntimeError("the raw socket's peer went away")
                if round_ != "0":  # round 0 warms up pages and connections
                    times.setdefault("raw_socket", {}).setdefault(size, []).append(
                        time.perf_counter() - start)
            start = time.perf_counter()
            tx.begin(rid, peers[transport], range(blocks), range(blocks))
            for layer in range(kv.num_layers):
                tx.send_layer(rid, layer)
            tx.finish(rid)
            events = tx.wait_events(300.0)
            if events != [TransferDone(rid)]:
                raise RuntimeError(f"{transport} transfer failed: {events}")
            if round_ != "0":
                times.setdefault(transport, {}).setdefault(size, []).append(
                    time.perf_counter() - start)
    (work / "times.json").write_text(json.dumps(times))


def summarize(times: dict[str, dict[str, list[float]]]) -> dict[str, Any]:
    raw = times["raw_socket"]
    return {
        "bandwidth_gbps": {name: {size: int(size) * MIB / statistics.median(t) / 1e9
                                  for size, t in per_size.items()}
                           for name, per_size in times.items()},
        "over_raw_socket": {t: {size: statistics.median(
            r / m for r, m in zip(raw[size], times[t][size], strict=True)) for size in raw}
            for t in TRANSPORTS},
        "over_raw_socket_round_range": {t: {size: [f(r / m for r, m in zip(
            raw[size], times[t][size], strict=True)) for f in (min, max)] for size in raw}
            for t in TRANSPORTS},
    }


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Run the benchmark between two namespace hosts; print and write the results."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes-mb", type=int, nargs="+", default=[1, 4, 16, 64])
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--out", type=Path, default=OUT)
    parser.add_argument("--role", choices=["receiver", "sender"], help=argparse.SUPPRESS)
    parser.add_argument("--host", help=argparse.SUPPRESS)
    parser.add_argument("--work", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.role:
        role = receiver if args.role == "receiver" else sender
        role(args.host, args.work, args.sizes_mb, args.repeats)
        return {}
    from tests.multinode import netns  # the harness; the product does not have it

    why_not = netns.unavailable()
    if why_not is not None:
        raise SystemExit(f"needs network namespaces: {why_not}")
    work = RESULTS / "kv_netns"  # outside /tmp, which each host has to itself
    work.mkdir(parents=True, exist_ok=True)
    for name in ("peer.pkl", "done", "times.json"):
        (work / name).unlink(missing_ok=True)
    hosts = netns.Hosts(["receiver", "sender"])
    try:
        def command(role: str) -> list[str]:
            return [sys.executable, "-m", "experiments.kv_bench_netns", "--role", role,
                    "--host", hosts[role].ip, "--work", str(work), "--repeats",
                    str(args.repeats), "--sizes-mb", *map(str, args.sizes_mb)]
        receiving = hosts.popen("receiver", command("receiver"), "receiver.log")
        deadline = time.monotonic() + 120
        while not (work / "peer.pkl").exists():
            if receiving.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError((hosts["receiver"].dir / "receiver.log").read_text()[-3000:])
            time.sleep(0.2)
        done = hosts.run("sender", command("sender"), timeout_s=1800)
        if not (work / "times.json").exists():
            raise RuntimeError(done.stdout[-3000:] + done.stderr[-3000:])
    finally:
        (work / "done").touch()
        hosts.close()
    results = {"sizes_mb": args.sizes_mb, "repeats": args.repeats,
               **summarize(json.loads((work / "times.json").read_text()))}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=2) + "\n")
    print(json.dumps({k: results[k] for k in ("over_raw_socket", "bandwidth_gbps")}, indent=2))
    return results


if __name__ == "__main__":
    main()
