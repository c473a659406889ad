"""What this device is (CPU features), which CPU paths the engine takes on it, and its
measured limits (FLOP/s, read bandwidth)."""

from __future__ import annotations

import ctypes
import functools
import os
import time
from dataclasses import dataclass
from pathlib import Path

import torch

# The ISA levels the engine's CPU paths are chosen by, lowest first: the kernels' variants
# (`engine.kernels.ISA_TARGETS`) carry the same names. `PDCLUSTER_CPU_ISA` caps them.
ISA_LEVELS = ("baseline", "avx2", "avx512", "avx512_bf16", "amx")
ISA_CAP_ENV = "PDCLUSTER_CPU_ISA"
_AVX512 = frozenset({"avx512f", "avx512bw", "avx512vl", "avx512dq", "avx2", "fma"})
# The CPU flags (`/proc/cpuinfo` names) each level above the baseline needs.
_LEVEL_FLAGS = {"avx2": frozenset({"avx2", "fma", "f16c"}), "avx512": _AVX512,
                "avx512_bf16": _AVX512 | {"avx512_bf16"},
                "amx": _AVX512 | {"avx512_bf16", "amx_tile", "amx_bf16"}}


@dataclass(frozen=True)
class CpuFeatures:
    """The CPU's facts, as the hardware reports them (no cap applied: see `CpuPaths`).

    Args:
        model: the CPU's name.
        cores: cores this process may run on.
        isa: the widest SIMD level torch's kernels use here (`AVX2`, `AVX512`, ...).
        avx512: AVX-512 foundation present.
        native_bf16: bf16 arithmetic in hardware (`avx512_bf16` or AMX).
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
    def isa_levels(self) -> tuple[str, ...]:
        """The `ISA_LEVELS` this CPU runs, baseline first, best last."""
        return ("baseline", *(level for level, needs in _LEVEL_FLAGS.items()
                              if needs <= self.flags))


@dataclass(frozen=True)
class CpuPaths:
    """Which CPU paths the engine takes on this machine: decided in one place,
    `cpu_paths()`, from the CPU's flags, what torch's oneDNN supports here and the
    `PDCLUSTER_CPU_ISA` cap.

    Args:
        cpu: the CPU's facts.
        levels: the ISA levels in use, lowest first (the CPU's, up to the cap); the
            kernels run the last one's variant.
        cap: the cap's level; None when `PDCLUSTER_CPU_ISA` is unset.
        fp32_small_rows: fp32 linears of 2 to 16 rows run on oneDNN's fp32 GEMM on a copy
            prepacked at load (AVX-512; on AVX2 OpenBLAS is faster at every row count).
        bf16_onednn: bf16 linears run on oneDNN's bf16 GEMM on prepacked weights. oneDNN
            has a bf16 path only with AVX-512 (BW, VL, DQ) or AVX-NE-CONVERT; elsewhere,
            or capped below AVX-512, bf16 linears take torch's own kernels (emulated,
            slower than fp32).
    """

    cpu: CpuFeatures
    levels: tuple[str, ...]
    cap: str | None
    fp32_small_rows: bool
    bf16_onednn: bool

    @property
    def level(self) -> str:
        """The highest level in use: the kernels' variant."""
        return self.levels[-1]

    @property
    def native_bf16(self) -> bool:
        """bf16 arithmetic in hardware at the level in use (AVX512-BF16 or AMX)."""
        return self.level in ("avx512_bf16", "amx")

    @property
    def auto_dtype(self) -> str:
        """`--dtype auto` here: bfloat16 where it is native (the linears, glue, attention
        and KV cache then move half the bytes), float32 where bf16 would be emulated and
        slower."""
        return "bfloat16" if self.native_bf16 else "float32"

    def linears(self, dtype: torch.dtype) -> str:
        """The path a CPU linear of `dtype` takes (logged, and in the worker's status)."""
        if dtype == torch.float32:
            return "OpenBLAS fp32, oneDNN fp32 prepacked at 2-16 rows" \
                if self.fp32_small_rows else "OpenBLAS fp32"
        if dtype == torch.bfloat16 and self.bf16_onednn:
            return "oneDNN bf16, prepacked"
        return f"torch {str(dtype).removeprefix('torch.')} (emulated)" \
            if dtype in (torch.bfloat16, torch.float16) and not self.native_bf16 else "torch"

    def describe(self) -> str:
        cpu = self.cpu
        bf16 = "native" if self.native_bf16 else "emulated (fp32 is faster)"
        cap = f", capped at {self.cap} ({ISA_CAP_ENV})" if self.cap else ""
        return (f"{cpu.model}, {cpu.cores} cores, {cpu.isa}"
                f"{'' if cpu.avx512 else ' (no AVX-512)'}, bf16 {bf16}"
                f"{', AMX' if self.level == 'amx' else ''}{cap}")


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


def isa_cap() -> str | None:
    """`PDCLUSTER_CPU_ISA`, checked: one of `ISA_LEVELS`, or None when unset or empty.

    Raises:
        ValueError: another value; the message lists the levels.
    """
    cap = os.environ.get(ISA_CAP_ENV, "").strip().lower()
    if cap and cap not in ISA_LEVELS:
        raise ValueError(f"{ISA_CAP_ENV}={cap!r} is not an ISA level; use one of "
                         f"{', '.join(ISA_LEVELS)}")
    return cap or None


def decide_cpu_paths(cpu: CpuFeatures, cap: str | None, onednn_bf16: bool,
                     mkldnn: bool = True) -> CpuPaths:
    """The paths for `cpu` under `cap` (see `CpuPaths`).

    Args:
        cpu: the CPU's facts.
        cap: the highest level to use; None for the CPU's best.
        onednn_bf16: torch's oneDNN has a bf16 GEMM on this CPU.
        mkldnn: torch was built with oneDNN.
    """
    top = ISA_LEVELS.index(cap) if cap else len(ISA_LEVELS) - 1
    levels = tuple(level for level in cpu.isa_levels if ISA_LEVELS.index(level) <= top)
    avx512 = ISA_LEVELS.index(levels[-1]) >= ISA_LEVELS.index("avx512")
    # A cap below AVX-512 keeps bf16 off oneDNN as a CPU without AVX-512 would have it.
    capped_below_avx512 = cap is not None and top < ISA_LEVELS.index("avx512")
    return CpuPaths(cpu=cpu, levels=levels, cap=cap, fp32_small_rows=avx512 and mkldnn,
                    bf16_onednn=mkldnn and onednn_bf16 and not capped_below_avx512)


@functools.cache
def cpu_paths() -> CpuPaths:
    """This machine's CPU paths (decided once per process; see `CpuPaths`).

    Raises:
        ValueError: `PDCLUSTER_CPU_ISA` is not an ISA level.
    """
    mkldnn = torch.backends.mkldnn.is_available()
    onednn_bf16 = mkldnn and bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    return decide_cpu_paths(cpu_features(), isa_cap(), onednn_bf16, mkldnn)


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
