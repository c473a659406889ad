"""The shared KV pool cannot outlive its users, even when its owner is SIGKILLed."""

from __future__ import annotations

import gc
import os
import time

import pytest
from kv_peer import (
    SEED,
    SENDER_BLOCKS,
    ask,
    child,
    collect,
    compat_of,
    config,
    make_kv,
    receiver_main,
)

from kv_transfer import KVSender, SharedKVPool, TransferFailed


def shared_mappings(pid: int | str = "self") -> list[str]:
    """Lines of /proc/<pid>/maps that map a pdcluster KV pool."""
    with open(f"/proc/{pid}/maps") as f:
        return [line for line in f if "memfd:pdcluster-kv" in line]


def test_pool_is_zeroed_nameless_and_freed_with_its_users() -> None:
    before = set(os.listdir("/dev/shm"))
    pool = SharedKVPool()
    kv = make_kv(8, allocator=pool)
    assert not kv.buffer.any()
    assert len(shared_mappings()) == 1
    assert set(os.listdir("/dev/shm")) == before  # no name anywhere that could leak
    pool.close()
    del kv
    gc.collect()
    assert shared_mappings() == []


@pytest.mark.subprocess
def test_segment_is_gone_after_its_owner_is_sigkilled() -> None:
    kv = make_kv(SENDER_BLOCKS, seed=SEED)
    # Its owner's death is noticed after 2 s of silence (the kill is the only silence here).
    with KVSender(kv, compat_of(kv), config("shm", peer_timeout_s=2.0)) as tx, \
            child(receiver_main, "shm") as (proc, conn):
        peer_id = tx.connect(ask(conn), "shm")
        assert len(shared_mappings(proc.pid)) == 1
        assert len(shared_mappings()) == 1  # we map the owner's pool
        ask(conn, "expect", "r1", [1, 2])
        tx.begin("r1", peer_id, [5, 6], [1, 2])
        proc.kill()
        proc.join(5)
        assert [type(e) for e in collect(tx, 1, timeout_s=30)] == [TransferFailed]
        deadline = time.monotonic() + 30
        while shared_mappings() and time.monotonic() < deadline:
            time.sleep(0.05)
        # The owner's descriptor and mapping died with it; ours was the last one.
        assert shared_mappings() == []
