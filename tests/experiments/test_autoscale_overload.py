"""The chat-only overload's trace and its reading of the autoscale arm's timeline."""

from __future__ import annotations

import numpy as np

from experiments.autoscale_overload import CHAT, moves, trace
from protocol.defaults import LOCAL_PREFILL_THRESHOLD


def test_the_trace_is_chat_under_the_local_prefill_threshold_at_its_rate() -> None:
    requests = trace(150, 1.6)
    assert trace(150, 1.6) == requests  # seeded
    (p_lo, p_hi), (o_lo, o_hi) = CHAT
    assert all(p_lo <= len(r.prompt_token_ids) <= p_hi < LOCAL_PREFILL_THRESHOLD
               and o_lo <= r.output_len <= o_hi for r in requests)
    gaps = np.diff([r.timestamp for r in requests])
    assert (gaps >= 0).all() and 1 / 1.6 * 0.8 < gaps.mean() < 1 / 1.6 * 1.2


def test_the_autoscale_arm_is_read_as_its_last_split_and_first_move() -> None:
    timeline = [{"t": 1.0, "prefill": 1, "decode": 1}, {"t": 2.0, "error": "timeout"},
                {"t": 3.0, "prefill": 0, "decode": 1}, {"t": 4.0, "prefill": 0, "decode": 2}]
    assert moves(timeline) == ("0P+2D", 3.0)
    assert moves(timeline[:1]) == ("1P+1D", None)
    assert moves([{"t": 1.0, "error": "refused"}]) == (None, None)
