"""What a serving benchmark sends and when: synthetic workloads, arrival processes, JSONL traces.

A trace line is one request:

    {"timestamp": 0.25, "prompt_len": 512, "output_len": 128}

`timestamp` is the arrival in seconds (a trace is shifted so its first request arrives at 0),
`output_len` the exact number of output tokens asked for, and the prompt is one of `prompt`
(text), `prompt_token_ids` (exact ids; what `write_trace` writes, so a run replays byte for
byte) or `prompt_len` (random ids of that length are drawn, seeded).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

WORKLOADS = ("synthetic", "shared-prefix", "long-prompt", "long-output", "mixed")
ARRIVALS = ("poisson", "gamma", "fixed")
# Token ids outside this range are mostly special or rarely trained tokens (SmolLM2, Llama).
DEFAULT_VOCAB_RANGE = (100, 49000)

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
_PROMPT_STREAM, _ARRIVAL_STREAM, _TRACE_STREAM = 0, 1, 2


@dataclass(frozen=True)
class TraceRequest:
    """One request of a run.

    Args:
        timestamp: arrival, in seconds after the run starts.
        output_len: output tokens asked for (greedy, EOS ignored, so exact).
        prompt_token_ids: the prompt as token ids; or
        prompt: the prompt as text.
    """

    timestamp: float
    output_len: int
    prompt_token_ids: list[int] | None = None
    prompt: str | None = None

    def __post_init__(self) -> None:
        if (self.prompt_token_ids is None) == (self.prompt is None):
            raise ValueError("a request needs exactly one of prompt_token_ids or prompt")
        if self.output_len < 1:
            raise ValueError(f"output_len must be >= 1, got {self.output_len}")
        if self.timestamp < 0:
            raise ValueError(f"timestamp must be >= 0, got {self.timestamp}")

    @property
    def prompt_len(self) -> int | None:
        """Prompt tokens when the prompt is token ids; None for text (the server counts)."""
        return None if self.prompt_token_ids is None else len(self.prompt_token_ids)


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
    prefixes = [_random_ids(rng, spec.prefix_len, spec.vocab_range)
                for _ in range(spec.num_prefix_groups)]
    requests = []
    for timestamp in timestamps:
        kind = spec.kind if spec.kind != "mixed" else str(rng.choice(_SINGLE_WORKLOADS))
        prompt_len, output_len = spec.lengths(kind)
        ids = _random_ids(rng, _uniform_int(rng, prompt_len), spec.vocab_range)
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


def read_trace(path: Path, vocab_range: tuple[int, int] = DEFAULT_VOCAB_RANGE,
               seed: int = 0) -> list[TraceRequest]:
    """Read a JSONL trace (see the module docstring).

    Args:
        path: the file.
        vocab_range: where random ids for `prompt_len` lines come from.
        seed: seeds those ids.

    Returns:
        The requests sorted by arrival, the first at 0.

    Raises:
        ValueError: a line is not a valid request; the message names the line.
    """
    rng = np.random.default_rng((seed, _TRACE_STREAM))
    requests = []
    for number, line in enumerate(path.read_text().splitlines(), start=1):
        if not line.strip():
            continue
        try:
            requests.append(_trace_request(json.loads(line), rng, vocab_range))
        except (ValueError, TypeError, KeyError) as e:
            raise ValueError(f"{path}:{number}: {e}") from e
    if not requests:
        raise ValueError(f"{path}: the trace has no requests")
    start = min(r.timestamp for r in requests)
    shifted = [TraceRequest(r.timestamp - start, r.output_len, r.prompt_token_ids, r.prompt)
               for r in requests]
    return sorted(shifted, key=lambda r: r.timestamp)


def write_trace(path: Path, requests: Sequence[TraceRequest]) -> None:
    """Write requests as a JSONL trace with their exact prompts.

    Args:
        path: the file (overwritten).
        requests: what to write.
    """
    lines = []
    for r in requests:
        line: dict[str, Any] = {"timestamp": r.timestamp, "output_len": r.output_len}
        if r.prompt is not None:
            line["prompt"] = r.prompt
        else:
            line["prompt_token_ids"] = r.prompt_token_ids
        lines.append(json.dumps(line))
    path.write_text("".join(f"{line}\n" for line in lines))


def _trace_request(line: dict[str, Any], rng: np.random.Generator,
                   vocab_range: tuple[int, int]) -> TraceRequest:
    if "timestamp" not in line or "output_len" not in line:
        raise ValueError("a trace line needs timestamp and output_len")
    prompt, ids = line.get("prompt"), line.get("prompt_token_ids")
    if prompt is None and ids is None:
        if "prompt_len" not in line:
            raise ValueError("a trace line needs one of prompt, prompt_token_ids, prompt_len")
        ids = _random_ids(rng, int(line["prompt_len"]), vocab_range)
    return TraceRequest(float(line["timestamp"]), int(line["output_len"]), ids, prompt)


def _uniform_int(rng: np.random.Generator, bounds: tuple[int, int]) -> int:
    return int(rng.integers(bounds[0], bounds[1] + 1))


def _random_ids(rng: np.random.Generator, n: int, vocab_range: tuple[int, int]) -> list[int]:
    if n < 1:
        raise ValueError(f"prompt_len must be >= 1, got {n}")
    return rng.integers(vocab_range[0], vocab_range[1], size=n).tolist()
