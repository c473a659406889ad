"""What a serving benchmark sends and when: synthetic workloads and arrival processes.

The requests are `protocol.serving.TraceRequest`s, the JSONL trace format is read and
written there (the planner reads the same traces).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from protocol.serving import DEFAULT_VOCAB_RANGE, TraceRequest, random_ids

WORKLOADS = ("synthetic", "shared-prefix", "long-prompt", "long-output", "mixed")
ARRIVALS = ("poisson", "gamma", "fixed")

# (prompt_len, output_len) ranges, inclusive, of each single workload; for shared-prefix the
# prompt range is the part after the shared prefix.
_DEFAULT_LENGTHS = {
    "synthetic": ((128, 512), (64, 256)),
    "shared-prefix": ((32, 128), (64, 256)),
    "long-prompt": ((1024, 1536), (16, 64)),
    "long-output": ((32, 128), (512, 1024)),
}
_SINGLE_WORKLOADS = tuple(_DEFAULT_LENGTHS)
# Independent random streams from one user seed.
# (protocol.serving.read_trace draws `prompt_len` lines' ids from stream 2.)
_PROMPT_STREAM, _ARRIVAL_STREAM = 0, 1


@dataclass(frozen=True)
class WorkloadSpec:
    """A synthetic workload: random-token prompts and exact output lengths.

    Args:
        kind: one of `WORKLOADS`. `shared-prefix` puts one of `num_prefix_groups` random
            system prompts of `prefix_len` tokens before each prompt; `mixed` draws each
            request's kind from the four others, with their default lengths.
        prompt_len: (min, max) prompt tokens, inclusive; None takes the kind's default.
        output_len: (min, max) output tokens, inclusive; None takes the kind's default.
        num_prefix_groups: shared prefixes (shared-prefix and mixed).
        prefix_len: tokens in each shared prefix.
        vocab_range: token ids are drawn from [low, high).
        seed: seeds every random choice.
    """

    kind: str = "synthetic"
    prompt_len: tuple[int, int] | None = None
    output_len: tuple[int, int] | None = None
    num_prefix_groups: int = 4
    prefix_len: int = 256
    vocab_range: tuple[int, int] = DEFAULT_VOCAB_RANGE
    seed: int = 0

    def __post_init__(self) -> None:
        if self.kind not in WORKLOADS:
            raise ValueError(f"workload must be one of {', '.join(WORKLOADS)}, got {self.kind!r}")
        if self.kind == "mixed" and (self.prompt_len or self.output_len):
            raise ValueError("prompt_len and output_len do not apply to the mixed workload "
                             "(it uses each kind's default lengths)")
        for name in ("prompt_len", "output_len"):
            bounds = getattr(self, name)
            if bounds is not None and not 1 <= bounds[0] <= bounds[1]:
                raise ValueError(f"{name} must satisfy 1 <= min <= max, got {bounds}")
        if self.num_prefix_groups < 1 or self.prefix_len < 1:
            raise ValueError("num_prefix_groups and prefix_len must be >= 1, got "
                             f"{self.num_prefix_groups} and {self.prefix_len}")
        low, high = self.vocab_range
        if not 0 <= low < high:
            raise ValueError(f"vocab_range must satisfy 0 <= low < high, got {self.vocab_range}")

    def lengths(self, kind: str) -> tuple[tuple[int, int], tuple[int, int]]:
        """(prompt_len, output_len) ranges of one single kind, the user's where given."""
        prompt_len, output_len = _DEFAULT_LENGTHS[kind]
        return self.prompt_len or prompt_len, self.output_len or output_len


def make_workload(spec: WorkloadSpec, timestamps: Sequence[float]) -> list[TraceRequest]:
    """One request per arrival time, drawn from `spec`.

    Args:
        spec: the workload.
        timestamps: arrival times in seconds (see `arrival_times`).

    Returns:
        The requests, in the order of `timestamps`; the same for the same spec.
    """
    rng = np.random.default_rng((spec.seed, _PROMPT_STREAM))
    prefixes = [random_ids(rng, spec.prefix_len, spec.vocab_range)
                for _ in range(spec.num_prefix_groups)]
    requests = []
    for timestamp in timestamps:
        kind = spec.kind if spec.kind != "mixed" else str(rng.choice(_SINGLE_WORKLOADS))
        prompt_len, output_len = spec.lengths(kind)
        ids = random_ids(rng, _uniform_int(rng, prompt_len), spec.vocab_range)
        if kind == "shared-prefix":
            ids = prefixes[int(rng.integers(len(prefixes)))] + ids
        requests.append(TraceRequest(float(timestamp), _uniform_int(rng, output_len), ids))
    return requests


def arrival_times(num_requests: int, rate: float, process: str = "poisson",
                  burstiness: float = 1.0, seed: int = 0) -> np.ndarray:
    """Arrival times of a renewal process; the first request arrives at 0.

    Args:
        num_requests: how many arrivals.
        rate: mean requests per second; `inf` sends every request at 0.
        process: `poisson` (exponential gaps), `gamma` (gamma gaps whose coefficient of
            variation is `burstiness`; 1 is Poisson, larger is burstier) or `fixed` (1/rate).
        burstiness: the gamma gaps' coefficient of variation (std / mean).
        seed: seeds the gaps.

    Returns:
        `[num_requests]` float64 seconds, non-decreasing.
    """
    if num_requests < 1:
        raise ValueError(f"num_requests must be >= 1, got {num_requests}")
    if not rate > 0:
        raise ValueError(f"rate must be > 0 requests/s, got {rate}")
    if process not in ARRIVALS:
        raise ValueError(f"arrival must be one of {', '.join(ARRIVALS)}, got {process!r}")
    if not burstiness > 0:
        raise ValueError(f"burstiness must be > 0, got {burstiness}")
    if np.isinf(rate):
        return np.zeros(num_requests)
    rng = np.random.default_rng((seed, _ARRIVAL_STREAM))
    num_gaps = num_requests - 1
    if process == "fixed":
        gaps = np.full(num_gaps, 1.0 / rate)
    else:
        # Gamma with shape k and scale 1/(rate k) has mean 1/rate and CV 1/sqrt(k).
        shape = 1.0 if process == "poisson" else 1.0 / burstiness**2
        gaps = rng.gamma(shape, 1.0 / (rate * shape), size=num_gaps)
    return np.concatenate(([0.0], np.cumsum(gaps)))


def _uniform_int(rng: np.random.Generator, bounds: tuple[int, int]) -> int:
    return int(rng.integers(bounds[0], bounds[1] + 1))
