"""Block-id lists as contiguous runs, raw byte views of KV slices, and per-block checksums."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch
import xxhash

# (src_start, dst_start, num_blocks): blocks consecutive on both sides move as one slice.
Run = tuple[int, int, int]


def check_block_ids(block_ids: Sequence[int], num_blocks: int, what: str) -> list[int]:
    """Validate block ids against a pool of `num_blocks`.

    Args:
        block_ids: ids to check.
        num_blocks: size of the pool they index.
        what: argument name for the error message.

    Returns:
        The ids as a list of Python ints.

    Raises:
        ValueError: an id is out of range or repeated.
    """
    ids = [int(b) for b in block_ids]
    bad = [b for b in ids if not 0 <= b < num_blocks]
    if bad:
        raise ValueError(f"{what}: ids {bad} are outside the pool of {num_blocks} blocks")
    if len(set(ids)) != len(ids):
        raise ValueError(f"{what}: repeated ids in {ids}")
    return ids


def block_runs(src: Sequence[int], dst: Sequence[int]) -> list[Run]:
    """Group (src, dst) pairs into runs consecutive on both sides, in order."""
    runs: list[Run] = []
    for s, d in zip(src, dst, strict=True):
        if runs and runs[-1][0] + runs[-1][2] == s and runs[-1][1] + runs[-1][2] == d:
            runs[-1] = (runs[-1][0], runs[-1][1], runs[-1][2] + 1)
        else:
            runs.append((s, d, 1))
    return runs


def dst_runs(dst: Sequence[int], counts: Sequence[int]) -> list[tuple[int, int]]:
    """Split a receiver's block list into the sender's runs.

    Args:
        dst: destination block ids of a request, in order.
        counts: the sender's run lengths.

    Returns:
        `(dst_start, num_blocks)` per run.

    Raises:
        ValueError: the counts do not cover `dst`, or a run is not consecutive in `dst`.
    """
    if sum(counts) != len(dst) or any(n < 1 for n in counts):
        raise ValueError(f"runs {list(counts)} do not cover {len(dst)} blocks")
    runs, offset = [], 0
    for n in counts:
        start = dst[offset]
        if list(dst[offset:offset + n]) != list(range(start, start + n)):
            raise ValueError(f"run of {n} blocks at {start} is not consecutive in {list(dst)}")
        runs.append((start, n))
        offset += n
    return runs


def as_bytes(tensor: torch.Tensor) -> memoryview:
    """A writable byte view of a contiguous CPU tensor, without copying (any dtype)."""
    if not tensor.is_contiguous():
        raise ValueError("KV slices must be contiguous to move without a copy")
    return memoryview(tensor.detach().reshape(-1).view(torch.uint8).numpy())


def copy_runs(dst: torch.Tensor, src: torch.Tensor, runs: Sequence[Run]) -> None:
    """Copy `src[s:s+n]` to `dst[d:d+n]` for each run (CPU, one memcpy per run).

    numpy's copy is one thread that releases the GIL: at memory bandwidth already, and it
    leaves the engine's intra-op pool alone. torch's `copy_` splits even a memcpy across
    that pool, which measured 2-5x slower on a busy 2-core machine; `index_copy_` of a
    gathered source (two copies) managed 1-2.5 GB/s.
    """
    for s, d, n in runs:
        np.copyto(np.asarray(as_bytes(dst[d:d + n])), np.asarray(as_bytes(src[s:s + n])))


def block_sums(layer: torch.Tensor, block_ids: Sequence[int]) -> list[int]:
    """xxh3_64 of each block of one layer (`[num_blocks, 2, block_size, H, D]`)."""
    return [xxhash.xxh3_64_intdigest(as_bytes(layer[b].cpu())) for b in block_ids]
