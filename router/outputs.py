"""What the router streams back for one request; shared by the servers and the client."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class Usage:
    """Token counts of a finished request."""

    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0


@dataclass(frozen=True)
class Timings:
    """Seconds from the request's arrival at the router; zero when a stage did not happen."""

    queue: float = 0.0
    prefill: float = 0.0
    transfer: float = 0.0
    ttft: float = 0.0
    e2e: float = 0.0


@dataclass(frozen=True)
class TokenLogprob:
    """The sampled token's log-probability and the step's top-n alternatives."""

    token_id: int
    logprob: float
    top_logprobs: dict[int, float] = field(default_factory=dict)


@dataclass(frozen=True)
class GenerateOutput:
    """One message of a request's stream.

    Args:
        request_id: the request.
        text: new text since the previous message.
        token_ids: new tokens since the previous message.
        logprobs: one entry per new token, when asked for.
        finish_reason: `stop`, `length`, `abort` or `error` on the last message, else None.
        usage: on the last message.
        timings: on the last message.
        error: what went wrong when `finish_reason` is `error`.
    """

    request_id: str
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] | None = None
    finish_reason: str | None = None
    usage: Usage | None = None
    timings: Timings | None = None
    error: str | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None
