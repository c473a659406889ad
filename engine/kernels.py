"""The engine's CPU kernels (`engine/csrc/`): paged decode attention and the fused layer
glue, in one build per source and flags with torch's C++ extension tooling, holding a
variant per ISA level (baseline x86-64, AVX2, AVX-512, AVX512-BF16, AMX); the CPU's paths pick one
at load (`engine.hardware.cpu_paths`), so a build made on one CPU runs its best on another."""

from __future__ import annotations

import functools
import hashlib
import importlib.util
import logging
import time
from pathlib import Path
from types import ModuleType

log = logging.getLogger(__name__)

# Variant name (an `engine.hardware.ISA_LEVELS` level) -> GCC target of its copy of
# isa_kernels.cpp ("" for the baseline) and the switches of that copy: AVX-512 intrinsics,
# vdpbf16ps for bf16 dot products, AMX tiles for bf16 GEMMs of a few dozen rows. What a CPU
# needs to run each one is `CpuFeatures.isa_levels`.
_AVX512 = "avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c,prefer-vector-width=512"
ISA_TARGETS = {"baseline": ("", (0, 0, 0)), "avx2": ("avx2,fma,f16c", (0, 0, 0)),
               "avx512": (_AVX512, (1, 0, 0)),
               "avx512_bf16": (_AVX512 + ",avx512bf16", (1, 1, 0)),
               "amx": (_AVX512 + ",avx512bf16,amx-tile,amx-bf16", (1, 1, 1))}
_WRAPPERS = ("fused.cpp", "paged_decode.cpp", "module.cpp")
# -ffast-math lets exp and the sums use SIMD; no -march: each variant names its own target.
# -fopenmp makes `at::parallel_for` split the work over torch's OpenMP threads (without it
# the header-only `at::parallel_for` runs every kernel on the calling thread alone).
FLAGS = ("-O3", "-ffast-math", "-fopenmp")
LDFLAGS = ("-fopenmp",)


def kernel_source() -> str:
    """The one translation unit: the shared header, a copy of the kernel bodies per ISA
    (each in its namespace, under its target pragma), then the wrappers and the module."""
    csrc = Path(__file__).parent / "csrc"
    body = (csrc / "isa_kernels.cpp").read_text()
    parts = [(csrc / "common.h").read_text()]
    for name, (target, (avx512, bf16_dot, amx)) in ISA_TARGETS.items():
        copy = (f"#define PDK_ISA isa_{name}\n#define PDK_ISA_NAME \"{name}\"\n"
                f"#define PDK_AVX512 {avx512}\n#define PDK_BF16_DOT {bf16_dot}\n"
                f"#define PDK_AMX {amx}\n{body}\n#undef PDK_ISA\n#undef PDK_ISA_NAME\n"
                "#undef PDK_AVX512\n#undef PDK_BF16_DOT\n#undef PDK_AMX\n")
        if target:
            copy = (f"#if defined(__x86_64__)\n#pragma GCC push_options\n"
                    f"#pragma GCC target(\"{target}\")\n{copy}#pragma GCC pop_options\n#endif\n")
        parts.append(copy)
    tables = ", ".join(f"&isa_{name}::table" for name in ISA_TARGETS)
    parts.append(f"#if defined(__x86_64__)\n#define PDK_TABLES {tables}\n#else\n"
                 "#define PDK_TABLES &isa_baseline::table\n#endif\n")
    parts += [(csrc / name).read_text() for name in _WRAPPERS]
    return "\n".join(parts)


@functools.cache
def cpu_kernels() -> ModuleType | None:
    """Build (once; cached under `$TORCH_EXTENSIONS_DIR`, by default
    ~/.cache/torch_extensions) and load the kernels, with the variant of the highest ISA
    level in use selected (`cpu_paths().level`: the CPU's best, or the cap's; logged);
    None, with a warning, where they cannot be built (no C++ compiler): the engine then
    runs the plain torch paths, slower but the same result.

    The build is named by a hash of the sources and the flags and compiled from a copy of
    the sources in its build folder: checkouts of the same code share one build (the
    checkout's path never enters the build).
    """
    from torch.utils.cpp_extension import _get_build_directory, load_inline

    from engine.hardware import cpu_paths

    start = time.perf_counter()
    source = kernel_source()
    key = hashlib.sha256("\0".join([source, *FLAGS, *LDFLAGS]).encode()).hexdigest()
    name = f"pdcluster_kernels_{key[:16]}"
    build_dir = Path(_get_build_directory(name, verbose=False))
    module = _load_built(name, build_dir)
    if module is None:
        _clear_stale_build_lock(build_dir / "lock")
        try:
            module = load_inline(name, [source], extra_cflags=list(FLAGS),
                                 extra_ldflags=list(LDFLAGS))
        except Exception as e:  # a missing compiler or headers: the torch paths still work
            log.warning("CPU kernels unavailable, the engine falls back to plain torch ops: "
                        "%s", str(e).splitlines()[0] if str(e) else type(e).__name__)
            return None
        log.info("CPU kernels built in %.1f s", time.perf_counter() - start)
    runnable = [isa for isa in cpu_paths().levels if isa in module.isas()]
    if "amx" in runnable and not module.request_amx():
        log.warning("the kernel refused this process AMX tile state: the AMX kernels are off")
        runnable.remove("amx")
    module.select_isa(runnable[-1])
    log.info("CPU kernels: the %s variant (in use here: %s; compiled: %s)", module.isa(),
             ", ".join(runnable), ", ".join(module.isas()))
    return module


def _load_built(name: str, build_dir: Path) -> ModuleType | None:
    """The finished build, imported without torch's build lock (its name is a hash of
    everything that goes into it); None when there is none yet or it is unreadable.

    Taking the lock only to find nothing to build would let a process killed in that
    moment (a worker SIGKILLed while it starts) leave a lock every later start waits on.
    """
    library = build_dir / f"{name}.so"
    if not library.exists():
        return None
    spec = importlib.util.spec_from_file_location(name, library)
    try:
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    except ImportError as e:  # a build cut short: build again
        log.warning("rebuilding the CPU kernels: %s", e)
        return None
    return module


def _clear_stale_build_lock(lock: Path, max_age_s: float = 600.0) -> None:
    """Remove a build lock left by a process killed mid-build (torch would wait on it
    forever); a live build takes well under `max_age_s`."""
    try:
        age = time.time() - lock.stat().st_mtime
    except FileNotFoundError:
        return
    if age > max_age_s:
        log.warning("removing a stale kernel build lock (%.0f s old): %s", age, lock)
        lock.unlink(missing_ok=True)
