"""Speculative decoding: configuration, draft proposers and what a step leaves to account.

A speculative decode step of one request: a proposer drafts up to K tokens after its last
token; one batched forward of the target model computes the last token and the K drafts
(K + 1 query positions over the paged cache, with every other request of the batch); the
verifier accepts a prefix of the drafts and adds one token of its own, so a step emits 1 to
K + 1 tokens (the rule: `engine/spec_verify.py`, which the model runner applies). KV
slots of rejected drafts are rolled back by the scheduler (blocks past the accepted length
freed; only verified tokens ever reach the prefix cache).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, fields
from typing import Any, Literal

import numpy as np

from engine.model_runner import ModelRunner
from engine.request import Request
from engine.scheduler import ScheduledRequest, SchedulerOutput

Method = Literal["ngram", "draft"]

# vLLM's default n-gram window when neither bound is given.
_DEFAULT_LOOKUP = 5
_MAX_SPECULATIVE_TOKENS = 32


@dataclass(frozen=True)
class SpeculativeConfig:
    """`--speculative-config`, with vLLM's key names.

    Args:
        method: `ngram` (prompt lookup over prompt + output, no second model) or `draft`.
        num_speculative_tokens: K, the most tokens drafted per step.
        prompt_lookup_max: ngram: the longest suffix matched (vLLM: both bounds default to
            5; one given sets the other).
        prompt_lookup_min: ngram: the shortest suffix matched.
        model: draft: `self`, an early-exit draft of the target, or the path of a smaller
            model sharing the target's tokenizer (loaded like the target, with its own KV
            pages: `engine/draft_model.py`).
        draft_layers: draft `self`: the first L target layers the draft runs (then the
            target's final norm and LM head); not a key of a draft model path.
    """

    method: Method
    num_speculative_tokens: int
    prompt_lookup_max: int | None = None
    prompt_lookup_min: int | None = None
    model: str | None = None
    draft_layers: int | None = None

    def __post_init__(self) -> None:
        if self.method not in ("ngram", "draft"):
            raise ValueError(f"speculative_config.method: must be 'ngram' or 'draft', got "
                             f"{self.method!r}")
        _check_int("num_speculative_tokens", self.num_speculative_tokens, 1,
                   _MAX_SPECULATIVE_TOKENS)
        if self.method == "ngram":
            self._check_ngram()
        else:
            self._check_draft()

    def _check_ngram(self) -> None:
        _forbid(self, ("model", "draft_layers"), "ngram")
        lo, hi = self.prompt_lookup_min, self.prompt_lookup_max
        for key, value in (("prompt_lookup_min", lo), ("prompt_lookup_max", hi)):
            if value is not None:
                _check_int(key, value, 1, 1024)
        if lo is None and hi is None:
            lo = hi = _DEFAULT_LOOKUP
        lo = hi if lo is None else lo
        hi = lo if hi is None else hi
        if lo > hi:
            raise ValueError(f"speculative_config.prompt_lookup_min ({lo}) must be <= "
                             f"prompt_lookup_max ({hi})")
        object.__setattr__(self, "prompt_lookup_min", lo)
        object.__setattr__(self, "prompt_lookup_max", hi)

    def _check_draft(self) -> None:
        _forbid(self, ("prompt_lookup_max", "prompt_lookup_min"), "draft")
        if not isinstance(self.model, str) or not self.model:
            raise ValueError(f"speculative_config.model: required with method 'draft': 'self' "
                             f"(an early-exit draft of the target, with draft_layers) or the "
                             f"path of a draft model directory, got {self.model!r}")
        if self.model != "self":
            if self.draft_layers is not None:
                raise ValueError("speculative_config.draft_layers: only with model 'self' (a "
                                 f"draft model at {self.model!r} runs all its layers)")
            return
        if self.draft_layers is None:
            raise ValueError("speculative_config.draft_layers: required with model 'self'")
        _check_int("draft_layers", self.draft_layers, 1, 10**6)

    @property
    def draft_model(self) -> str | None:
        """The path of a separate draft model, or None (n-gram, or the self-draft)."""
        return self.model if self.method == "draft" and self.model != "self" else None

    @staticmethod
    def parse(value: str | Mapping[str, Any] | SpeculativeConfig | None
              ) -> SpeculativeConfig | None:
        """Build from JSON text or a mapping (None stays None).

        Raises:
            ValueError: bad JSON, an unknown or missing key, or a bad value; the message
                names the key.
        """
        if value is None or isinstance(value, SpeculativeConfig):
            return value
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as e:
                raise ValueError(f"speculative_config: not valid JSON ({e})") from None
        if not isinstance(value, Mapping):
            raise ValueError("speculative_config: must be a JSON object")
        known = {f.name for f in fields(SpeculativeConfig)}
        unknown = sorted(set(value) - known)
        if unknown:
            raise ValueError(f"speculative_config: unknown key {unknown[0]!r}; known keys: "
                             f"{', '.join(sorted(known))}")
        for key in ("method", "num_speculative_tokens"):
            if key not in value:
                raise ValueError(f"speculative_config.{key}: required")
        return SpeculativeConfig(**value)


def _check_int(key: str, value: Any, low: int, high: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise ValueError(f"speculative_config.{key}: must be an integer in [{low}, {high}], "
                         f"got {value!r}")


def _forbid(config: SpeculativeConfig, keys: Sequence[str], method: str) -> None:
    for key in keys:
        if getattr(config, key) is not None:
            raise ValueError(f"speculative_config.{key}: not a key of method {method!r}")


def speculates(request: Request) -> bool:
    """Whether a request may decode speculatively; the others decode plainly in the same
    batch. Grammars (`json_schema`) would need the matcher rolled back past rejected drafts;
    seeded sampling must stay the exact sample plain decoding draws (a migrated or
    disaggregated request's generator is advanced by one draw per token, `skip_draws`)."""
    p = request.params
    return request.grammar is None and (p.greedy or p.seed is None)


# The most plain steps a request waits before drafting again after its drafts missed.
MAX_DRAFT_BACKOFF = 16


def draft_allowed(request: Request) -> bool:
    """Whether the request drafts this step: not while it waits out a back-off (one plain
    step is counted off per call)."""
    if request.spec_skip > 0:
        request.spec_skip -= 1
        return False
    return True


def record_verified(request: Request, num_accepted: int) -> None:
    """Back off from drafting where drafts miss: a verify step costs more than a plain one
    (K + 1 query positions through the prompt attention path), so a request whose drafts
    were all rejected decodes plainly for 1, 2, 4 ... up to `MAX_DRAFT_BACKOFF` steps
    before drafting again; an accepted draft resets the wait. Output is unchanged either
    way: verification alone decides the tokens."""
    if num_accepted > 0:
        request.spec_backoff = 0
        return
    request.spec_backoff = min(max(2 * request.spec_backoff, 1), MAX_DRAFT_BACKOFF)
    request.spec_skip = request.spec_backoff


# ---- proposers -------------------------------------------------------------------------


def ngram_propose(token_ids: Sequence[int], k: int, lookup_min: int, lookup_max: int
                  ) -> list[int]:
    """Prompt lookup: find the latest earlier occurrence of the sequence's last n tokens
    (n from `lookup_max` down to `lookup_min`) and propose the up to `k` tokens after it."""
    tokens = np.asarray(token_ids, dtype=np.int64)
    for n in range(min(lookup_max, len(tokens) - 1), lookup_min - 1, -1):
        pattern = tokens[-n:]
        # Windows that start early enough to have at least one token after them.
        windows = np.lib.stride_tricks.sliding_window_view(tokens[:-1], n)
        hits = np.flatnonzero((windows == pattern).all(axis=1))
        if len(hits):
            start = int(hits[-1]) + n
            return tokens[start:start + k].tolist()
    return []


class Speculator:
    """Drafts tokens for the scheduled speculative requests of a step.

    Args:
        config: the speculative configuration.
        runner: the target's model runner (the self-draft runs its first layers).
        draft_runner: the draft model's runner (`config.draft_model`; its own KV pages,
            indexed by the target's block ids).
    """

    def __init__(self, config: SpeculativeConfig, runner: ModelRunner,
                 draft_runner: ModelRunner | None = None) -> None:
        self.config = config
        self.runner = runner
        self.draft_runner = draft_runner
        num_layers = runner.model.cfg.num_layers
        if config.model == "self" and config.draft_layers >= num_layers:  # type: ignore[operator]
            raise ValueError(f"speculative_config.draft_layers: must be below the target's "
                             f"{num_layers} layers, got {config.draft_layers}")

    def propose(self, schedule: SchedulerOutput) -> None:
        """Set `spec_token_ids` (at most the reserved lookahead) and `num_new_tokens` of
        every scheduled item that reserved a lookahead."""
        items = [s for s in schedule.scheduled if s.num_lookahead]
        if not items:
            return
        if self.config.method == "ngram":
            c = self.config
            for s in items:
                s.request.spec_token_ids = ngram_propose(
                    s.request.all_token_ids, s.num_lookahead, c.prompt_lookup_min or 1,
                    c.prompt_lookup_max or 1)
        else:
            self._draft(items)
        for s in items:
            s.num_new_tokens = 1 + len(s.request.spec_token_ids)

    def _draft(self, items: list[ScheduledRequest]) -> None:
        """Greedy drafts, one token per request per pass.

        The self-draft is an early exit: the first L layers, the final norm and the LM
        head. Layers < L of the target compute the same KV for the same tokens, so it
        writes straight into the target's pages (the slots the scheduler reserved);
        verification rewrites them, and rolled-back slots are simply overwritten later.

        A draft model first catches up, in the same pass as its first draft, on the tokens
        it has not computed (the whole prompt after a transfer, a migration or a
        preemption; the tokens of plain steps during a back-off; the last verified ones);
        `trim_draft` keeps its count to the verified tokens after the step."""
        requests = [r.request for r in items]
        runner, num_layers = self.draft_runner, None
        if runner is None:
            runner, num_layers = self.runner, self.config.draft_layers
            for r in requests:
                r.draft_num_computed = r.num_tokens - 1
        starts = [r.draft_num_computed for r in requests]
        tokens = [r.token_ids(start, r.num_tokens) for r, start in zip(requests, starts,
                                                                        strict=True)]
        for r in requests:
            r.spec_token_ids = []
        for step in range(max(s.num_lookahead for s in items)):
            active = [i for i, s in enumerate(items) if s.num_lookahead > step]
            logits = runner.draft_step([requests[i] for i in active],
                                       [starts[i] for i in active],
                                       [tokens[i] for i in active], num_layers)
            for i, token in zip(active, logits.argmax(dim=-1).tolist(), strict=True):
                requests[i].spec_token_ids.append(token)
                starts[i] += len(tokens[i])
                tokens[i] = [token]
        for r, start in zip(requests, starts, strict=True):
            r.draft_num_computed = start


def trim_draft(request: Request) -> None:
    """After a step: the draft model's KV stays valid only up to the verified tokens (the
    slots of rejected drafts are overwritten by the next catch-up)."""
    request.draft_num_computed = min(request.draft_num_computed, request.num_computed_tokens)


class SpecCounters:
    """Running totals of verification: drafted, accepted and emitted tokens, and the
    request-steps that verified drafts."""

    def __init__(self) -> None:
        self.draft_tokens = self.accepted_tokens = self.emitted_tokens = self.verify_steps = 0

    def record(self, num_drafted: int, num_emitted: int) -> None:
        """Count one verified request-step: drafts offered, tokens it emitted."""
        self.draft_tokens += num_drafted
        self.accepted_tokens += num_emitted - 1
        self.emitted_tokens += num_emitted
        self.verify_steps += 1

    def stats(self) -> dict[str, Any]:
        """The totals, the acceptance rate (accepted / drafted) and tokens per verify step
        (emitted / request-steps; 1 to K + 1)."""
        return {"spec_draft_tokens": self.draft_tokens,
                "spec_accepted_tokens": self.accepted_tokens,
                "spec_emitted_tokens": self.emitted_tokens,
                "spec_verify_steps": self.verify_steps,
                "spec_acceptance_rate": self.accepted_tokens / self.draft_tokens
                if self.draft_tokens else 0.0,
                "spec_tokens_per_step": self.emitted_tokens / self.verify_steps
                if self.verify_steps else 0.0}


def finish_step(schedule: SchedulerOutput, new_tokens: Mapping[str, Sequence[int]],
                counters: SpecCounters) -> None:
    """Account for a step once the scheduler has advanced its requests: count each verified
    request-step, back off drafting where all drafts missed (`record_verified`) and keep a
    draft model's KV to the verified tokens (`trim_draft`).

    Args:
        schedule: the step's schedule, as the proposer left it (a request that drafted
            computed its last token and its drafts: `num_new_tokens` is 1 + drafted).
        new_tokens: request id -> the tokens the step appended, for the requests it changed.
        counters: the engine's running totals.
    """
    for s in schedule.scheduled:
        request = s.request
        trim_draft(request)
        num_drafted = s.num_new_tokens - 1 if s.num_lookahead else 0
        emitted = new_tokens.get(request.request_id)
        if num_drafted and emitted is not None:
            counters.record(num_drafted, len(emitted))
            record_verified(request, len(emitted) - 1)
