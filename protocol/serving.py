"""What the load generator and the planner share: the trace a run replays, the SLO it is
scored against, and how latencies are summarized.

`pdcluster bench` replays a trace and measures it; `pdcluster plan` simulates the same trace
and predicts it. Both read this module, so a prediction and a measurement are the same
figures of the same requests under the same SLO.

A trace line (JSONL) is one request:

    {"timestamp": 0.25, "prompt_len": 512, "output_len": 128}

`timestamp` is the arrival in seconds (a trace is shifted so its first request arrives at 0),
`output_len` the exact number of output tokens asked for, and the prompt is one of `prompt`
(text), `prompt_token_ids` (exact ids; what `write_trace` writes, so a run replays byte for
byte) or `prompt_len` (random ids of that length are drawn, seeded).
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

PERCENTILES = (50, 90, 99)
METRICS = ("ttft", "tpot", "e2e")
# `<metric>_ms` bounds each request; `<metric>_p<q>_ms` bounds each request and the run's
# q-th percentile.
PERCENTILE_KEYS = tuple(f"{m}_p{q}_ms" for m in METRICS for q in PERCENTILES)
SLO_KEYS = tuple(f"{m}_ms" for m in METRICS) + PERCENTILE_KEYS
# Token ids outside this range are mostly special or rarely trained tokens (SmolLM2, Llama).
DEFAULT_VOCAB_RANGE = (100, 49000)
_TRACE_STREAM = 2  # the random stream `prompt_len` lines draw from (see bench.traces)


SLO_EXAMPLE = "ttft_p90_ms=500,tpot_p90_ms=50"
# `--slo` on serve, plan and bench: one syntax, `Slo.parse`'s.
SLO_HELP = (f"latency objectives, KEY=MS comma-separated (e.g. {SLO_EXAMPLE}; ttft=MS is "
            "short for ttft_ms=MS); keys: ttft, tpot, e2e with _ms (each request) or "
            "_p50_ms/_p90_ms/_p99_ms (also that percentile of the run)")


@dataclass(frozen=True)
class Slo:
    """Latency objectives and the share of requests that must meet them.

    A request meets the SLO when it succeeded and each of its TTFT, TPOT and E2E is within
    the tightest bound named on that metric (a one-token answer has no TPOT and meets any
    TPOT bound); `protocol.slo` scores a run so. A run meets it when the share of requests
    that do (the attainment) reaches `attainment` and every percentile bound holds.

    Args:
        bounds: milliseconds by key, any of `SLO_KEYS`: `ttft_ms` bounds each request,
            `ttft_p90_ms` each request and the run's 90th percentile.
        attainment: the share of requests that must meet the per-request bounds.

    Raises:
        ValueError: an unknown key, a bound <= 0, or an attainment outside (0, 1].
    """

    bounds: Mapping[str, float] = field(default_factory=dict)
    attainment: float = 0.9

    def __post_init__(self) -> None:
        object.__setattr__(self, "bounds", {k: float(v) for k, v in self.bounds.items()})
        for key, value in self.bounds.items():
            if key not in SLO_KEYS:
                raise ValueError(f"slo: unknown key {key!r}; use any of {', '.join(SLO_KEYS)}")
            if not value > 0:
                raise ValueError(f"slo: {key} must be > 0 ms, got {value:g}")
        if not 0 < self.attainment <= 1:
            raise ValueError(f"slo: attainment must be in (0, 1], got {self.attainment}")

    @classmethod
    def parse(cls, text: str, attainment: float = 0.9) -> Slo:
        """Parse `ttft_p90_ms=500,tpot_p90_ms=50`; `ttft=500` is short for `ttft_ms=500`.

        Raises:
            ValueError: an unknown key, a value that is not a number > 0, or no bound.
        """
        bounds: dict[str, float] = {}
        for part in filter(None, (p.strip() for p in text.split(","))):
            key, sep, value = part.partition("=")
            if not sep:
                raise ValueError(f"slo: expected KEY=MS, got {part!r} (the one syntax: "
                                 f"{SLO_EXAMPLE}; vLLM's ttft:MS pairs go to bench --goodput)")
            key = key.strip()
            key = f"{key}_ms" if key in METRICS else key
            try:
                bounds[key] = float(value)
            except ValueError:
                raise ValueError(f"slo: {key} must be a number of ms, got {value!r}") from None
        if not bounds:
            raise ValueError("slo: give at least one bound, e.g. ttft_p90_ms=500,tpot_p90_ms=50")
        return cls(bounds, attainment)

    @classmethod
    def from_goodput(cls, pairs: Iterable[str]) -> Slo:
        """Parse `vllm bench serve --goodput` pairs: `ttft:MS`, `tpot:MS`, `e2el:MS`.

        Raises:
            ValueError: an unknown key or a value that is not a number > 0.
        """
        names = {"ttft": "ttft_ms", "tpot": "tpot_ms", "e2el": "e2e_ms"}
        bounds: dict[str, float] = {}
        for pair in pairs:
            key, sep, value = pair.partition(":")
            if not sep or key not in names:
                raise ValueError(f"goodput: expected KEY:MS with KEY one of ttft, tpot, e2el, "
                                 f"got {pair!r}")
            try:
                bounds[names[key]] = float(value)
            except ValueError:
                raise ValueError(f"goodput: {key} must be a number of ms, got {value!r}") from None
        if not bounds:
            raise ValueError("goodput: give at least one of ttft:MS, tpot:MS, e2el:MS")
        return cls(bounds)

    def bound(self, metric: str) -> float | None:
        """The per-request bound on `ttft`, `tpot` or `e2e` in ms (the tightest named), or
        None."""
        values = [v for k, v in self.bounds.items() if k.startswith(f"{metric}_")]
        return min(values) if values else None

    def meets(self, figures: Mapping[str, Any]) -> bool:
        """Whether a run's figures (`attainment` and `<metric>_p<q>_ms`) meet the SLO: the
        attainment reaches the target and every percentile bound holds."""
        if figures["attainment"] < self.attainment:
            return False
        return all(figures.get(k) is None or figures[k] <= v for k, v in self.bounds.items()
                   if k in PERCENTILE_KEYS)

    def text(self) -> str:
        """The bounds as `parse` reads them."""
        return ",".join(f"{k}={v:g}" for k, v in self.bounds.items())

    def as_dict(self) -> dict[str, float]:
        """The bounds and the attainment target, as reports and plan files record them."""
        return {**self.bounds, "attainment": self.attainment}


def distribution(values: Sequence[float], scale: float = 1.0) -> dict[str, float | None]:
    """Mean and percentiles (linear interpolation), each times `scale`; None when empty.

    Args:
        values: the samples.
        scale: e.g. 1e3 to turn seconds into milliseconds.

    Returns:
        `{"mean", "p50", "p90", "p99"}`.
    """
    keys = ("mean", *(f"p{p}" for p in PERCENTILES))
    if not len(values):
        return dict.fromkeys(keys)
    array = np.asarray(values, dtype=np.float64) * scale
    stats = [array.mean(), *np.percentile(array, PERCENTILES)]
    return {key: float(value) for key, value in zip(keys, stats, strict=True)}


@dataclass(frozen=True)
class TraceRequest:
    """One request of a trace: what a run sends (bench) or simulates (planner), and when.

    Args:
        timestamp: arrival, in seconds after the run starts.
        output_len: output tokens asked for (greedy, EOS ignored, so exact).
        prompt_token_ids: the prompt as token ids; or
        prompt: the prompt as text.

    Raises:
        ValueError: neither or both prompts, an output_len < 1 or a negative timestamp.
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
        ValueError: a line is not a valid request, or there is none; the message names the
            line.
    """
    rng = np.random.default_rng((seed, _TRACE_STREAM))
    requests = []
    for number, line in enumerate(Path(path).read_text().splitlines(), start=1):
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
        line: dict[str, object] = {"timestamp": r.timestamp, "output_len": r.output_len}
        if r.prompt is not None:
            line["prompt"] = r.prompt
        else:
            line["prompt_token_ids"] = r.prompt_token_ids
        lines.append(json.dumps(line))
    Path(path).write_text("".join(f"{line}\n" for line in lines))


def random_ids(rng: np.random.Generator, n: int,
               vocab_range: tuple[int, int] = DEFAULT_VOCAB_RANGE) -> list[int]:
    """`n` random token ids from `vocab_range`.

    Raises:
        ValueError: n < 1.
    """
    if n < 1:
        raise ValueError(f"prompt_len must be >= 1, got {n}")
    return rng.integers(vocab_range[0], vocab_range[1], size=n).tolist()


def _trace_request(line: Mapping[str, Any], rng: np.random.Generator,
                   vocab_range: tuple[int, int]) -> TraceRequest:
    if "timestamp" not in line or "output_len" not in line:
        raise ValueError("a trace line needs timestamp and output_len")
    prompt, ids = line.get("prompt"), line.get("prompt_token_ids")
    if prompt is None and ids is None:
        if "prompt_len" not in line:
            raise ValueError("a trace line needs one of prompt, prompt_token_ids, prompt_len")
        ids = random_ids(rng, int(line["prompt_len"]), vocab_range)
    return TraceRequest(float(line["timestamp"]), int(line["output_len"]), ids, prompt)
