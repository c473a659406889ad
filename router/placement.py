"""Placement: which decode worker holds a request, and whether a prefill worker computes it.

Pure functions over the latest load snapshot of each worker, so they are easy to test and
to reason about. Prefix affinity uses the router's own chained hashes of the prompt's
leading blocks (the engine's own chained block hash, so a router prefix and an engine
cache hit name the same blocks): the worker that last served the longest matching prefix is
preferred while it has room.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

from engine import hash_blocks


@dataclass
class WorkerLoad:
    """The router's view of one worker (from its pushed stats)."""

    worker_id: str
    role: str
    num_free_blocks: int = 0
    num_blocks: int = 1
    num_running: int = 0
    num_waiting: int = 0
    queued_prefill_tokens: int = 0
    in_flight: int = 0  # requests placed here and not finished, by the router's count


@dataclass(frozen=True)
class Placement:
    decode_worker: str
    prefill_worker: str | None  # None: the decode worker prefills locally


class PrefixIndex:
    """Remembers which worker last saw each prompt prefix (bounded, LRU).

    Args:
        block_size: tokens per hashed block.
        capacity: most prefixes remembered.
    """

    def __init__(self, block_size: int = 16, capacity: int = 100_000) -> None:
        self.block_size = block_size
        self.capacity = capacity
        self._owner: OrderedDict[bytes, dict[str, str]] = OrderedDict()

    def hashes(self, prompt_token_ids: list[int]) -> list[bytes]:
        """Chained hashes of the prompt's full blocks (`engine.block_pool.hash_blocks`)."""
        return hash_blocks(prompt_token_ids, self.block_size)

    def match(self, hashes: list[bytes], role: str) -> tuple[str | None, int]:
        """The worker of `role` holding the longest known prefix, and its length in blocks."""
        best, length = None, 0
        for i, h in enumerate(hashes):
            owner = self._owner.get(h, {}).get(role)
            if owner is None:
                break
            best, length = owner, i + 1
        return best, length

    def record(self, hashes: list[bytes], role: str, worker_id: str) -> None:
        for h in hashes:
            self._owner.setdefault(h, {})[role] = worker_id
            self._owner.move_to_end(h)
        while len(self._owner) > self.capacity:
            self._owner.popitem(last=False)

    def discard(self, prompt_token_ids: list[int], placement: Placement) -> None:
        """Undo what placing this prompt recorded: its KV transfer failed and the decode
        worker released the blocks, so neither worker holds them. The retry must not
        believe the decode worker caches the prompt and prefill it there."""
        for h in self.hashes(prompt_token_ids):
            owners = self._owner.get(h, {})
            for role, worker_id in (("decode", placement.decode_worker),
                                    ("prefill", placement.prefill_worker)):
                if owners.get(role) == worker_id:
                    del owners[role]

    def forget(self, worker_id: str) -> None:
        for owners in self._owner.values():
            for role in [r for r, w in owners.items() if w == worker_id]:
                del owners[role]


def pick_decode(workers: list[WorkerLoad], preferred: str | None) -> WorkerLoad | None:
    """The decode worker with the most free KV and least load; the prefix owner if it has room.

    Returns None when there is no decode worker.
    """
    if not workers:
        return None
    by_id = {w.worker_id: w for w in workers}
    owner = by_id.get(preferred) if preferred else None
    if owner is not None and owner.num_free_blocks > owner.num_blocks // 8:
        return owner
    return max(workers, key=lambda w: (w.num_free_blocks / max(w.num_blocks, 1)
                                       - 0.05 * (w.num_running + w.in_flight)))


def pick_prefill(workers: list[WorkerLoad], preferred: str | None) -> WorkerLoad | None:
    """The prefill worker with the least queued prompt tokens (prefix owner on ties)."""
    if not workers:
        return None
    return min(workers, key=lambda w: (w.queued_prefill_tokens + 512 * w.in_flight,
                                       w.worker_id != preferred))


def place(prompt_len: int, decode: list[WorkerLoad], prefill: list[WorkerLoad],
          decode_hit_tokens: int, decode_owner: str | None, prefill_owner: str | None,
          local_prefill_threshold: int) -> Placement | None:
    """Choose D, and P unless the uncached prompt is short or no prefill worker is healthy.

    Args:
        prompt_len: prompt tokens.
        decode: healthy, non-draining decode (or mixed) workers.
        prefill: healthy, non-draining prefill workers.
        decode_hit_tokens: prompt tokens the preferred decode worker likely has cached.
        decode_owner: decode worker holding the longest known prefix.
        prefill_owner: prefill worker holding the longest known prefix.
        local_prefill_threshold: uncached prompts at most this long are prefilled on D.

    Returns:
        None when no decode worker can take it.
    """
    d = pick_decode(decode, decode_owner)
    if d is None:
        return None
    uncached = prompt_len - (decode_hit_tokens if d.worker_id == decode_owner else 0)
    p = None if uncached <= local_prefill_threshold else pick_prefill(prefill, prefill_owner)
    return Placement(d.worker_id, p.worker_id if p is not None else None)


def place_request(index: PrefixIndex, prompt_token_ids: list[int], decode: list[WorkerLoad],
                  prefill: list[WorkerLoad], local_prefill_threshold: int,
                  hashes: list[bytes] | None = None) -> Placement | None:
    """Look the prompt up in the prefix index, `place` it, and record where it went.

    Args:
        index: the router's prefix index (updated).
        prompt_token_ids: the prompt.
        decode: healthy, non-draining decode (or mixed) workers.
        prefill: healthy, non-draining prefill workers.
        local_prefill_threshold: uncached prompts at most this long are prefilled on D.
        hashes: `index.hashes(prompt_token_ids)`, when the caller already has them.

    Returns:
        None when no decode worker can take it.
    """
    if hashes is None:
        hashes = index.hashes(prompt_token_ids)
    d_owner, d_blocks = index.match(hashes, "decode")
    p_owner, _ = index.match(hashes, "prefill")
    placement = place(len(prompt_token_ids), decode, prefill, d_blocks * index.block_size,
                      d_owner, p_owner, local_prefill_threshold)
    if placement is not None:
        index.record(hashes, "decode", placement.decode_worker)
        if placement.prefill_worker:
            index.record(hashes, "prefill", placement.prefill_worker)
    return placement


def spread_onto(counts: dict[str, int], joined: str) -> dict[str, int]:
    """How many requests each worker hands to `joined`, a worker that just joined the pool,
    so that the pool's counts end as even as whole requests allow.

    Takes one request at a time from the busiest worker while it holds at least two more
    than `joined`; each move lowers the spread, so the loop ends.

    Args:
        counts: running requests per worker of the pool, `joined` included.
        joined: the worker that receives them.

    Returns:
        The number to move from each worker that gives any.
    """
    counts = dict(counts)
    moves: dict[str, int] = {}
    others = [w for w in counts if w != joined]
    while others:
        source = max(others, key=lambda w: counts[w])
        if counts[source] - counts[joined] <= 1:
            break
        counts[source] -= 1
        counts[joined] += 1
        moves[source] = moves.get(source, 0) + 1
    return moves
