"""CPU feature detection reads what the kernel and torch report."""

import os
from pathlib import Path

import torch

from engine.hardware import cpu_features


def test_cpu_features_agree_with_proc_cpuinfo_and_torch():
    flags = next(line.split(":")[1].split() for line in
                 Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("flags"))
    cpu = cpu_features()
    assert cpu.avx512 == ("avx512f" in flags)
    assert cpu.amx == ("amx_bf16" in flags)
    assert cpu.native_bf16 == ("avx512_bf16" in flags or "amx_bf16" in flags)
    assert cpu.isa == torch.backends.cpu.get_cpu_capability()
    assert cpu.cores == len(os.sched_getaffinity(0))
    assert cpu.isa in cpu.describe() and f"{cpu.cores} cores" in cpu.describe()
