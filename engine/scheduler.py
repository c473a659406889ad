"""One continuous-batching scheduler; the roles and the static policy are policies of it."""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from engine.config import SchedulerConfig
from engine.kv_cache_manager import KVCacheManager
from engine.request import Request, RequestStatus

# A step computing at least this many tokens is prefill-bound: its time per token is the
# rate a waiting prompt's prefill is estimated at. Decode-only steps cost far more per token.
RATE_MIN_TOKENS = 256
RATE_SMOOTHING = 0.2  # weight of the newest step in the moving average


@dataclass
class ScheduledRequest:
    """A request and the tokens it computes this step.

    `num_lookahead` KV slots past the request's last token are reserved for drafted tokens
    (speculative decoding); the proposer then sets `request.spec_token_ids` and grows
    `num_new_tokens` by as many as it drafted.
    """

    request: Request
    num_new_tokens: int
    num_lookahead: int = 0

    @property
    def start(self) -> int:
        """First position computed this step."""
        return self.request.num_computed_tokens

    @property
    def samples(self) -> bool:
        """Whether this step reaches the request's last token and so samples one."""
        request = self.request
        return request.num_computed_tokens + self.num_new_tokens >= request.num_tokens


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledRequest] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)

    def items(self) -> list[tuple[int, int, bool]]:
        """Per scheduled request: (context before the step, new tokens, whether they are
        prompt tokens): what a step computes, as the planner's step-time models read it.
        Call before `postprocess`, which advances the contexts."""
        return [(start := s.start, s.num_new_tokens, start < s.request.num_prompt_tokens)
                for s in self.scheduled]


def step_work(items: list[tuple[int, int, bool]]) -> tuple[int, float, int]:
    """A step's work from its `SchedulerOutput.items`: tokens computed (the linear layers),
    query x key pairs attended (sum of new x (context before + (new + 1) / 2)), requests."""
    return (sum(n for _, n, _ in items), sum(n * (start + (n + 1) / 2) for start, n, _ in items),
            len(items))


class Scheduler:
    """Picks, each step, which requests compute how many tokens.

    Running requests go first (decodes and unfinished prompt chunks), in arrival order;
    when blocks run out the newest running request is preempted and recomputed later.
    Waiting requests are admitted while the token budget, `max_num_seqs` and the KV pool
    allow, in arrival order unless they carry TTFT deadlines (`order_waiting`). Role
    `prefill` parks a request once its first token is sampled; role `decode` also holds
    requests whose KV is arriving from a remote prefill.

    A decoding request for which `num_lookahead(request)` is positive also gets that many
    more tokens of budget and KV slots for drafts when both are there (speculative
    decoding); what verification rejects is rolled back in `postprocess`.

    Args:
        config: budgets, role and policy.
        kv_manager: the KV cache manager.
        num_lookahead: most tokens to draft for a request this step (None: no drafts).
    """

    def __init__(self, config: SchedulerConfig, kv_manager: KVCacheManager,
                 num_lookahead: Callable[[Request], int] | None = None) -> None:
        self.config = config
        self.kv = kv_manager
        self.num_lookahead = num_lookahead
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        # Requests holding blocks outside the batch: remote KV in flight, or prefilled KV
        # waiting to be shipped.
        self.parked: dict[str, Request] = {}
        self.num_preemptions = 0  # cumulative: running requests sent back to be recomputed
        # Seconds per token of prefill-bound steps (`observe_step`); None until one ran.
        self.prefill_s_per_token: float | None = None
        # Whether any request came with a TTFT deadline: until one does, the waiting order
        # is arrival order and costs nothing (the planner's simulator steps this scheduler).
        self._deadlines = False

    def add_request(self, request: Request) -> None:
        self._deadlines = self._deadlines or request.ttft_deadline is not None
        self.waiting.append(request)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.config.max_num_batched_tokens
        budget = self._schedule_running(out, budget)
        if not out.preempted and self._may_admit():
            self.order_waiting(time.monotonic())
            self._schedule_waiting(out, budget)
        return out

    def order_waiting(self, now: float) -> None:
        """Put the waiting requests that can still meet their TTFT deadline first.

        Requests without a deadline keep arrival order (FCFS). With deadlines, a goodput
        order: preempted requests first (as without), then, earliest deadline first, those
        whose prefill still ends in time behind the ones before them (the prompt tokens
        left of the running prefills and of those placed ahead, at the rate the engine
        measured), then the rest (already late, or late behind the queue), in arrival
        order: a burst makes its last requests late instead of all of them. None starves:
        a late request goes to the front once it has waited past its deadline as long
        again as it had when it arrived (at most twice its budget in all).

        Args:
            now: `time.monotonic()`.
        """
        if not self._deadlines:
            return
        rate = self.prefill_s_per_token or 0.0
        first, due, late, free = [], [], [], []
        for request in self.waiting:
            deadline = request.ttft_deadline
            if request.num_preemptions or (
                    deadline is not None and now - deadline > deadline - request.arrival_time):
                first.append(request)  # preempted, or late for too long
            elif deadline is None:
                free.append(request)
            else:
                due.append(request)
        # When each prefill would end: behind the running prompts' chunks and those first.
        ends = now + rate * sum(_prompt_left(r) for r in (*self.running, *first))
        kept = []
        for request in sorted(due, key=lambda r: r.ttft_deadline):
            end = ends + rate * _prompt_left(request)
            if end <= request.ttft_deadline:
                kept.append(request)
                ends = end
            else:
                late.append(request)
        late.sort(key=lambda r: r.arrival_time)
        self.waiting = deque([*first, *kept, *free, *late])

    def observe_step(self, num_tokens: int, seconds: float) -> None:
        """Learn the prefill rate from a step that computed `num_tokens` in `seconds`
        (steps under `RATE_MIN_TOKENS` tokens are decode-bound and ignored)."""
        if num_tokens < RATE_MIN_TOKENS or seconds <= 0:
            return
        per_token = seconds / num_tokens
        last = self.prefill_s_per_token
        self.prefill_s_per_token = per_token if last is None else \
            last + RATE_SMOOTHING * (per_token - last)

    def _may_admit(self) -> bool:
        # Static batching admits a new batch only once the whole previous one is done.
        return self.config.policy == "continuous" or not self.running

    def _schedule_running(self, out: SchedulerOutput, budget: int) -> int:
        i = 0
        while i < len(self.running) and budget > 0:
            request = self.running[i]
            num_new = self._chunk(request.num_tokens - request.num_computed_tokens, budget)
            if num_new == 0:
                i += 1
                continue
            lookahead = 0 if self.num_lookahead is None else \
                self._lookahead(request, num_new, budget, len(self.running) - i - 1)
            if lookahead:
                out.scheduled.append(ScheduledRequest(request, num_new, lookahead))
                budget -= num_new + lookahead
                i += 1
                continue
            while not self.kv.allocate_slots(request, num_new):
                victim = self.running.pop()
                self._preempt(victim, out)
                if victim is request:
                    return budget
            out.scheduled.append(ScheduledRequest(request, num_new))
            budget -= num_new
            i += 1
        return budget

    def _lookahead(self, request: Request, num_new: int, budget: int, num_after: int) -> int:
        """Draft slots reserved for a decoding request: within the tokens it may still emit,
        and only while a token of budget and a block stay for each of the `num_after`
        running requests behind it (drafts never starve or preempt another request);
        0 (decode plainly) otherwise."""
        if self.num_lookahead is None or num_new != 1 or self.config.role == "prefill":
            return 0
        left = request.max_output_tokens - len(request.output_token_ids) - 1
        lookahead = min(self.num_lookahead(request), budget - 1 - num_after, left)
        if lookahead <= 0 or self.kv.blocks_needed(request, 1 + lookahead) + num_after > \
                self.kv.pool.num_free_blocks:
            return 0
        self.kv.allocate_slots(request, 1 + lookahead)
        return lookahead

    def _schedule_waiting(self, out: SchedulerOutput, budget: int) -> None:
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            request = self.waiting[0]
            hits = self.kv.get_computed_blocks(request)
            remaining = request.num_tokens - request.num_computed_tokens - \
                len(hits) * self.kv.block_size
            num_new = self._chunk(remaining, budget)
            if num_new == 0 or not self.kv.allocate_slots(request, num_new, hits):
                break
            self.waiting.popleft()
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            out.scheduled.append(ScheduledRequest(request, num_new))
            budget -= num_new

    def _chunk(self, remaining: int, budget: int) -> int:
        if remaining <= budget:
            return remaining
        return budget if self.config.enable_chunked_prefill else 0

    def _preempt(self, request: Request, out: SchedulerOutput) -> None:
        self.kv.reset(request)
        request.status = RequestStatus.WAITING
        request.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(request)
        out.preempted.append(request)

    def postprocess(self, out: SchedulerOutput, sampled: dict[str, list[int]]
                    ) -> list[Request]:
        """Advance the scheduled requests by what the step computed.

        Args:
            out: the step's schedule.
            sampled: request id -> new tokens (one, or with speculative decoding the
                accepted drafts and one more), for requests whose last token was computed.

        Returns:
            The requests that changed: got tokens, finished, or were parked.
        """
        changed = []
        prefill = self.config.role == "prefill"
        for item in out.scheduled:
            request = item.request
            tokens = sampled.get(request.request_id)
            if tokens is None:
                request.num_computed_tokens += item.num_new_tokens
                self.kv.cache_blocks(request)
                continue
            num_kept = self._append(request, tokens)
            if request.spec_token_ids:
                # Valid KV after a verification: the token before the step's and the kept
                # drafts, as many as the tokens kept.
                request.num_computed_tokens += num_kept
                request.spec_token_ids = []
            else:
                request.num_computed_tokens += item.num_new_tokens
            self.kv.cache_blocks(request)
            if item.num_lookahead:
                self.kv.trim(request)
            changed.append(request)
            if prefill:
                # The KV stays until shipped, even when the first token already ends it.
                self._remove_running(request)
                self.parked[request.request_id] = request
                if not request.is_finished:
                    request.status = RequestStatus.PREFILLED
            elif request.is_finished:
                self._remove_running(request)
                self.kv.free(request)
        return changed

    @staticmethod
    def _append(request: Request, tokens: list[int]) -> int:
        """Append tokens until the request finishes; how many were kept."""
        for i, token in enumerate(tokens):
            request.append_token(token)
            if request.is_finished:
                return i + 1
        return len(tokens)

    def reserve_remote(self, request: Request) -> bool:
        """Decode role: hold blocks for a prompt whose KV another engine computes."""
        hits = self.kv.get_computed_blocks(request)
        num_new = request.num_tokens - len(hits) * self.kv.block_size
        if not self.kv.allocate_slots(request, num_new, hits):
            return False
        request.status = RequestStatus.WAITING_FOR_REMOTE_KV
        self.parked[request.request_id] = request
        return True

    def complete_remote(self, request_id: str, first_token: int) -> Request:
        """Decode role: the prompt's KV has landed; the request joins the running batch."""
        request = self.parked.get(request_id)
        if request is None or request.status != RequestStatus.WAITING_FOR_REMOTE_KV:
            raise KeyError(f"request {request_id!r} has no remote KV reservation")
        del self.parked[request_id]
        request.num_computed_tokens = request.num_tokens
        self.kv.cache_blocks(request)
        request.append_token(first_token)
        if request.is_finished:
            self.kv.free(request)
        else:
            request.status = RequestStatus.RUNNING
            self.running.append(request)
        return request

    def finish(self, request_id: str, reason: str) -> Request | None:
        """End a request wherever it is and free its blocks; None if unknown."""
        request = self.parked.pop(request_id, None)
        if request is None:
            request = self._find(request_id)
            if request is None:
                return None
            if request in self.running:
                self._remove_running(request)
            else:
                self.waiting.remove(request)
        self.kv.free(request)
        if not request.is_finished:
            request.finish(reason)
        return request

    def _find(self, request_id: str) -> Request | None:
        for request in (*self.running, *self.waiting):
            if request.request_id == request_id:
                return request
        return None

    def _remove_running(self, request: Request) -> None:
        self.running.remove(request)


def _prompt_left(request: Request) -> int:
    """Prompt tokens the request has still to compute (0 once decoding)."""
    return max(0, request.num_prompt_tokens - request.num_computed_tokens)
