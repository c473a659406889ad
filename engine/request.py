"""One request model for every phase, and the outputs handed back to callers."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from engine.sampling_params import SamplingParams

if TYPE_CHECKING:
    from engine.structured_output import GrammarMatcher


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    # Decode role: blocks reserved, KV being written by a remote prefill.
    WAITING_FOR_REMOTE_KV = "waiting_for_remote_kv"
    RUNNING = "running"
    # Prefill role: prompt computed, KV held until the transfer is done.
    PREFILLED = "prefilled"
    FINISHED = "finished"


# `RequestStatus.FINISHED` is a slow lookup on Python 3.11 (a class whose metaclass defines
# `__getattr__`, as `EnumType` does, looks every attribute up on a slow path), and
# `is_finished` is asked several times per request per step.
_FINISHED = RequestStatus.FINISHED


class Request:
    """A request catches up `num_computed_tokens` to `num_tokens`, one step at a time.

    A request whose KV arrived from a remote prefill is simply one whose
    `num_computed_tokens` jumped to the prompt length.
    """

    def __init__(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                 eos_token_ids: tuple[int, ...] = (), max_model_len: int | None = None,
                 arrival_time: float | None = None, ttft_deadline: float | None = None
                 ) -> None:
        self.request_id = request_id
        self.prompt_token_ids = list(prompt_token_ids)
        self.output_token_ids: list[int] = []
        self.params = params
        self.max_output_tokens = params.max_tokens
        if max_model_len is not None:
            self.max_output_tokens = min(params.max_tokens, max_model_len - len(prompt_token_ids))
        self.eos_token_ids = () if params.ignore_eos else eos_token_ids
        self.status = RequestStatus.WAITING
        self.num_computed_tokens = 0
        self.num_cached_tokens = 0
        self.block_ids: list[int] = []
        # Chained hashes of the full blocks, as far as `KVCacheManager.block_hashes` got.
        self.block_hashes: list[bytes] = []
        # Drafted tokens this step verifies (speculative decoding); never part of the output.
        self.spec_token_ids: list[int] = []
        # Plain steps left before drafting again, and the wait after the next miss
        # (`spec_decode.record_verified`).
        self.spec_skip = 0
        self.spec_backoff = 0
        # Tokens whose KV a separate draft model has computed (`engine/draft_model.py`).
        self.draft_num_computed = 0
        self.finish_reason: str | None = None
        self.logprobs: list[dict[int, float]] = []
        self.arrival_time = time.monotonic() if arrival_time is None else arrival_time
        # `time.monotonic()` by which its first token is due (a TTFT objective), or None:
        # the scheduler serves waiting requests that can still make theirs first.
        self.ttft_deadline = ttft_deadline
        self.first_token_time: float | None = None
        self.num_preemptions = 0
        self.generator: torch.Generator | None = None
        # Set by the engine when `params.json_schema` asks for structured output.
        self.grammar: GrammarMatcher | None = None
        if params.seed is not None:
            self.generator = torch.Generator().manual_seed(params.seed)

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    def token_ids(self, start: int, end: int) -> list[int]:
        """Tokens `[start, end)` of prompt + output, without concatenating the whole sequence."""
        n = len(self.prompt_token_ids)
        if start >= n:
            return self.output_token_ids[start - n:end - n]
        return self.prompt_token_ids[start:end] + self.output_token_ids[:max(end - n, 0)]

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status is _FINISHED

    def append_token(self, token_id: int) -> None:
        """Record a sampled token and decide whether the request is done."""
        if not self.output_token_ids:
            self.first_token_time = time.monotonic()
        self.output_token_ids.append(token_id)
        num_out = len(self.output_token_ids)
        if num_out >= self.params.min_tokens and (
                token_id in self.eos_token_ids or token_id in self.params.stop_token_ids):
            self.finish("stop")
        elif num_out >= self.max_output_tokens:
            self.finish("length")

    def finish(self, reason: str) -> None:
        self.status = RequestStatus.FINISHED
        self.finish_reason = reason


@dataclass
class CompletionOutput:
    """One generated sequence.

    Args:
        index: position among the request's sequences (always 0: one sequence a request).
        text: the detokenized output (stop string removed).
        token_ids: all generated token ids.
        finish_reason: `stop`, `length`, `abort`, `error`, or None while running.
        logprobs: per generated token, a map token id -> log-probability (top-n plus the
            sampled token), or None when not requested.
    """

    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None = None
    logprobs: list[dict[int, float]] | None = None


@dataclass
class RequestOutput:
    """What a request has produced so far."""

    request_id: str
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool = False
    num_cached_tokens: int = 0
    metrics: dict[str, float] = field(default_factory=dict)
