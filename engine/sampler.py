"""Token selection: greedy, temperature, top-k, top-p, min-p, seeds, logprobs."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.sampling_params import SamplingParams


@dataclass
class SampleResult:
    token_ids: list[int]
    # Per row: token id -> log-probability (top-n plus the sampled token), or None.
    logprobs: list[dict[int, float] | None]


def sample(logits: torch.Tensor, params: list[SamplingParams],
           generators: list[torch.Generator | None]) -> SampleResult:
    """Pick one token per row of `logits` `[N, vocab]`.

    Greedy rows are one batched argmax; the others are filtered and drawn row by row,
    each from its own generator when the request has a seed.
    """
    logits = logits.float()
    token_ids = logits.argmax(dim=-1)
    for i, p in enumerate(params):
        if not p.greedy:
            probs = _filtered_probs(logits[i], p)
            token_ids[i] = torch.multinomial(probs, 1, generator=generators[i])[0]
    tokens = token_ids.tolist()
    logprobs: list[dict[int, float] | None] = [None] * len(params)
    wanted = [i for i, p in enumerate(params) if p.logprobs is not None]
    if wanted:
        all_logprobs = torch.log_softmax(logits[wanted], dim=-1)
        for row, i in enumerate(wanted):
            logprobs[i] = _top_logprobs(all_logprobs[row], params[i].logprobs or 0, tokens[i])
    return SampleResult(tokens, logprobs)


def _filtered_probs(logits: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    """Probabilities `[vocab]` after temperature, top-k, top-p and min-p."""
    logits = logits / p.temperature
    if p.top_k > 0 and p.top_k < logits.numel():
        kth = torch.topk(logits, p.top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if p.top_p < 1.0:
        sorted_probs, order = probs.sort(descending=True)
        # Keep a token while the mass before it is below top_p (the top one always stays).
        drop = sorted_probs.cumsum(0) - sorted_probs >= p.top_p
        probs = probs.scatter(0, order[drop], 0.0)
    if p.min_p > 0.0:
        probs = probs.masked_fill(probs < p.min_p * probs.max(), 0.0)
    return probs / probs.sum()


def _top_logprobs(logprobs: torch.Tensor, n: int, sampled: int) -> dict[int, float]:
    out = {sampled: logprobs[sampled].item()}
    if n:
        values, ids = torch.topk(logprobs, n)
        out.update(zip(ids.tolist(), values.tolist(), strict=True))
    return out
