"""What this device is (CPU features) and its measured limits (FLOP/s, read bandwidth)."""

from __future__ import annotations

import ctypes
import functools
import os
import time
from dataclasses import dataclass
from pathlib import Path

import torch


@dataclass(frozen=True)
class CpuFeatures:
    """The CPU facts the engine picks paths by.

    Args:
        model: the CPU's name.
        cores: cores this process may run on.
        isa: the widest SIMD level torch's kernels use here (`AVX2`, `AVX512`, ...).
        avx512: AVX-512 foundation present.
        native_bf16: bf16 arithmetic in hardware (`avx512_bf16` or AMX); without it bf16
            matmuls are emulated and slower than fp32.
        amx: AMX tiles present.
        flags: the CPU's feature flags (`/proc/cpuinfo`).
    """

    model: str
    cores: int
    isa: str
    avx512: bool
    native_bf16: bool
    amx: bool
    flags: frozenset[str] = frozenset()

    @property
    def kernel_isas(self) -> tuple[str, ...]:
        """The engine kernels' ISA variants (`engine.kernels.ISA_TARGETS`) this CPU runs,
        baseline first, best last."""
        avx512 = {"avx512f", "avx512bw", "avx512vl", "avx512dq", "avx2", "fma"}
        runs = {"avx2": {"avx2", "fma", "f16c"}, "avx512": avx512,
                "avx512_bf16": avx512 | {"avx512_bf16"},
                "amx": avx512 | {"avx512_bf16", "amx_tile", "amx_bf16"}}
        return ("generic", *(isa for isa, needs in runs.items() if needs <= self.flags))

    @property
    def auto_dtype(self) -> str:
        """`--dtype auto` on this CPU: bfloat16 where it is native (AVX512-BF16 or AMX; the
        linears, glue, attention and KV cache then move half the bytes), float32 where
        bf16 would be emulated and slower."""
        return "bfloat16" if self.native_bf16 else "float32"

    def describe(self) -> str:
        bf16 = "native" if self.native_bf16 else "emulated (fp32 is faster)"
        return (f"{self.model}, {self.cores} cores, {self.isa}"
                f"{'' if self.avx512 else ' (no AVX-512)'}, bf16 {bf16}"
                f"{', AMX' if self.amx else ''}")


@functools.cache
def cpu_features() -> CpuFeatures:
    """This machine's CPU features, from `/proc/cpuinfo` and torch (read once)."""
    flags: set[str] = set()
    model = "unknown CPU"
    cpuinfo = Path("/proc/cpuinfo")
    for line in cpuinfo.read_text().splitlines() if cpuinfo.exists() else []:
        key, _, value = line.partition(":")
        if key.strip() == "flags" and not flags:
            flags = set(value.split())
        elif key.strip() == "model name" and model == "unknown CPU":
            model = value.strip()
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    amx = "amx_bf16" in flags
    return CpuFeatures(model=model, cores=cores or 1,
                       isa=torch.backends.cpu.get_cpu_capability(),
                       avx512="avx512f" in flags, native_bf16=amx or "avx512_bf16" in flags,
                       amx=amx, flags=frozenset(flags))


def _best_of(fn: object, repeats: int) -> float:
    fn()  # warm up
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        best = min(best, time.perf_counter() - start)
    return best


def measure_peaks(device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32,
                  size: int = 1024, read_mb: int = 256, repeats: int = 3) -> dict[str, float]:
    """Best-of-`repeats` matmul FLOP/s and memory read bandwidth with the current threads.

    Returns:
        `{"flops": FLOP/s, "bandwidth": bytes/s}`.
    """
    a = torch.randn(size, size, device=device, dtype=dtype)
    b = torch.randn(size, size, device=device, dtype=dtype)
    matmul_s = _best_of(lambda: torch.mm(a, b), repeats)
    x = torch.ones(read_mb * 2**20 // 4, device=device, dtype=torch.float32)
    read_s = _best_of(lambda: x.sum(), repeats)
    return {"flops": 2 * size**3 / matmul_s, "bandwidth": x.numel() * 4 / read_s}


# glibc's mallopt parameters, and the values the engine sets.
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3
MMAP_THRESHOLD = 32 * 2**20  # glibc's largest on 64-bit
TRIM_THRESHOLD = 512 * 2**20


def keep_freed_memory() -> bool:
    """Ask glibc's malloc to serve blocks up to `MMAP_THRESHOLD` from its heap and keep up
    to `TRIM_THRESHOLD` freed there: a prefill's activations (megabytes a layer) are then
    reused step after step instead of mapped fresh, page-faulted in and unmapped each time
    (W-long's prefill steps on a 2-core Xeon: 3.1-3.2 s in all with it, 3.3-5.2 s without,
    docs/benchmarks.md). The process keeps its peak activations resident.

    Returns:
        Whether glibc took both settings (False elsewhere: another C library, not Linux).
    """
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:
        return False
    return bool(libc.mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD)) and \
        bool(libc.mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD))
