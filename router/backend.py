"""What the front door needs from whatever serves requests behind it.

The router (gRPC, HTTP, admission, detokenization) talks to a `Backend`; the cluster
implements it over Ray-managed prefill and decode workers, and `EngineBackend` implements
it over one in-process engine (colocated, no Ray) for tools and tests.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from engine import SamplingParams


@dataclass(frozen=True)
class ModelInfo:
    """What the router needs to validate and tokenize."""

    name: str
    model_dir: str
    max_model_len: int
    vocab_size: int


@dataclass
class GenerateRequest:
    """A validated, tokenized request on its way to the workers.

    Args:
        traceparent: the W3C `traceparent` the backend's work belongs to: the client's as
            prepared; with tracing on, the router's request span's once `Router.generate`
            opened it (the same trace). Its trace id is on every log line about the
            request, the workers' included.
        tracestate: the W3C `tracestate` that came with `traceparent`.
    """

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    arrival_time: float
    traceparent: str | None = None
    tracestate: str | None = None


@dataclass
class TokenDelta:
    """One decode step's news for one request.

    Args:
        request_id: the request.
        token_ids: tokens produced this step (one message per step, not per token).
        finish_reason: `stop`, `length`, `abort`, `error`, or None while running.
        logprobs: one map per new token when asked for.
        num_cached_tokens: prompt tokens found in a prefix cache.
        timings: seconds, e.g. `prefill`, `transfer` (filled by the backend).
        error: a message when `finish_reason` is `error`.
        workers: the ids of the workers that served the request, when the backend says
            (e.g. on the last delta), for the request's log line.
    """

    request_id: str
    token_ids: list[int]
    finish_reason: str | None = None
    logprobs: list[dict[int, float]] | None = None
    num_cached_tokens: int = 0
    timings: dict[str, float] = field(default_factory=dict)
    error: str | None = None
    workers: tuple[str, ...] = ()


class Backend(ABC):
    """The serving side of the router."""

    @abstractmethod
    def model_info(self) -> ModelInfo: ...

    @abstractmethod
    def generate(self, request: GenerateRequest) -> AsyncIterator[TokenDelta]:
        """Stream the request's deltas; the last one has a finish_reason."""

    @abstractmethod
    async def abort(self, request_id: str) -> bool:
        """End a running request (its last delta then says `abort`); False if unknown."""

    @abstractmethod
    async def status(self) -> dict[str, Any]:
        """Pools, workers, load and KV usage."""

    @abstractmethod
    async def scale(self, num_prefill: int | None, num_decode: int | None) -> dict[str, Any]:
        """Resize the pools; returns the new status."""

    @abstractmethod
    def healthy(self) -> bool:
        """True while the backend can take requests."""
