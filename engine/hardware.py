"""Measured limits of this device (matmul FLOP/s, memory read bandwidth) for utilization."""

from __future__ import annotations

import time

import torch


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
