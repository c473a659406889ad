"""Compute threads follow the cores other processes leave free (`engine.threads`)."""

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from engine import LLM, CacheConfig
from engine.threads import INTERVAL_S, ThreadGovernor, cgroup_cpu_limit, threads_for


def test_a_core_another_process_uses_costs_a_thread_and_one_always_runs():
    assert threads_for(2, 0.0) == 2
    assert threads_for(2, 0.1) == 2  # background noise keeps the core
    assert threads_for(2, 0.2) == 1
    assert threads_for(2, 1.0) == 1
    assert threads_for(2, 3.0) == 1
    assert threads_for(8, 2.5) == 5


def test_threads_drop_at_once_and_grow_back_only_after_two_quiet_windows():
    governor = ThreadGovernor(frozenset(range(4)))
    try:
        assert (governor.threads, torch.get_num_threads()) == (4, 4)
        assert governor.observe(1.0) == 3 == torch.get_num_threads()
        assert governor.observe(2.9) == 1
        assert governor.observe(0.0) == 1  # one quiet window is not enough
        assert governor.observe(1.0) == 3  # two in a row asking for more: 3 of them
        assert governor.observe(0.0) == 3
        assert governor.observe(2.0) == 2  # a busier window resets the count
        assert governor.observe(0.0) == 2
        assert governor.observe(0.0) == 4
    finally:
        torch.set_num_threads(1)


def test_an_fp32_engine_leaves_blas_a_core_torch_does_not_spin_on():
    governor = ThreadGovernor(frozenset(range(4)), blas_reserve=1)
    try:
        assert (governor.threads, torch.get_num_threads()) == (4, 3)
        assert governor.observe(2.9) == 1 and torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(1)
    fp32 = LLM("tiny", cache=CacheConfig(num_blocks=16)).engine
    bf16 = LLM("tiny", dtype="bfloat16", cache=CacheConfig(num_blocks=16)).engine
    assert (fp32.threads.blas_reserve, bf16.threads.blas_reserve) == (1, 0)


def test_a_container_quota_caps_the_threads(tmp_path: Path):
    (tmp_path / "cpu.max").write_text("250000 100000\n")
    (tmp_path / "none").write_text("max 100000\n")
    assert cgroup_cpu_limit(tmp_path / "cpu.max") == 2
    assert cgroup_cpu_limit(tmp_path / "none") is None
    assert cgroup_cpu_limit(tmp_path / "missing") is None
    governor = ThreadGovernor(frozenset(range(8)), limit=2)
    try:
        assert governor.threads == 2 and governor.observe(0.0) == 2
    finally:
        torch.set_num_threads(1)


@pytest.mark.subprocess
def test_busy_processes_on_every_core_leave_the_engine_one_thread():
    cpus = os.sched_getaffinity(0)
    engine = LLM("tiny", cache=CacheConfig(num_blocks=16)).engine
    assert engine.threads is not None and engine.threads.cores == len(cpus)
    spinners = [subprocess.Popen([sys.executable, "-c", "while True: pass"])
                for _ in cpus]
    try:
        time.sleep(INTERVAL_S)
        engine.threads.update()  # a window has passed: a fresh one starts, spinners running
        time.sleep(INTERVAL_S * 1.5)
        assert engine.threads.update() == 1
        assert engine.threads.others > len(cpus) - 0.9
        assert engine.stats().compute_threads == 1 == torch.get_num_threads()
        assert engine.threads.blas_reserve == 1  # fp32: BLAS 1 thread, torch 1 all the same
    finally:
        for p in spinners:
            p.kill()
            p.wait()


def test_a_thread_count_given_is_kept():
    engine = LLM("tiny", cache=CacheConfig(num_blocks=16), num_threads=1).engine
    assert engine.threads is None and engine.stats().compute_threads == 1
