"""The other process of the kv_transfer tests: a sender or a receiver driven over a Pipe.

Both sides build their pools from `make_kv`, so the test process can recompute exactly
what a child sent.
"""

from __future__ import annotations

import importlib.util
import multiprocessing as mp
import random
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest
import torch

from engine.kv_cache import KVCache
from engine.kv_quant import quantize
from kv_transfer.blocks import as_bytes
from kv_transfer.compat import CompatRecord
from kv_transfer.config import TRANSPORTS, TransferConfig
from kv_transfer.events import TransferEvent
from kv_transfer.receiver import KVReceiver
from kv_transfer.sender import KVSender
from kv_transfer.transports.shm import SharedKVPool
from protocol.kv import FirstToken

MODEL = "tiny-test-model"
NUM_LAYERS, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM = 4, 4, 2, 8
SENDER_BLOCKS, RECEIVER_BLOCKS = 48, 64
SEED = 1234

Plan = list[tuple[str, list[int], list[int]]]  # (request_id, src_block_ids, dst_block_ids)

# Skips only where the mooncake extra is not installed at all (the `dev` extra installs it,
# so CI runs these): an installed but broken engine fails the tests.
NEEDS_MOONCAKE = pytest.mark.skipif(
    importlib.util.find_spec("mooncake") is None,
    reason="the mooncake extra is not installed: pip install 'pdcluster[mooncake]'")
TRANSPORT_PARAMS = [pytest.param(t, marks=[NEEDS_MOONCAKE] if t == "mooncake" else [])
                    for t in TRANSPORTS]


def make_kv(num_blocks: int, seed: int | None = None, allocator: Any = None,
            block_size: int = BLOCK_SIZE, kv_cache_dtype: str = "auto") -> KVCache:
    """A bfloat16 (or int8) pool: zeros, or seeded random contents (same in every process;
    int8 pages hold quantized random rows with their scales)."""
    kv = KVCache(NUM_LAYERS, num_blocks, block_size, NUM_KV_HEADS, HEAD_DIM, torch.bfloat16,
                 allocator=allocator, kv_cache_dtype=kv_cache_dtype)
    if seed is not None:
        gen = torch.Generator().manual_seed(seed)
        values = torch.randn(*kv.buffer.shape[:-1], HEAD_DIM, generator=gen)
        kv.buffer.copy_(quantize(values) if kv.quantized else values)
    return kv


def compat_of(kv: KVCache) -> CompatRecord:
    return CompatRecord.from_kv_cache(kv, MODEL)


def config(transport: str, **overrides: Any) -> TransferConfig:
    """Short heartbeats so lost peers are noticed within seconds, with a peer timeout long
    enough that a loaded machine's scheduling hiccups are not taken for a lost peer."""
    settings = {"transports": (transport,), "verify_checksums": True, "heartbeat_s": 0.2,
                "peer_timeout_s": 5.0, "request_timeout_s": 60.0, **overrides}
    return TransferConfig(**settings)


def make_plan(seed: int = 7) -> Plan:
    """Requests of assorted sizes: scattered blocks, one fully consecutive, one of 1 block."""
    rng = random.Random(seed)
    dst_pool = rng.sample(range(RECEIVER_BLOCKS - 8), RECEIVER_BLOCKS - 8)
    plan: Plan = [("contiguous", list(range(10, 16)), list(range(RECEIVER_BLOCKS - 6,
                                                                RECEIVER_BLOCKS)))]
    for i, n in enumerate([1, 2, 5, 8, 3, 12]):
        dst, dst_pool = dst_pool[:n], dst_pool[n:]
        plan.append((f"req-{i}", rng.sample(range(SENDER_BLOCKS), n), dst))
    return plan


class CorruptingSender(KVSender):
    """Flips a byte of a source block after hashing it, so bytes and checksum disagree."""

    def _layer_sums(self, layer: int, block_ids: list[int]) -> list[int]:
        sums = super()._layer_sums(layer, block_ids)
        if layer == 1:
            as_bytes(self.kv.layers[layer][block_ids[0]])[0] ^= 0xFF
        return sums


class NotingReceiver(KVReceiver):
    """A receiver that lets a test wait until layers have landed (instead of sleeping)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._landed_layers: dict[str, int] = {}
        self._cond = threading.Condition()

    def _landed(self, req: Any, layer: int, error: str | None) -> None:
        super()._landed(req, layer, error)
        with self._cond:
            self._landed_layers[req.request_id] = self._landed_layers.get(req.request_id, 0) + 1
            self._cond.notify_all()

    def wait_landed(self, request_id: str, num_layers: int, timeout_s: float = 30.0) -> bool:
        """True once `num_layers` layers of `request_id` are in place."""
        with self._cond:
            return self._cond.wait_for(
                lambda: self._landed_layers.get(request_id, 0) >= num_layers, timeout_s)


def collect(endpoint: KVSender | KVReceiver, count: int, timeout_s: float = 20.0
            ) -> list[TransferEvent]:
    """Wait for `count` events (fewer if `timeout_s` passes)."""
    events: list[TransferEvent] = []
    deadline = time.monotonic() + timeout_s
    while len(events) < count and time.monotonic() < deadline:
        events += endpoint.wait_events(deadline - time.monotonic())
    return events


def run_plan(tx: KVSender, peer_id: str, plan: Plan) -> list[TransferEvent]:
    """Begin every request, interleave their layers (many in flight), finish, wait."""
    for rid, src, dst in plan:
        tx.begin(rid, peer_id, src, dst)
    for layer in range(NUM_LAYERS):
        for rid, _, _ in plan:
            tx.send_layer(rid, layer)
    for i, (rid, _, _) in enumerate(plan):
        tx.finish(rid, FirstToken(token_id=i))
    return collect(tx, len(plan))


def sender_main(conn: Any, transport: str, corrupt: bool = False,
                kv_cache_dtype: str = "auto") -> None:
    """Child: a sender with the seeded pool, obeying commands from the test."""
    kv = make_kv(SENDER_BLOCKS, seed=SEED, kv_cache_dtype=kv_cache_dtype)
    cls = CorruptingSender if corrupt else KVSender
    with cls(kv, compat_of(kv), config(transport)) as tx:
        while (cmd := conn.recv())[0] != "exit":
            if cmd[0] == "connect":
                conn.send(tx.connect(cmd[1], transport))
            elif cmd[0] == "run":
                conn.send(run_plan(tx, cmd[1], cmd[2]))
            elif cmd[0] == "start":  # begin and send some layers, then stall
                _, peer_id, rid, src, dst, num_layers = cmd
                tx.begin(rid, peer_id, src, dst)
                for layer in range(num_layers):
                    tx.send_layer(rid, layer)
                conn.send("started")  # the test waits on the receiver for the layers


def receiver_main(conn: Any, transport: str) -> None:
    """Child: a receiver (pool in shared memory for shm) obeying commands from the test."""
    pool = SharedKVPool() if transport == "shm" else None
    kv = make_kv(RECEIVER_BLOCKS, allocator=pool)
    with NotingReceiver(kv, compat_of(kv), config(transport), shm_pool=pool) as rx:
        conn.send(rx.peer_info())
        while (cmd := conn.recv())[0] != "exit":
            if cmd[0] == "expect":
                rx.expect(cmd[1], cmd[2])
                conn.send("ok")
            elif cmd[0] == "wait_landed":
                conn.send(rx.wait_landed(cmd[1], cmd[2]))
            elif cmd[0] == "events":
                conn.send(collect(rx, cmd[1]))
            elif cmd[0] == "nonzero":  # (layer, block) pairs holding any non-zero byte
                conn.send([(layer, b) for layer in range(NUM_LAYERS)
                           for b in range(RECEIVER_BLOCKS) if kv.buffer[layer, b].any()])


def _context() -> Any:
    """Children fork from a server process that imported torch and the KV packages once
    (about 2 s that every spawned child paid again); each is still a fresh process, with
    nothing of the test process's threads, sockets or state. The server gets neither the
    test process's sys.path nor its main module (Python 3.11), so what it preloads must be
    importable from the working directory (the repository root); anything else is imported
    by each child, as before."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["torch", "engine.kv_cache", "kv_transfer"])
    return ctx


@contextmanager
def child(target: Any, *args: Any) -> Iterator[tuple[mp.Process, Any]]:
    """A child process (forked from the preloaded server) and our end of its pipe; killed
    on exit if still running."""
    ctx = _context()
    ours, theirs = ctx.Pipe()
    proc = ctx.Process(target=target, args=(theirs, *args), daemon=True)
    proc.start()
    try:
        yield proc, ours
    finally:
        if proc.is_alive():
            ours.send(("exit",))
            proc.join(5)
        if proc.is_alive():
            proc.kill()
            proc.join(5)


def ask(conn: Any, *cmd: Any, timeout_s: float = 30.0) -> Any:
    """Send a command to a child and wait for its answer."""
    if cmd:
        conn.send(cmd)
    if not conn.poll(timeout_s):
        raise TimeoutError(f"child did not answer {cmd[:1]} within {timeout_s}s")
    return conn.recv()
