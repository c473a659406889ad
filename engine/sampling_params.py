"""Per-request sampling parameters, vLLM-shaped and checked where they are built."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from engine.structured_output import check_json_schema


@dataclass(frozen=True)
class SamplingParams:
    """How to pick tokens and when to stop.

    Args:
        max_tokens: most tokens to generate (>= 1).
        min_tokens: tokens to generate before EOS or stop tokens may end the request.
        temperature: 0 means greedy; otherwise logits are divided by it.
        top_k: keep the k most likely tokens; -1 (or 0) keeps all.
        top_p: keep the smallest set whose probability reaches top_p, in (0, 1].
        min_p: drop tokens whose probability is below min_p times the top one, in [0, 1].
        seed: per-request seed; the same seed gives the same tokens.
        stop: strings that end generation; the matched string is not returned.
        stop_token_ids: token ids that end generation (besides EOS).
        ignore_eos: keep generating after EOS.
        logprobs: also return the log-probabilities of the top-n tokens (and the sampled
            one) at each step; None for none.
        skip_special_tokens: leave special tokens out of the text.
        presence_penalty: subtracted once from the logit of every token already in the
            output, in [-2, 2] (OpenAI's definition).
        frequency_penalty: subtracted from a token's logit once per time it is already in
            the output, in [-2, 2] (OpenAI's definition).
        repetition_penalty: a token already in the prompt or the output has a positive logit
            divided by it and a negative one multiplied by it; 1 is off, > 0 (the CTRL /
            Hugging Face / vLLM definition).
        logit_bias: token id -> value in [-100, 100] added to its logit before sampling
            (a mapping is accepted and frozen into sorted pairs).
        json_schema: the output must be JSON matching this JSON Schema (the schema's JSON
            text); `{"type": "object"}` asks for any JSON object. Enforced by a grammar mask.
    """

    max_tokens: int = 16
    min_tokens: int = 0
    temperature: float = 1.0
    top_k: int = -1
    top_p: float = 1.0
    min_p: float = 0.0
    seed: int | None = None
    stop: tuple[str, ...] = field(default_factory=tuple)
    stop_token_ids: tuple[int, ...] = field(default_factory=tuple)
    ignore_eos: bool = False
    logprobs: int | None = None
    skip_special_tokens: bool = True
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: tuple[tuple[int, float], ...] = field(default_factory=tuple)
    json_schema: str | None = None

    def __post_init__(self) -> None:
        # Lists are accepted for convenience and frozen into tuples (they also come back as
        # lists after a msgpack round trip to a worker).
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        object.__setattr__(self, "stop", tuple(self.stop))
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))
        object.__setattr__(self, "logit_bias", _bias_pairs(self.logit_bias))
        self._check()

    def _check(self) -> None:
        _check_int("max_tokens", self.max_tokens, low=1)
        _check_int("min_tokens", self.min_tokens, low=0)
        if self.min_tokens > self.max_tokens:
            raise ValueError(f"min_tokens ({self.min_tokens}) must be <= max_tokens "
                             f"({self.max_tokens})")
        if not _is_real(self.temperature) or self.temperature < 0:
            raise ValueError(f"temperature must be a finite number >= 0, got {self.temperature}")
        _check_int("top_k", self.top_k, low=-1)
        if not _is_real(self.top_p) or not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if not _is_real(self.min_p) or not 0 <= self.min_p <= 1:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        if self.seed is not None:
            _check_int("seed", self.seed, low=0)
        if self.logprobs is not None:
            _check_int("logprobs", self.logprobs, low=0, high=20)
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise ValueError("stop must be a list of non-empty strings")
        for token_id in self.stop_token_ids:
            _check_int("stop_token_ids", token_id, low=0)
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not _is_real(value) or not -2 <= value <= 2:
                raise ValueError(f"{name} must be in [-2, 2], got {value}")
        if not _is_real(self.repetition_penalty) or self.repetition_penalty <= 0:
            raise ValueError(f"repetition_penalty must be > 0, got {self.repetition_penalty}")
        for token_id, bias in self.logit_bias:
            _check_int("logit_bias token id", token_id, low=0)
            if not _is_real(bias) or not -100 <= bias <= 100:
                raise ValueError(f"logit_bias[{token_id}] must be in [-100, 100], got {bias}")
        if self.json_schema is not None:
            check_json_schema(self.json_schema)

    @property
    def has_penalties(self) -> bool:
        """True when any presence, frequency or repetition penalty is set."""
        return (self.presence_penalty != 0 or self.frequency_penalty != 0
                or self.repetition_penalty != 1)

    @property
    def greedy(self) -> bool:
        """True when sampling reduces to argmax."""
        return self.temperature == 0 or self.top_k == 1


def _bias_pairs(bias: object) -> tuple[tuple[int, float], ...]:
    """`{token id: bias}` (JSON gives the ids as strings) or pairs, as sorted pairs."""
    items = bias.items() if isinstance(bias, dict) else bias
    try:
        pairs = [(_token_key(token_id), value) for token_id, value in items]  # type: ignore[union-attr]
    except (TypeError, ValueError):
        raise ValueError(f"logit_bias must map token ids to numbers, got {bias!r}") from None
    return tuple(sorted(dict(pairs).items()))  # one entry per id (`5` and `"5"` are one)


def _token_key(token_id: object) -> int:
    if isinstance(token_id, str) and token_id.lstrip("-").isdigit():
        return int(token_id)
    if isinstance(token_id, int) and not isinstance(token_id, bool):
        return token_id
    raise ValueError(f"not a token id: {token_id!r}")


def _is_real(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


def _check_int(name: str, value: object, low: int, high: int | None = None) -> None:
    if not isinstance(value, int) or isinstance(value, bool):
        raise ValueError(f"{name} must be an integer, got {value!r}")
    if value < low or (high is not None and value > high):
        limit = f">= {low}" if high is None else f"in [{low}, {high}]"
        raise ValueError(f"{name} must be {limit}, got {value}")
