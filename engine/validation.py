"""The one check of a request against a model's limits, shared by the router and the engine."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

from engine.sampling_params import SamplingParams


def check_request(prompt_token_ids: Sequence[int], params: SamplingParams, vocab_size: int,
                  max_model_len: int, field: str = "prompt") -> None:
    """Check a tokenized request before it takes any resource.

    Args:
        prompt_token_ids: the prompt.
        params: its sampling parameters (their own ranges are checked where they are built).
        vocab_size: token ids must be in `[0, vocab_size)`.
        max_model_len: prompt + at least one output token must fit.
        field: how the client named the prompt (`prompt`, `messages`, ...), for messages.

    Raises:
        ValueError: the message names the field and the limit.
    """
    if not isinstance(params, SamplingParams):
        raise ValueError(f"sampling_params must be SamplingParams, got {type(params).__name__}")
    if not prompt_token_ids:
        raise ValueError(f"{field}: must not be empty")
    if any(not isinstance(t, int) or isinstance(t, bool) for t in prompt_token_ids):
        raise ValueError(f"{field}: every token id must be an integer")
    bad = next((t for t in prompt_token_ids if not 0 <= t < vocab_size), None)
    if bad is not None:
        raise ValueError(f"{field}: token id {bad!r} is outside the vocabulary [0, {vocab_size})")
    if len(prompt_token_ids) >= max_model_len:
        raise ValueError(
            f"{field}: {len(prompt_token_ids)} tokens is too long; the limit is "
            f"{max_model_len - 1} (max_model_len {max_model_len} keeps room for one output "
            "token)")
    bad = next((t for t, _ in params.logit_bias if t >= vocab_size), None)
    if bad is not None:
        raise ValueError(f"logit_bias: token id {bad} is outside the vocabulary "
                         f"[0, {vocab_size})")


def fit_context(num_prompt_tokens: int, params: SamplingParams, max_model_len: int,
                defaulted: bool = False) -> SamplingParams:
    """Prompt + `max_tokens` must fit the context (vLLM answers 400 otherwise).

    Args:
        num_prompt_tokens: the prompt's length.
        params: the request's parameters.
        max_model_len: the context.
        defaulted: `max_tokens` is a default, not the request's own (the generation
            config's, or chat's "to the end of the context"): a most, cut to what fits.

    Raises:
        ValueError: the request's own `max_tokens` does not fit; the message says how many
            do.
    """
    room = max_model_len - num_prompt_tokens
    if params.max_tokens <= room:
        return params
    if defaulted:
        return replace(params, max_tokens=room, min_tokens=min(params.min_tokens, room))
    raise ValueError(
        f"max_tokens: {params.max_tokens} plus the prompt's {num_prompt_tokens} tokens "
        f"exceeds the context of {max_model_len} tokens; at most {room} fit")
