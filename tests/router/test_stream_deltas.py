"""A backend step that brings several tokens (speculative decoding) ends at the token that
completed a stop string: later tokens of the step are neither streamed nor counted."""

from __future__ import annotations

import time

from engine import SamplingParams
from router.backend import GenerateRequest, TokenDelta
from router.router import Router, _Stream


def test_a_multi_token_step_is_cut_at_the_stop_string(backend):
    router = Router(backend)
    ids = router.tokenizer.encode("one two three four five", add_special_tokens=False)
    request = GenerateRequest("multi", [5, 6, 7], SamplingParams(stop=["thr"]),
                              time.monotonic())
    stream = _Stream(router, request)
    first = stream.take(TokenDelta("multi", ids[:1]))
    assert first is not None and first.finish_reason is None
    # The backend would end this request by length: the stop string came first.
    last = stream.take(TokenDelta("multi", ids[1:], finish_reason="length",
                                  logprobs=[{t: -1.0} for t in ids[1:]]))
    assert last is not None and last.finish_reason == "stop"
    taken = stream.detok.num_tokens
    assert 1 < taken < len(ids)
    assert last.token_ids == ids[1:taken] and len(last.logprobs) == taken - 1
    assert first.text + last.text == "one two "
    assert last.usage.completion_tokens == taken
