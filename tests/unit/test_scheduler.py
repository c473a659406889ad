import time

import pytest

from engine.block_pool import BlockPool
from engine.config import SchedulerConfig
from engine.kv_cache_manager import KVCacheManager
from engine.request import Request, RequestStatus
from engine.sampling_params import SamplingParams
from engine.scheduler import Scheduler


def _scheduler(num_blocks: int = 64, block_size: int = 4, **cfg) -> Scheduler:
    return Scheduler(SchedulerConfig(**cfg),
                     KVCacheManager(BlockPool(num_blocks, enable_prefix_caching=False),
                                    block_size))


def _add(s: Scheduler, rid: str, n: int, max_tokens: int = 8) -> Request:
    request = Request(rid, list(range(1, n + 1)), SamplingParams(max_tokens=max_tokens,
                                                                 ignore_eos=True))
    s.add_request(request)
    return request


def _step(s: Scheduler, token: int = 7) -> dict[str, int]:
    out = s.schedule()
    plan = {item.request.request_id: item.num_new_tokens for item in out.scheduled}
    sampled = {i.request.request_id: [token] for i in out.scheduled if i.samples}
    s.postprocess(out, sampled)
    return plan


def test_token_budget_chunks_long_prompts():
    s = _scheduler(max_num_batched_tokens=8)
    _add(s, "a", 20)
    _add(s, "b", 3)
    assert _step(s) == {"a": 8}
    assert _step(s) == {"a": 8}
    assert _step(s) == {"a": 4, "b": 3}
    assert _step(s) == {"a": 1, "b": 1}


def test_without_chunking_a_prompt_waits_for_a_whole_budget():
    s = _scheduler(max_num_batched_tokens=10, enable_chunked_prefill=False)
    _add(s, "a", 6)
    _add(s, "b", 6)
    assert _step(s) == {"a": 6}
    assert _step(s) == {"a": 1, "b": 6}


def test_max_num_seqs_caps_the_batch():
    s = _scheduler(max_num_seqs=2)
    for rid in "abc":
        _add(s, rid, 4)
    assert _step(s) == {"a": 4, "b": 4}
    assert _step(s) == {"a": 1, "b": 1}


def test_preemption_recomputes_the_newest_request():
    # 4 blocks of 4 tokens: two 6-token prompts fit (2 blocks each) until both need a third.
    s = _scheduler(num_blocks=4, block_size=4)
    a = _add(s, "a", 6, max_tokens=8)
    b = _add(s, "b", 6, max_tokens=8)
    assert _step(s) == {"a": 6, "b": 6}  # 6 computed, 7 tokens each
    assert _step(s) == {"a": 1, "b": 1}  # positions 6 and 7 still fit in 2 blocks
    assert _step(s) == {"a": 1, "b": 1}
    plan = _step(s)  # position 8 needs a third block: b is preempted
    assert plan == {"a": 1}
    assert b.status == RequestStatus.WAITING and b.num_computed_tokens == 0
    assert b.block_ids == [] and b.num_preemptions == 1
    assert len(b.output_token_ids) == 3  # recomputed later, tokens kept
    while s.has_work():
        _step(s)
    assert len(a.output_token_ids) == 8 and len(b.output_token_ids) == 8
    assert s.kv.pool.num_free_blocks == 4


def test_static_policy_admits_only_when_the_batch_is_done():
    s = _scheduler(policy="static", max_num_seqs=2)
    _add(s, "a", 4, max_tokens=1)
    _add(s, "b", 4, max_tokens=3)
    _add(s, "c", 4, max_tokens=1)
    assert _step(s) == {"a": 4, "b": 4}  # a finishes on its first token
    assert _step(s) == {"b": 1}  # c waits although a seat is free
    assert _step(s) == {"b": 1}
    assert _step(s) == {"c": 4}


def test_prefill_role_parks_requests_after_the_first_token():
    s = _scheduler(role="prefill")
    a = _add(s, "a", 5)
    assert _step(s) == {"a": 5}
    assert a.status == RequestStatus.PREFILLED and s.parked == {"a": a}
    assert not s.has_work() and len(a.block_ids) == 2
    s.finish("a", "stop")
    assert s.kv.pool.num_free_blocks == 64


def test_decode_role_remote_request_joins_running():
    s = _scheduler(role="decode")
    request = Request("r", list(range(1, 10)), SamplingParams(max_tokens=3, ignore_eos=True))
    assert s.reserve_remote(request)
    assert request.block_ids == [0, 1, 2] and not s.has_work()
    s.complete_remote("r", 42)
    assert request.output_token_ids == [42] and request.num_computed_tokens == 9
    assert _step(s) == {"r": 1}
    assert _step(s) == {"r": 1}
    assert request.is_finished and s.kv.pool.num_free_blocks == 64


# ---- waiting order under TTFT deadlines (`Scheduler.order_waiting`) ----

def _add_due(s: Scheduler, rid: str, n: int, arrival: float, deadline: float | None
             ) -> Request:
    request = Request(rid, list(range(1, n + 1)), SamplingParams(max_tokens=4, ignore_eos=True),
                      arrival_time=arrival, ttft_deadline=deadline)
    s.add_request(request)
    return request


def _order(s: Scheduler, now: float) -> list[str]:
    s.order_waiting(now)
    return [r.request_id for r in s.waiting]


def test_without_deadlines_waiting_prompts_keep_arrival_order():
    s = _scheduler()
    for i, rid in enumerate("cab"):
        _add_due(s, rid, 4, arrival=float(i), deadline=None)
    assert _order(s, now=100.0) == ["c", "a", "b"]


def test_prompts_that_can_still_meet_their_deadline_go_first_earliest_first():
    s = _scheduler()
    _add_due(s, "late", 4, arrival=0.0, deadline=5.0)      # missed at now=6
    _add_due(s, "later", 4, arrival=1.0, deadline=20.0)    # fine
    _add_due(s, "soon", 4, arrival=2.0, deadline=10.0)     # fine, due first
    _add_due(s, "late2", 4, arrival=3.0, deadline=5.5)     # missed too
    _add_due(s, "free", 4, arrival=4.0, deadline=None)     # no objective: after the due ones
    assert _order(s, now=6.0) == ["soon", "later", "free", "late", "late2"]


def test_a_prompt_whose_prefill_would_end_past_its_deadline_yields_to_one_that_can_make_it():
    s = _scheduler()
    s.observe_step(1000, 1.0)  # 1 ms a token
    _add_due(s, "long", 3000, arrival=0.0, deadline=2.0)   # 3 s of prefill: ends at 3 > 2
    _add_due(s, "short", 500, arrival=0.5, deadline=2.5)   # 0.5 s: ends at 0.5 + 0 < 2.5
    assert _order(s, now=0.0) == ["short", "long"]
    # With no rate learnt yet, nothing is known to be too long: earliest deadline first.
    fresh = _scheduler()
    _add_due(fresh, "long", 3000, arrival=0.0, deadline=2.0)
    _add_due(fresh, "short", 500, arrival=0.5, deadline=2.5)
    assert _order(fresh, now=0.0) == ["long", "short"]


def test_a_prompt_that_would_end_late_behind_the_ones_before_it_yields_its_place():
    s = _scheduler()
    s.observe_step(1000, 1.0)  # 1 ms a token: each 1000-token prompt takes 1 s
    _add_due(s, "a", 1000, arrival=0.0, deadline=1.0)  # ends at 1.0: in time
    _add_due(s, "b", 1000, arrival=0.1, deadline=1.5)  # behind a, ends at 2.0: late
    _add_due(s, "c", 1000, arrival=0.2, deadline=2.1)  # behind a (not b), ends at 2.0
    assert _order(s, now=0.0) == ["a", "c", "b"]
    # A running prompt's 500 tokens still to compute come first: a would end at 1.5, late;
    # b then ends at 1.5, in time; c behind b at 2.5, late. The late ones by arrival.
    running = Request("r", list(range(1, 1001)), SamplingParams(max_tokens=4))
    running.num_computed_tokens = 500
    s.running.append(running)
    assert _order(s, now=0.0) == ["b", "a", "c"]


def test_a_late_prompt_is_promoted_once_it_waited_past_its_deadline_as_long_as_it_had():
    s = _scheduler()
    _add_due(s, "old", 4, arrival=0.0, deadline=10.0)  # had 10 s: promoted after t = 20
    _add_due(s, "new", 4, arrival=15.0, deadline=25.0)
    assert _order(s, now=19.9) == ["new", "old"]
    assert _order(s, now=20.1) == ["old", "new"]


def test_a_preempted_request_stays_at_the_front_of_the_waiting_line():
    s = _scheduler()
    due = _add_due(s, "due", 4, arrival=0.0, deadline=100.0)
    back = _add_due(s, "back", 4, arrival=0.0, deadline=1.0)  # late at now=5
    back.num_preemptions = 1
    assert _order(s, now=5.0) == ["back", "due"]
    assert due.status is RequestStatus.WAITING


def test_the_prefill_rate_is_learnt_from_prefill_bound_steps_only():
    s = _scheduler()
    s.observe_step(8, 1.0)  # a decode step: 125 ms a token would be far too slow
    assert s.prefill_s_per_token is None
    s.observe_step(1000, 1.0)
    assert s.prefill_s_per_token == 0.001
    s.observe_step(1000, 2.0)  # moves a fifth of the way to 2 ms
    assert s.prefill_s_per_token == pytest.approx(0.0012)


def test_schedule_admits_in_deadline_order_within_the_token_budget():
    s = _scheduler(max_num_batched_tokens=8)
    now = time.monotonic()
    _add_due(s, "missed", 8, arrival=now - 10, deadline=now - 1)
    _add_due(s, "due", 8, arrival=now, deadline=now + 60)
    assert _step(s) == {"due": 8}
    assert _step(s) == {"due": 1, "missed": 7}
    assert [r.request_id for r in s.running] == ["due", "missed"]
