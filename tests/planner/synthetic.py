"""Synthetic profiles and traces with known step times, for tests with closed-form answers."""

from __future__ import annotations

import numpy as np

from planner.profile import (
    LINEAR_DECODE_FEATURES,
    PREFILL_FEATURES,
    TRANSFER_FEATURES,
    LinearModel,
    Profile,
)
from protocol.serving import TraceRequest


def synthetic_profile(prefill: tuple[float, float, float, float] = (0.1, 0.0, 0.0, 0.0),
                      decode: tuple[float, float, float] = (0.01, 0.0, 0.0),
                      transfer: tuple[float, float] = (0.0, 0.0), num_blocks: int = 4096,
                      model: str = "synthetic", block_size: int = 16) -> Profile:
    """A profile whose step times are the given coefficients (see planner.profile)."""
    return Profile(model=model, model_id=f"{model}-id", dtype="float32", torch_threads=1,
                   hardware={}, block_size=block_size, num_blocks=num_blocks, kv_cache_gb=1.0,
                   block_bytes=1024, max_model_len=8192, transport="shm", load_time_s=1.0,
                   prefill=LinearModel(PREFILL_FEATURES, prefill),
                   decode=LinearModel(LINEAR_DECODE_FEATURES, decode),
                   transfer=LinearModel(TRANSFER_FEATURES, transfer))


def random_prompts(n: int, length: int | tuple[int, int], seed: int) -> list[list[int]]:
    """Random prompts (no two share a block, so no prefix hits)."""
    rng = np.random.default_rng(seed)
    lengths = [length] * n if isinstance(length, int) else \
        rng.integers(length[0], length[1] + 1, n).tolist()
    return [rng.integers(100, 40_000, size).tolist() for size in lengths]


def poisson_arrivals(n: int, rate: float, seed: int) -> np.ndarray:
    """n Poisson arrivals at `rate`, the first at 0."""
    gaps = np.random.default_rng(seed).exponential(1.0 / rate, n - 1)
    return np.concatenate(([0.0], np.cumsum(gaps)))


def trace(arrivals: np.ndarray, prompts: list[list[int]], output_len: int | list[int]
          ) -> list[TraceRequest]:
    outputs = [output_len] * len(prompts) if isinstance(output_len, int) else output_len
    return [TraceRequest(float(a), o, p) for a, p, o in zip(arrivals, prompts, outputs,
                                                            strict=True)]
