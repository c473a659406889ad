"""Speculative decoding's verification rule: which drafted tokens a request keeps.

Drafts are deterministic (the n-gram continuation, the draft model's argmax), so the draft
distribution is a point mass and the rejection-sampling rule is: accept draft x with
probability p(x), else sample from p with x removed and renormalised; p is the target's
distribution after the request's own processing (bias, penalties with the drafted prefix as
history) and filtering (temperature, top-k, top-p, min-p). Greedy requests accept a draft
exactly when it is the argmax, so their output equals plain decoding.
"""

from __future__ import annotations

import torch

from engine.request import Request
from engine.sampler import filtered_probs, process_row, top_logprobs


class _Prefix:
    """A request seen with some drafted tokens appended to its output: the history that
    penalties read at a verified position."""

    def __init__(self, request: Request, drafted: list[int]) -> None:
        self.params = request.params
        self.generator = request.generator
        self.prompt_token_ids = request.prompt_token_ids
        self.output_token_ids = request.output_token_ids + drafted
        self.grammar = None


def verify(logits: torch.Tensor, request: Request, draft: list[int]
           ) -> tuple[list[int], list[dict[int, float]] | None]:
    """Accept a prefix of `draft` and add one token.

    Args:
        logits: `[len(draft) + 1, vocab]`, row j the target's logits after the request's
            tokens and `draft[:j]`.
        request: the request (its params, output so far and generator).
        draft: the drafted tokens.

    Returns:
        The emitted tokens (the accepted drafts, then the correction or bonus token) and,
        when asked for, their logprobs (of the raw logits, as plain sampling reports them).
    """
    raw = logits.float()
    p = request.params
    processed = raw
    if p.logit_bias or p.has_penalties:
        processed = raw.clone()
        for j in range(len(draft) + 1):
            process_row(processed[j], _Prefix(request, draft[:j]))
    tokens = _accept_greedy(processed, draft) if p.greedy else \
        _accept_sampled(processed, draft, request)
    logprobs = None
    if p.logprobs is not None:
        rows = torch.log_softmax(raw[:len(tokens)], dim=-1)
        logprobs = [top_logprobs(rows[j], p.logprobs, t) for j, t in enumerate(tokens)]
    return tokens, logprobs


def _accept_greedy(logits: torch.Tensor, draft: list[int]) -> list[int]:
    best = logits.argmax(dim=-1).tolist()
    out = []
    for j, x in enumerate(draft):
        out.append(best[j])
        if best[j] != x:
            return out
    out.append(best[len(draft)])
    return out


def _accept_sampled(logits: torch.Tensor, draft: list[int], request: Request) -> list[int]:
    gen = request.generator
    out = []
    for j, x in enumerate(draft):
        probs = filtered_probs(logits[j], request.params)
        if torch.rand(1, generator=gen).item() < probs[x].item():
            out.append(x)
            continue
        probs[x] = 0.0
        out.append(int(torch.multinomial(probs / probs.sum(), 1, generator=gen)[0]))
        return out
    probs = filtered_probs(logits[len(draft)], request.params)
    out.append(int(torch.multinomial(probs, 1, generator=gen)[0]))
    return out
