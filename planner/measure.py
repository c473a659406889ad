"""`pdcluster profile`: measure one worker type's steps on the real engine and fit its models.

Step times are measured in this process on an `LLMEngine` built as a worker builds it
(same dtype, threads, block size, KV budget), by timing `engine.step()` on chosen
schedules:

- prefill: prompts of `new` tokens after `cached` tokens already in the prefix cache
  (a first request puts them there), one to four prompts per step, and mixed steps (a
  prompt joining running decodes, as a colocated worker runs them);
- decode: `batch` requests with `context` tokens each, several steps per point, at every
  batch size of the decode model's table (`planner.profile.DECODE_BATCHES`).

The exposed KV transfer needs real prefill and decode workers in two processes over the
chosen transport: the caller passes that measurement in (`TransferSampler`; the CLI's is
`commands.worker_pair.transfer_samples`). The neighbour slowdown is the ratio
of a few steps timed beside a second engine process that keeps stepping a decode batch (a
busy worker on the same host) to the same steps timed alone. Every sample is kept in the file;
each model is scored on held-out samples before being refitted on all of them.
"""

from __future__ import annotations

import platform
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from engine import CacheConfig, LLMEngine, SamplingParams, SchedulerConfig
from engine.request import Request
from planner.profile import (
    DECODE_BATCHES,
    PREFILL_FEATURES,
    TRANSFER_FEATURES,
    LinearModel,
    Profile,
    decode_feature_names,
    decode_features,
    fit_held_out,
    prefill_features,
)

VOCAB = (100, 400)  # inside every supported model's vocabulary, tiny's included
_EMPTY = LinearModel((), ())  # replaced by the fits


# Given the settings, the prompt lengths, the repeats per length and a progress tick: one
# sample per transfer, `{"tokens", "blocks", "y": exposed seconds, "prefill_s"}`.
TransferSampler = Callable[["ProfileSettings", Sequence[int], int, Callable[[], None]],
                           list[dict[str, Any]]]


@dataclass(frozen=True)
class ProfileSettings:
    """What to profile.

    Args:
        model: `--model`.
        dtype: model dtype.
        torch_threads: intra-op threads (as `serve --torch-threads`).
        transport: KV transport for the transfer measurement (`shm`, `zmq`, `torch`).
        kv_cache_gb: KV budget per worker.
        block_size: tokens per block.
        repeats: timed repetitions of each point.
        quick: a smaller grid (tests, plumbing checks).
        seed: seeds the random prompts.
    """

    model: str = "smollm2"
    dtype: str = "float32"
    torch_threads: int = 1
    transport: str = "shm"
    kv_cache_gb: float = 1.0
    block_size: int = 16
    repeats: int = 3
    quick: bool = False
    seed: int = 0


def hardware() -> dict[str, Any]:
    """CPU model and its vector features, cores, GPU name (if any)."""
    import torch

    from engine.hardware import cpu_features

    cpu = cpu_features()
    features = [name for name, present in (("avx512", cpu.avx512), ("bf16", cpu.native_bf16),
                                            ("amx", cpu.amx)) if present]
    gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else None
    return {"cpu": cpu.model, "cpu_isa": cpu.isa, "cpu_flags": features, "cores": cpu.cores,
            "gpu": gpu, "machine": platform.machine(), "torch": torch.__version__}


class StepSampler:
    """Times engine steps and records what each step computed."""

    def __init__(self, engine: LLMEngine, rng: np.random.Generator) -> None:
        self.engine = engine
        self.rng = rng
        self.ids = iter(range(10**9))

    def prompt(self, n: int) -> list[int]:
        return self.rng.integers(*VOCAB, size=n).tolist()

    def add(self, prompt: list[int], max_tokens: int) -> Request:
        params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
        return self.engine.add_request(f"p{next(self.ids)}", prompt, params)

    def step(self) -> tuple[list[list[Any]], float]:
        """One timed step; per scheduled request [start, new tokens, prompt tokens?] it
        computed (`SchedulerOutput.items`, as lists: the JSON file stores them)."""
        start = time.perf_counter()
        self.engine.step()
        elapsed = time.perf_counter() - start
        return [list(item) for item in self.engine.last_step], elapsed

    def finish(self) -> None:
        for rid in list(self.engine.requests):
            self.engine.abort_request(rid)
        while self.engine.has_unfinished_requests():
            self.engine.step()


def prefill_samples(s: StepSampler, grid: Sequence[tuple[int, int, int]], repeats: int,
                    tick: Callable[[], None]) -> list[dict[str, Any]]:
    """Steps with prompt tokens: (new, cached, prompts per step) points, plus mixed steps."""
    samples = []
    for new, cached, count in grid:
        for _ in range(repeats):
            prefixes = [s.prompt(cached) for _ in range(count)] if cached else [[]] * count
            if cached:
                for p in prefixes:
                    s.add(p, 1)
                while s.engine.has_unfinished_requests():
                    s.engine.step()
            for p in prefixes:
                s.add(p + s.prompt(new), 1)
            items, elapsed = s.step()
            samples.append({"items": items, "y": elapsed})
            s.finish()
            tick()
    return samples


def mixed_samples(s: StepSampler, points: Sequence[tuple[int, int]], repeats: int,
                  tick: Callable[[], None]) -> list[dict[str, Any]]:
    """A prompt of `new` tokens joining `batch` running decodes in one step."""
    samples = []
    for new, batch in points:
        for _ in range(repeats):
            for _ in range(batch):
                s.add(s.prompt(64), 64)
            s.engine.step()  # their prefill
            s.add(s.prompt(new), 1)
            items, elapsed = s.step()
            samples.append({"items": items, "y": elapsed})
            s.finish()
            tick()
    return samples


def decode_samples(s: StepSampler, points: Sequence[tuple[int, int]], steps: int,
                   tick: Callable[[], None]) -> list[dict[str, Any]]:
    """Decode-only steps of `batch` requests with `context` tokens each."""
    samples = []
    for batch, context in points:
        requests = [s.add(s.prompt(context), steps + 2) for _ in range(batch)]
        while any(not r.output_token_ids for r in requests):
            s.engine.step()
        for _ in range(steps):
            items, elapsed = s.step()
            samples.append({"items": items, "y": elapsed})
        s.finish()
        tick()
    return samples


# Steps timed alone and beside a neighbour: decode (batch, context) and prefill new tokens.
_NEIGHBOUR_DECODE = ((1, 128), (8, 128))
_NEIGHBOUR_PREFILL = (64, 256)
_NEIGHBOUR_BATCH = 8


def neighbour_samples(s: StepSampler, settings: ProfileSettings, repeats: int,
                      tick: Callable[[], None]) -> list[dict[str, Any]]:
    """The same steps alone, then beside a neighbour process stepping a decode batch."""

    def measure_points() -> dict[str, list[float]]:
        times: dict[str, list[float]] = {}
        for batch, context in _NEIGHBOUR_DECODE:
            for sample in decode_samples(s, [(batch, context)], max(repeats, 3), lambda: None):
                times.setdefault(f"decode b{batch} c{context}", []).append(sample["y"])
        for new in _NEIGHBOUR_PREFILL:
            for sample in prefill_samples(s, [(new, 0, 1)], repeats, lambda: None):
                times.setdefault(f"prefill {new}", []).append(sample["y"])
        return times

    alone = measure_points()
    tick()
    command = [sys.executable, "-m", "planner.measure", "neighbour", settings.model,
               settings.dtype, str(settings.torch_threads), str(settings.kv_cache_gb)]
    with subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                          text=True) as neighbour:
        try:
            assert neighbour.stdout is not None
            if neighbour.stdout.readline().strip() != "stepping":
                raise RuntimeError("the neighbour engine process did not start")
            beside = measure_points()
        finally:
            neighbour.kill()
    tick()
    return [{"point": point, "alone": alone[point], "beside": beside[point]} for point in alone]


def _neighbour(model: str, dtype: str, threads: int, kv_cache_gb: float) -> None:
    """A neighbour engine: steps a decode batch until killed (`neighbour_samples`)."""
    engine = LLMEngine(model, dtype, cache=CacheConfig(kv_cache_memory_gb=kv_cache_gb),
                       num_threads=threads)
    s = StepSampler(engine, np.random.default_rng(1))
    for _ in range(_NEIGHBOUR_BATCH):
        s.add(s.prompt(128), 10**6)
    for _ in range(4):  # the prefill, then decode steps (the first may build a kernel)
        engine.step()
    print("stepping", flush=True)
    while True:
        engine.step()


def _grids(engine: LLMEngine, quick: bool) -> dict[str, Any]:
    limit = engine.max_model_len
    news = [16, 64, 256, 512] if quick else [16, 64, 256, 512, 1024]
    cached = [0, 256] if quick else [0, 512]
    prefill = [(n, c, k) for n in news for c in cached for k in (1, 2) if c + n < limit]
    prefill += [(n, 0, 4) for n in news[:3]]
    batches = [1, 2, 4, 16] if quick else list(DECODE_BATCHES)
    contexts = [32, 256] if quick else [32, 256, 1024]
    room = engine.block_pool.num_blocks * engine.cache_config.block_size * 0.8
    decode = [(b, c) for b in batches for c in contexts if c + 8 < limit and b * (c + 8) < room]
    mixed = [(n, b) for n in news[1:3] for b in (4, 16)]
    lengths = [64, 256, 512] if quick else [64, 256, 1024]
    return {"prefill": prefill, "decode": decode, "mixed": mixed,
            "lengths": [n for n in lengths if n < limit]}


def measure(settings: ProfileSettings, transfer: TransferSampler,
            progress: Any | None = None) -> Profile:
    """Measure the engine and fit the profile (see the module docstring).

    Args:
        settings: what to profile.
        transfer: measures the exposed KV transfer between real workers.
        progress: a `rich.progress.Progress` to report on, or None.
    """
    start = time.perf_counter()
    engine = LLMEngine(settings.model, settings.dtype,
                       cache=CacheConfig(block_size=settings.block_size,
                                         kv_cache_memory_gb=settings.kv_cache_gb),
                       scheduler=SchedulerConfig(max_num_batched_tokens=8192,
                                                 max_num_seqs=256),
                       num_threads=settings.torch_threads)
    load_time = time.perf_counter() - start
    grids = _grids(engine, settings.quick)
    repeats = settings.repeats
    total = (len(grids["prefill"]) + len(grids["mixed"])) * repeats + len(grids["decode"]) \
        + len(grids["lengths"]) + 2
    task = progress.add_task("profiling", total=total) if progress is not None else None

    def tick() -> None:
        if progress is not None:
            progress.advance(task)

    s = StepSampler(engine, np.random.default_rng(settings.seed))
    s.finish()
    warm = s.add(s.prompt(64), 4)
    while s.engine.has_unfinished_requests():
        s.engine.step()
    del warm
    prefill = prefill_samples(s, grids["prefill"], repeats, tick)
    prefill += mixed_samples(s, grids["mixed"], repeats, tick)
    decode = decode_samples(s, grids["decode"], max(repeats, 3), tick)
    neighbour = neighbour_samples(s, settings, repeats, tick)
    transfers = transfer(settings, grids["lengths"], repeats, tick)
    return build_profile(settings, engine, load_time, prefill, decode, transfers, neighbour)


def build_profile(settings: ProfileSettings, engine: LLMEngine, load_time: float,
                  prefill: list[dict[str, Any]], decode: list[dict[str, Any]],
                  transfer: list[dict[str, Any]], neighbour: list[dict[str, Any]]) -> Profile:
    """Assemble the profile of `engine` from its samples (see `fit_profile`)."""
    cfg = engine.model_config
    machine = hardware()
    measured = Profile(
        model=settings.model, model_id=model_id(engine), dtype=settings.dtype,
        torch_threads=settings.torch_threads, hardware=machine,
        block_size=settings.block_size, num_blocks=engine.block_pool.num_blocks,
        kv_cache_gb=settings.kv_cache_gb,
        block_bytes=engine.kv_cache.block_bytes * cfg.num_layers,
        max_model_len=engine.max_model_len, transport=settings.transport,
        load_time_s=load_time, prefill=_EMPTY, decode=_EMPTY, transfer=_EMPTY,
        workers_per_host=max(machine["cores"] // settings.torch_threads, 1),
        samples={"prefill": prefill, "decode": decode, "transfer": transfer,
                 "neighbour": neighbour})
    return fit_profile(measured)


def fit_profile(profile: Profile) -> Profile:
    """Fit the three models (and the prefill role's factor) on the profile's raw samples.

    The prefill role's factor is the median ratio of a real prefill worker's prefill time
    (the transfer samples: layer-wise KV streaming runs inside its steps) to the step
    model's prediction for the same prompt. The neighbour slowdown is the median over its
    points of (median time beside a neighbour) / (median time alone) - 1, at least 0. The
    step spread is the standard deviation of measured over modelled decode steps.
    """
    prefill, decode, transfer = (profile.samples[k] for k in ("prefill", "decode", "transfer"))
    px = [prefill_features([(a, n) for a, n, _ in s["items"]]) for s in prefill]
    decode_names = decode_feature_names([len(s["items"]) for s in decode])
    dx = [decode_features([a + n for a, n, _ in s["items"]], decode_names) for s in decode]
    tx = [(1.0, float(s["blocks"])) for s in transfer]
    prefill_model, prefill_err = fit_held_out(PREFILL_FEATURES, px, [s["y"] for s in prefill])
    decode_model, decode_err = fit_held_out(decode_names, dx, [s["y"] for s in decode])
    transfer_model, transfer_err = fit_held_out(TRANSFER_FEATURES, tx,
                                                [s["y"] for s in transfer])
    bs = profile.block_size
    ratios = [s["prefill_s"] / prefill_model.predict(
        prefill_features([(0, s.get("tokens", s["blocks"] * bs))])) for s in transfer]
    slowdowns = [np.median(p["beside"]) / np.median(p["alone"]) - 1
                 for p in profile.samples.get("neighbour", [])]
    spread = np.std([s["y"] / decode_model.predict(x) for s, x in zip(decode, dx, strict=True)])
    return replace(profile, prefill=prefill_model, decode=decode_model, transfer=transfer_model,
                   step_cv=float(spread),
                   prefill_role_factor=float(np.median(ratios)) if ratios else 1.0,
                   neighbour_slowdown=max(float(np.median(slowdowns)), 0.0) if slowdowns else 0.0,
                   fit_error={"prefill": prefill_err, "decode": decode_err,
                              "transfer": transfer_err})


def model_id(engine: LLMEngine) -> str:
    """The model's shape: two profiles with equal ids time the same computation."""
    c = engine.model_config
    return (f"{c.architecture}:L{c.num_layers}:H{c.hidden_size}:I{c.intermediate_size}:"
            f"A{c.num_heads}/{c.num_kv_heads}x{c.head_dim}:V{c.vocab_size}")


if __name__ == "__main__":
    if sys.argv[1:2] == ["neighbour"] and len(sys.argv) == 6:
        _neighbour(sys.argv[2], sys.argv[3], int(sys.argv[4]), float(sys.argv[5]))
    else:
        sys.exit("usage: python -m planner.measure neighbour MODEL DTYPE THREADS KV_GB "
                 "(started by `pdcluster profile`)")
