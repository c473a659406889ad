"""The engine's CPU kernels (`engine/csrc/`): paged decode attention and the fused layer
glue, built once per source, flags and CPU with torch's C++ extension tooling."""

from __future__ import annotations

import functools
import hashlib
import importlib.util
import logging
import time
from pathlib import Path
from types import ModuleType

log = logging.getLogger(__name__)

_SOURCES = ("paged_decode.cpp", "fused.cpp", "module.cpp")


@functools.cache
def cpu_kernels() -> ModuleType | None:
    """Build (once; cached under ~/.cache/torch_extensions) and load the kernels; None, with
    a warning, where they cannot be built (no C++ compiler): the engine then runs the plain
    torch paths, slower but the same result.

    The build is named by a hash of the sources, the flags and the CPU and compiled from a
    copy of the sources in its build folder: checkouts of the same code share one build
    (the checkout's path never enters the build), and a `-march=native` build is never
    loaded on another CPU.
    """
    from torch.utils.cpp_extension import _get_build_directory, load_inline

    from engine.hardware import cpu_features

    start = time.perf_counter()
    csrc = Path(__file__).parent / "csrc"
    source = "\n".join((csrc / name).read_text() for name in _SOURCES)
    # -march=native: built where it runs; -ffast-math lets exp and the sums use SIMD.
    flags = ["-O3", "-march=native", "-ffast-math"]
    cpu = cpu_features()
    key = hashlib.sha256("\0".join([source, *flags, cpu.model, cpu.isa]).encode()).hexdigest()
    name = f"pdcluster_kernels_{key[:16]}"
    build_dir = Path(_get_build_directory(name, verbose=False))
    module = _load_built(name, build_dir)
    if module is not None:
        return module
    _clear_stale_build_lock(build_dir / "lock")
    try:
        module = load_inline(name, [source], extra_cflags=flags)
    except Exception as e:  # a missing compiler or headers: the torch paths still work
        log.warning("CPU kernels unavailable, the engine falls back to plain torch ops: %s",
                    str(e).splitlines()[0] if str(e) else type(e).__name__)
        return None
    log.info("CPU kernels ready in %.1f s", time.perf_counter() - start)
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
