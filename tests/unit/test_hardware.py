"""CPU feature detection reads what the kernel and torch report."""

import os
from dataclasses import asdict
from pathlib import Path

import pytest
import torch

from engine import LLM, CacheConfig, SamplingParams
from engine.config import parse_dtype
from engine.hardware import (
    ISA_CAP_ENV,
    ISA_LEVELS,
    CpuFeatures,
    cpu_features,
    cpu_paths,
    decide_cpu_paths,
    isa_cap,
    keep_freed_memory,
)
from engine.models.llama import OneDnnLinear
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
    paths = cpu_paths()
    assert cpu.isa in paths.describe() and f"{cpu.cores} cores" in paths.describe()


AVX2 = frozenset({"avx", "avx2", "fma", "f16c"})
AVX512 = AVX2 | {"avx512f", "avx512bw", "avx512vl", "avx512dq"}
SAPPHIRE_RAPIDS = AVX512 | {"avx512_bf16", "amx_bf16", "amx_tile"}


def _cpu(flags: frozenset[str]) -> CpuFeatures:
    return CpuFeatures(model="test CPU", cores=2, isa="AVX2", avx512="avx512f" in flags,
                       native_bf16="avx512_bf16" in flags, amx="amx_bf16" in flags,
                       flags=flags)


@pytest.mark.parametrize(("flags", "levels"), [
    (frozenset({"sse4_2"}), ("baseline",)),
    (AVX2, ("baseline", "avx2")),
    (AVX512, ("baseline", "avx2", "avx512")),
    (SAPPHIRE_RAPIDS - {"amx_bf16", "amx_tile"}, ("baseline", "avx2", "avx512", "avx512_bf16")),
    (SAPPHIRE_RAPIDS, ISA_LEVELS),
])
def test_isa_levels_follow_the_flags(flags, levels):
    assert _cpu(flags).isa_levels == levels


def test_one_decision_sets_every_cpu_path():
    # An AVX2 EPYC: its oneDNN has no bf16 GEMM, fp32 stays on OpenBLAS, auto is fp32.
    epyc = decide_cpu_paths(_cpu(AVX2), None, onednn_bf16=False)
    assert (epyc.level, epyc.fp32_small_rows, epyc.bf16_onednn, epyc.auto_dtype) == (
        "avx2", False, False, "float32")
    assert epyc.linears(torch.bfloat16) == "torch bfloat16 (emulated)"
    assert epyc.linears(torch.float32) == "OpenBLAS fp32"
    # A Sapphire Rapids Xeon: everything on.
    spr = decide_cpu_paths(_cpu(SAPPHIRE_RAPIDS), None, onednn_bf16=True)
    assert (spr.level, spr.fp32_small_rows, spr.bf16_onednn, spr.auto_dtype) == (
        "amx", True, True, "bfloat16")
    assert spr.linears(torch.bfloat16) == "oneDNN bf16, prepacked"
    assert spr.linears(torch.float32) == "OpenBLAS fp32, oneDNN fp32 prepacked at 2-16 rows"
    # The same Xeon capped at AVX2 takes the EPYC's paths, bf16 off oneDNN included.
    capped = decide_cpu_paths(_cpu(SAPPHIRE_RAPIDS), "avx2", onednn_bf16=True)
    assert (capped.levels, capped.fp32_small_rows, capped.bf16_onednn, capped.auto_dtype) == (
        ("baseline", "avx2"), False, False, "float32")
    assert "capped at avx2 (PDCLUSTER_CPU_ISA)" in capped.describe()
    # Capped at AVX-512: fp32's small-row path stays, bf16 is no longer native.
    avx512 = decide_cpu_paths(_cpu(SAPPHIRE_RAPIDS), "avx512", onednn_bf16=True)
    assert (avx512.level, avx512.fp32_small_rows, avx512.bf16_onednn, avx512.auto_dtype) == (
        "avx512", True, True, "float32")
    # A cap above what the CPU has changes nothing; torch without oneDNN turns both off.
    assert decide_cpu_paths(_cpu(AVX2), "amx", onednn_bf16=False).levels == (
        "baseline", "avx2")
    no_onednn = decide_cpu_paths(_cpu(SAPPHIRE_RAPIDS), None, onednn_bf16=True, mkldnn=False)
    assert (no_onednn.fp32_small_rows, no_onednn.bf16_onednn) == (False, False)


def test_the_cap_is_read_from_the_environment(monkeypatch):
    monkeypatch.setenv(ISA_CAP_ENV, "AVX2")
    assert isa_cap() == "avx2"
    monkeypatch.setenv(ISA_CAP_ENV, "")
    assert isa_cap() is None
    monkeypatch.setenv(ISA_CAP_ENV, "avx10")
    with pytest.raises(ValueError, match="PDCLUSTER_CPU_ISA='avx10' is not an ISA level; "
                                         "use one of baseline, avx2, avx512, avx512_bf16, amx"):
        isa_cap()


def test_this_machine_takes_the_paths_its_oneDNN_supports():
    paths = cpu_paths()
    assert paths.cap == isa_cap()
    assert paths.levels[-1] in cpu_features().isa_levels
    supported = torch.ops.mkldnn._is_mkldnn_bf16_supported()
    assert paths.bf16_onednn == (supported and (
        paths.cap is None or ISA_LEVELS.index(paths.cap) >= ISA_LEVELS.index("avx512")))
    assert parse_dtype("auto", torch.device("cpu")) == (
        torch.bfloat16 if paths.native_bf16 else torch.float32)


def test_bf16_runs_on_every_cpu_and_says_which_linears_it_took():
    # On a CPU without oneDNN's bf16 path (or capped below AVX-512) the linears take
    # torch's own kernels: no crash, and tokens agree with fp32 at first (tiny's logits are
    # far apart at its first steps).
    paths = cpu_paths()
    bf16 = LLM("tiny", dtype="bfloat16", cache=CacheConfig(num_blocks=16))
    fp32 = LLM("tiny", dtype="float32", cache=CacheConfig(num_blocks=16))
    params = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)
    prompt = [[1, 500, 2000, 3000]]
    assert bf16.generate(prompt, params)[0].outputs[0].token_ids == \
        fp32.generate(prompt, params)[0].outputs[0].token_ids
    qkv = bf16.engine.model.layers[0].qkv_proj
    assert isinstance(qkv.forward, OneDnnLinear) == paths.bf16_onednn
    assert f"linears: {paths.linears(torch.bfloat16)}" in bf16.engine.runner.hardware


def test_the_engine_reports_its_dtype_and_kernel_paths():
    stats = LLM("tiny", dtype="auto", cache=CacheConfig(num_blocks=16)).engine.stats()
    assert stats.dtype == cpu_paths().auto_dtype
    assert f"{cpu_paths().level} kernels" in stats.hardware
    assert WorkerStats(**asdict(stats)).dtype == stats.dtype  # what `status` shows


def test_a_bf16_kv_pool_holds_twice_the_blocks_of_fp32_in_one_budget():
    def pool(dtype: str) -> tuple[int, torch.dtype]:
        engine = LLM("tiny", dtype=dtype, cache=CacheConfig(kv_cache_memory_gb=0.01)).engine
        return engine.block_pool.num_blocks, engine.kv_cache.buffer.dtype

    (fp32_blocks, fp32), (bf16_blocks, bf16) = pool("float32"), pool("bfloat16")
    assert (fp32, bf16) == (torch.float32, torch.bfloat16)
    assert bf16_blocks // 2 == fp32_blocks  # half the bytes a block: twice the blocks


def test_glibc_takes_the_engines_malloc_settings():
    assert keep_freed_memory()  # glibc here, and it accepts both values
