"""CPU compute threads that follow the cores other processes leave free.

Both OpenMP (torch, oneDNN) and BLAS threads split every op evenly and wait for the slowest
part, so each one needs a core to itself: on an idle 2-core Xeon two threads made a bf16
decode step 1.5-1.6x faster than one, but with one busy process beside them the same two
threads made it 4.5-11x slower than one thread (its parts waited for a core the other
process held; docs/benchmarks.md). A fixed count is wrong on one of the two machines, so an
engine given no thread count measures, about once a second, how much CPU time the other
processes took on its cores (`/proc/stat` less its own `os.times`) and runs on the cores
left: all of them on a dedicated machine, fewer, down to one, when something else runs.
"""

from __future__ import annotations

import logging
import math
import os
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from threadpoolctl import ThreadpoolController

log = logging.getLogger(__name__)

# Another process's share of a core that already costs a thread: its slices stall a
# thread's part of every op, and the whole op waits for that part.
BUSY_SHARE = 0.15
# Seconds between measurements, and the windows that must agree before threads are added
# (they are taken away at once: contention costs more than a spare core earns).
INTERVAL_S = 1.0
WINDOWS_TO_GROW = 2


def threads_for(cores: int, others: float) -> int:
    """Compute threads for `cores` cores when other processes keep `others` cores busy:
    a core they use more than `BUSY_SHARE` of is theirs, and at least one thread runs."""
    taken = max(0, math.ceil(others - BUSY_SHARE))
    return max(1, cores - taken)


def cgroup_cpu_limit(path: Path = Path("/sys/fs/cgroup/cpu.max")) -> int | None:
    """Whole CPUs this process's cgroup (v2) may use (`quota / period`, at least 1), or None
    where it sets no quota (a container's limit: its cores are not all its own)."""
    try:
        quota, period = path.read_text().split()[:2]
    except (OSError, ValueError):
        return None
    return None if quota == "max" else max(1, int(quota) // int(period))


@dataclass
class _Sample:
    at: float  # time.monotonic()
    busy_s: float  # busy seconds of this process's cores, every process together
    own_s: float  # this process's CPU seconds (all its threads)


def _read_sample(cpus: frozenset[int], ticks_per_s: float) -> _Sample | None:
    """Busy time of `cpus` (`/proc/stat`: user, nice, system, irq, softirq, steal) and this
    process's CPU time; None where `/proc/stat` cannot be read."""
    try:
        lines = Path("/proc/stat").read_text().splitlines()
    except OSError:
        return None
    busy = 0
    for line in lines[1:]:  # the total first, then a line per core, then the rest
        if not line.startswith("cpu"):
            break
        name, *fields = line.split()
        if int(name[3:]) not in cpus:
            continue
        user, nice, system, _idle, _iowait, irq, softirq, steal = map(int, fields[:8])
        busy += user + nice + system + irq + softirq + steal
    times = os.times()
    return _Sample(time.monotonic(), busy / ticks_per_s, times.user + times.system)


class ThreadGovernor:
    """Sets BLAS's thread count to the cores others leave free (`threads_for`) and torch's
    to `blas_reserve` fewer, re-measured at most once per `INTERVAL_S`; `update` is called
    before each step.

    Args:
        cpus: the cores this process may run on.
        limit: at most this many threads (a container's CPU quota); None: one per core.
        blas_reserve: torch runs this many threads fewer than BLAS. An fp32 model's linears
            run on OpenBLAS's own threads, which OpenMP threads spinning on the same cores
            starve (a batch-1 fp32 step took 4x as long with torch on both cores of the
            2-core Xeon as on one): there 1, with BLAS on every free core; 0 where BLAS
            does no work (bf16).
    """

    def __init__(self, cpus: frozenset[int], limit: int | None = None,
                 blas_reserve: int = 0) -> None:
        self.cpus = cpus
        self.blas_reserve = blas_reserve
        self.cores = min(len(cpus), limit or len(cpus))
        self._ticks = float(os.sysconf("SC_CLK_TCK"))
        self._blas = ThreadpoolController()
        self._last = _read_sample(cpus, self._ticks)
        self._grow_votes = 0
        self.others = 0.0  # cores other processes kept busy in the last window
        self.threads = 0
        self._set(self.cores, "start")

    def update(self) -> int:
        """Re-measure if a window has passed; returns the thread count in force."""
        now = time.monotonic()
        if self._last is None or now - self._last.at < INTERVAL_S:
            return self.threads
        sample = _read_sample(self.cpus, self._ticks)
        if sample is None:
            return self.threads
        elapsed = sample.at - self._last.at
        others = (sample.busy_s - self._last.busy_s) - (sample.own_s - self._last.own_s)
        self._last = sample
        return self.observe(max(0.0, others / elapsed))

    def observe(self, others: float) -> int:
        """Take one window's measure (other processes kept `others` cores busy): fewer
        threads at once, more only after `WINDOWS_TO_GROW` windows in a row asked for more.
        Returns the thread count in force."""
        self.others = others
        wanted = threads_for(self.cores, others)
        self._grow_votes = self._grow_votes + 1 if wanted > self.threads else 0
        if wanted < self.threads or self._grow_votes >= WINDOWS_TO_GROW:
            self._grow_votes = 0
            self._set(wanted, f"other processes kept {others:.2f} cores busy")
        return self.threads

    def _set(self, threads: int, why: str) -> None:
        torch.set_num_threads(max(1, threads - self.blas_reserve))
        self._blas.limit(limits=threads, user_api="blas")
        log.info("compute threads %d -> %d of %d cores, %d of them torch's (%s)",
                 self.threads, threads, self.cores, torch.get_num_threads(), why)
        self.threads = threads
