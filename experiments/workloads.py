"""Offline benchmark workloads: token-id prompts with fixed output lengths.

A workload is engine-neutral data (token ids, not text), so every engine under test gets
byte-identical prompts and output lengths, and a peer in another venv can read it from JSON.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

# Token ids below and above this margin hold the special and rarely trained tokens.
_SPECIAL_MARGIN = 100


@dataclass(frozen=True)
class BenchRequest:
    """One request: greedy, EOS ignored, exactly `max_tokens` output tokens."""

    prompt_token_ids: list[int]
    max_tokens: int


@dataclass(frozen=True)
class Workload:
    """A named list of requests, sent to an engine all at once in this order."""

    name: str
    seed: int
    requests: list[BenchRequest]

    @property
    def prompt_tokens(self) -> int:
        return sum(len(r.prompt_token_ids) for r in self.requests)

    @property
    def output_tokens(self) -> int:
        return sum(r.max_tokens for r in self.requests)

    def save(self, path: Path) -> None:
        """Write the workload as JSON (the format the peer scripts read)."""
        path.write_text(json.dumps(asdict(self)))

    @classmethod
    def load(cls, path: Path) -> Workload:
        data = json.loads(path.read_text())
        requests = [BenchRequest(**r) for r in data.pop("requests")]
        return cls(requests=requests, **data)


def w_mixed(num_requests: int = 64, vocab_size: int = 49152, seed: int = 0,
            prompt_len: tuple[int, int] = (32, 512),
            output_len: tuple[int, int] = (16, 128)) -> Workload:
    """W-mixed: random-token prompts and output lengths, each uniform over an inclusive range.

    Requests are drawn one after another from one generator, so the first k requests of a
    workload are the same for every `num_requests >= k` (smoke runs are a prefix of the real one).

    Args:
        num_requests: how many requests.
        vocab_size: the model's vocabulary; ids are drawn from [100, vocab_size - 100).
        seed: seed of `numpy.random.default_rng`.
        prompt_len: (min, max) prompt length in tokens.
        output_len: (min, max) output length in tokens.
    """
    _check_range("prompt_len", prompt_len)
    _check_range("output_len", output_len)
    if num_requests < 1:
        raise ValueError(f"num_requests must be >= 1, got {num_requests}")
    rng = np.random.default_rng(seed)
    requests = []
    for _ in range(num_requests):
        n_prompt = int(rng.integers(prompt_len[0], prompt_len[1] + 1))
        n_output = int(rng.integers(output_len[0], output_len[1] + 1))
        requests.append(BenchRequest(_random_ids(rng, n_prompt, vocab_size), n_output))
    return Workload("W-mixed", seed, requests)


def uniform(num_requests: int, prompt_len: int, output_len: int, vocab_size: int = 49152,
            seed: int = 0) -> Workload:
    """`num_requests` random-token prompts of one length, each asking for `output_len` tokens."""
    _check_range("prompt_len", (prompt_len, prompt_len))
    _check_range("output_len", (output_len, output_len))
    rng = np.random.default_rng(seed)
    requests = [BenchRequest(_random_ids(rng, prompt_len, vocab_size), output_len)
                for _ in range(num_requests)]
    return Workload(f"uniform-{num_requests}x{prompt_len}+{output_len}", seed, requests)


def _random_ids(rng: np.random.Generator, n: int, vocab_size: int) -> list[int]:
    if vocab_size <= 2 * _SPECIAL_MARGIN:
        raise ValueError(f"vocab_size must be > {2 * _SPECIAL_MARGIN}, got {vocab_size}")
    return rng.integers(_SPECIAL_MARGIN, vocab_size - _SPECIAL_MARGIN, size=n).tolist()


def _check_range(name: str, bounds: tuple[int, int]) -> None:
    low, high = bounds
    if low < 1 or high < low:
        raise ValueError(f"{name} must satisfy 1 <= min <= max, got {bounds}")
