"""CPU feature detection reads what the kernel and torch report."""

import dataclasses
import os
from pathlib import Path

import torch

from engine import LLM, CacheConfig
from engine.config import parse_dtype
from engine.hardware import cpu_features, keep_freed_memory
from protocol.status import WorkerStats


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


def test_dtype_auto_is_bf16_exactly_where_the_cpu_has_native_bf16():
    cpu = cpu_features()
    assert parse_dtype("auto", torch.device("cpu")) == (
        torch.bfloat16 if cpu.native_bf16 else torch.float32)
    avx2_only = dataclasses.replace(cpu, avx512=False, native_bf16=False, amx=False,
                                    flags=frozenset({"avx", "avx2", "fma", "f16c"}))
    assert avx2_only.auto_dtype == "float32"
    assert avx2_only.kernel_isas == ("generic", "avx2")
    sapphire_rapids = dataclasses.replace(cpu, native_bf16=True, amx=True, flags=frozenset(
        {"avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_bf16",
         "amx_bf16", "amx_tile"}))
    assert sapphire_rapids.auto_dtype == "bfloat16"
    assert sapphire_rapids.kernel_isas == ("generic", "avx2", "avx512", "avx512_bf16", "amx")
    zen4 = dataclasses.replace(sapphire_rapids, amx=False,
                               flags=sapphire_rapids.flags - {"amx_bf16", "amx_tile"})
    assert zen4.kernel_isas == ("generic", "avx2", "avx512", "avx512_bf16")


def test_the_engine_reports_its_dtype_and_kernel_paths():
    stats = LLM("tiny", dtype="auto", cache=CacheConfig(num_blocks=16)).engine.stats()
    assert stats["dtype"] == cpu_features().auto_dtype
    assert f"{cpu_features().kernel_isas[-1]} kernels" in stats["hardware"]
    assert WorkerStats(**stats).dtype == stats["dtype"]  # what `status` shows


def test_a_bf16_kv_pool_holds_twice_the_blocks_of_fp32_in_one_budget():
    def pool(dtype: str) -> tuple[int, torch.dtype]:
        engine = LLM("tiny", dtype=dtype, cache=CacheConfig(kv_cache_memory_gb=0.01)).engine
        return engine.block_pool.num_blocks, engine.kv_cache.buffer.dtype

    (fp32_blocks, fp32), (bf16_blocks, bf16) = pool("float32"), pool("bfloat16")
    assert (fp32, bf16) == (torch.float32, torch.bfloat16)
    assert bf16_blocks // 2 == fp32_blocks  # half the bytes a block: twice the blocks


def test_glibc_takes_the_engines_malloc_settings():
    assert keep_freed_memory()  # glibc here, and it accepts both values
