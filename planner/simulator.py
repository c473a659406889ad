"""A discrete-event simulation of the whole cluster on a virtual clock.

It reuses the project's policy code instead of re-describing it: every simulated worker
runs the real `engine.scheduler.Scheduler` over a real `KVCacheManager`/`BlockPool` (token
budget, chunked prefill, `max_num_seqs`, prefix hits, preemption and KV capacity exactly as
in the engine), and the router's `router.placement.place_request` places each request.
Only the model is missing: a step's duration comes from the profile's step-time model
(drawn about it with the measured spread, `Profile.step_cv`, from a seeded generator), a
KV transfer's from its transfer model.

It follows the real request path (cluster/dispatch.py, cluster/worker.py, the roles):

- commands reach a worker's engine between steps (`EngineLoop`): a new request, a KV
  reservation, a finished transfer;
- placement sees each worker's pushed stats (refreshed every `STATS_INTERVAL_S`) plus the
  router's own in-flight counts;
- a remote prefill reserves blocks on D first (a rejection is retried after
  `RESERVE_RETRY_S`), then queues on P; once P samples the first token the KV transfer's
  exposed time passes (its per-block part on the wire: transfers that leave the same P or
  reach the same D share that worker's NIC, one after another; to a D of fewer
  tensor-parallel ranks than P over fewer links, `Profile.transfer_links_to`), P frees its
  blocks, and D adds the request to its batch at its next step boundary: that is the first
  token the client sees;
- decode steps stream one token per request per step.

Output tokens are a fixed id and the trace's `output_len` is exact (the bench sends
`ignore_eos`), so only lengths and prompt tokens (for prefix hits) matter.
"""

from __future__ import annotations

import functools
import heapq
import itertools
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np

from engine import defaults
from engine.block_pool import BlockPool
from engine.config import SchedulerConfig
from engine.kv_cache_manager import KVCacheManager
from engine.request import Request
from engine.sampling_params import SamplingParams
from engine.scheduler import Scheduler, SchedulerOutput
from planner.profile import Profile
from protocol.defaults import (
    LOCAL_PREFILL_THRESHOLD,
    RESERVE_RETRY_S,
    RESERVE_TIMEOUT_S,
    STATS_INTERVAL_S,
)
from protocol.serving import TraceRequest
from router.placement import PrefixIndex, WorkerLoad, place_request

_TOKEN = 1  # every simulated output token


@functools.lru_cache(maxsize=4096)
def _params(output_len: int) -> SamplingParams:
    """One (frozen) parameter set per output length, shared by every simulation: building
    and checking one costs more than simulating a short request."""
    return SamplingParams(max_tokens=output_len, ignore_eos=True)


@dataclass(frozen=True)
class ClusterShape:
    """One cluster configuration to simulate.

    Args:
        mode: `disaggregated` or `colocated`.
        num_prefill: prefill workers (0 when colocated).
        num_decode: decode workers, or mixed workers when colocated.
        max_num_batched_tokens: every worker's step token budget.
        max_num_seqs: most running requests per worker.
        local_prefill_threshold: uncached prompts this short prefill on the decode worker.
        enable_prefix_caching: as `serve --no-prefix-caching` leaves it.
    """

    mode: str
    num_prefill: int
    num_decode: int
    max_num_batched_tokens: int = defaults.MAX_NUM_BATCHED_TOKENS
    max_num_seqs: int = defaults.MAX_NUM_SEQS
    local_prefill_threshold: int = LOCAL_PREFILL_THRESHOLD
    enable_prefix_caching: bool = True

    def __post_init__(self) -> None:
        if self.mode not in ("disaggregated", "colocated"):
            raise ValueError(f"mode must be disaggregated or colocated, got {self.mode!r}")
        if self.num_decode < 1:
            raise ValueError(f"num_decode must be >= 1, got {self.num_decode}")
        if self.num_prefill < 0 or (self.mode == "colocated" and self.num_prefill):
            raise ValueError("num_prefill must be >= 0, and 0 when colocated")

    @property
    def num_workers(self) -> int:
        return self.num_prefill + self.num_decode


@dataclass
class MissBudget:
    """Stop a simulation as soon as its SLO verdict is known to be a miss: when more than
    `allowed` requests have had no first token within `ttft_s` of their arrival (a
    certain TTFT miss, failures included), the run's attainment is below its target
    whatever happens next. A bisection on the rate needs only that verdict, and the runs it
    rejects (an overload, its queue growing to the end) are its longest.

    Args:
        ttft_s: the per-request TTFT bound.
        allowed: the most requests that may miss it (over every run it is shared by).
        misses: certain misses counted so far.
    """

    ttft_s: float
    allowed: int
    misses: int = 0

    @property
    def spent(self) -> bool:
        return self.misses > self.allowed


@dataclass
class SimResult:
    """What the simulation predicts, per request (seconds; NaN where undefined).

    Args:
        arrival: arrival times.
        first_token: first-token times.
        finish: last-token times.
        output_len: output tokens.
        num_steps: engine steps simulated, over all workers.
        busy_s: seconds of those steps, over all workers.
        num_preemptions: preemptions over all workers.
        num_local_prefills: requests prefilled on their decode worker.
        num_failed: requests that found no decode KV within the router's reserve timeout.
        runs: simulations laid end to end in this result (`end_to_end`); the counts above
            are over all of them.
        stopped: a `MissBudget` ran out: the SLO is missed, and requests left unfinished
            are NaN (the figures are not the run's).
    """

    arrival: np.ndarray
    first_token: np.ndarray
    finish: np.ndarray
    output_len: np.ndarray
    num_steps: int = 0
    busy_s: float = 0.0
    num_preemptions: int = 0
    num_local_prefills: int = 0
    num_failed: int = 0
    runs: int = 1
    stopped: bool = False

    @classmethod
    def end_to_end(cls, results: Sequence[SimResult]) -> SimResult:
        """Several runs as one, laid end to end on the clock: each starts where the one
        before it ended, so the whole's percentiles are over every run's requests and its
        duration is the sum of theirs (goodput and throughput stay per second)."""
        shifted, start = [], 0.0
        for r in results:
            offset = start - float(r.arrival.min())
            shifted.append((r.arrival + offset, r.first_token + offset, r.finish + offset))
            start += r.duration
        arrival, first, finish = (np.concatenate(parts) for parts in zip(*shifted, strict=True))
        return cls(arrival, first, finish, np.concatenate([r.output_len for r in results]),
                   sum(r.num_steps for r in results), sum(r.busy_s for r in results),
                   sum(r.num_preemptions for r in results),
                   sum(r.num_local_prefills for r in results),
                   sum(r.num_failed for r in results), sum(r.runs for r in results),
                   any(r.stopped for r in results))

    @property
    def ttft(self) -> np.ndarray:
        return self.first_token - self.arrival

    @property
    def tpot(self) -> np.ndarray:
        """(last - first token) / (output - 1); NaN for one-token outputs (as the bench)."""
        with np.errstate(invalid="ignore", divide="ignore"):
            return np.where(self.output_len > 1, (self.finish - self.first_token)
                            / np.maximum(self.output_len - 1, 1), np.nan)

    @property
    def duration(self) -> float:
        """From the first arrival to the last token (NaN when none finished)."""
        finished = self.finish[np.isfinite(self.finish)]
        return float(finished.max() - self.arrival.min()) if finished.size else math.nan


@dataclass
class _Worker:
    """One simulated worker: the real scheduler and KV pool, and the router's view of it."""

    worker_id: str
    role: str
    profile: Profile
    scheduler: Scheduler
    commands: list[Callable[[], None]] = field(default_factory=list)
    busy: bool = False  # a step, or a wake-up, is pending
    in_flight: int = 0
    stats: WorkerLoad | None = None
    neighbours: list[_Worker] = field(default_factory=list)  # the other workers on its host
    changed: bool = True  # since the last pushed stats (only `_kick` changes the engine)
    num_steps: int = 0
    busy_s: float = 0.0

    def load(self) -> WorkerLoad:
        """The last pushed stats with the router's live in-flight count (as `_Handle.load`)."""
        assert self.stats is not None
        self.stats.in_flight = self.in_flight
        return self.stats

    def push_stats(self) -> None:
        if not self.changed:  # the same stats again: the engine has not stepped
            return
        self.changed = False
        sched, pool = self.scheduler, self.scheduler.kv.pool
        queued = 0
        if self.role == "prefill":
            queued = sum(r.num_tokens - r.num_computed_tokens
                         for r in (*sched.waiting, *sched.running))
        self.stats = WorkerLoad(self.worker_id, self.role, num_free_blocks=pool.num_free_blocks,
                                num_blocks=pool.num_blocks, num_running=len(sched.running),
                                num_waiting=len(sched.waiting), queued_prefill_tokens=queued)


class Simulation:
    """Replays requests through a simulated cluster.

    Args:
        shape: the configuration.
        prefill_profile: profile of prefill workers (disaggregated).
        decode_profile: profile of decode (or mixed) workers.
        seed: seeds the step times' spread (`Profile.step_cv`); the same seed, trace and
            profiles give the same result.
    """

    def __init__(self, shape: ClusterShape, prefill_profile: Profile,
                 decode_profile: Profile, seed: int = 0) -> None:
        if prefill_profile.block_size != decode_profile.block_size:
            raise ValueError("prefill and decode profiles must use the same block_size, got "
                             f"{prefill_profile.block_size} and {decode_profile.block_size}")
        self.shape = shape
        self.now = 0.0
        self._rng = np.random.default_rng(seed)
        self._normals: list[float] = []
        self._events: list[tuple[float, int, Callable[[], None]]] = []
        self._seq = itertools.count()
        self._prefix = PrefixIndex(decode_profile.block_size)
        # Remote prefills in flight: request id -> (D, D's request, tokens D had cached).
        self._jobs: dict[str, tuple[_Worker, Request, int]] = {}
        self._num_preemptions = 0
        self._num_failed = 0
        # When each worker's NIC (its devices' links) is done with the transfers queued on it.
        self._nic_free: dict[str, float] = {}
        # A prefill worker's transfers to a decode worker of fewer ranks use fewer links.
        self._wire_factor = prefill_profile.transfer_links_to(decode_profile)
        self._latency = decode_profile.response_latency_s  # tokens reach clients from D
        roles = [("mixed", shape.num_decode)] if shape.mode == "colocated" else \
            [("decode", shape.num_decode), ("prefill", shape.num_prefill)]
        self.workers: list[_Worker] = []
        for role, count in roles:
            profile = prefill_profile if role == "prefill" else decode_profile
            for i in range(count):
                self.workers.append(self._new_worker(f"{role}-{i}", role, profile))
        self.decode_pool = [w for w in self.workers if w.role != "prefill"]
        self.prefill_pool = [w for w in self.workers if w.role == "prefill"]
        self._by_id = {w.worker_id: w for w in self.workers}
        # Hosts of `workers_per_host` workers each, in order.
        per_host = max(decode_profile.workers_per_host, 1)
        hosts = [self.workers[i:i + per_host] for i in range(0, len(self.workers), per_host)]
        for host in hosts:
            for w in host:
                w.neighbours = [n for n in host if n is not w]
        # As LLMEngine limits it: the model's context and one worker's whole KV pool.
        self._max_model_len = min(p.max_model_len for p in (prefill_profile, decode_profile))
        self._max_model_len = min(self._max_model_len, *(p.num_blocks * p.block_size for p in
                                                         (prefill_profile, decode_profile)))

    def _new_worker(self, worker_id: str, role: str, profile: Profile) -> _Worker:
        shape = self.shape
        config = SchedulerConfig(max_num_batched_tokens=shape.max_num_batched_tokens,
                                 max_num_seqs=shape.max_num_seqs,
                                 role="mixed" if role == "mixed" else role)
        kv = KVCacheManager(BlockPool(profile.num_blocks, shape.enable_prefix_caching),
                            profile.block_size)
        worker = _Worker(worker_id, role, profile, Scheduler(config, kv))
        worker.push_stats()
        return worker

    # ---- event loop ----

    def _at(self, when: float, action: Callable[[], None]) -> None:
        heapq.heappush(self._events, (when, next(self._seq), action))

    def run(self, requests: Sequence[TraceRequest], budget: MissBudget | None = None
            ) -> SimResult:
        """Simulate every request to its last token, or (with a `budget`) until the
        requests certain to miss their TTFT bound are more than it allows (`stopped`).

        Raises:
            ValueError: no requests, or a request that cannot fit the profile's limits.
        """
        if not requests:
            raise ValueError("the trace has no requests")
        n = len(requests)
        self._first = np.full(n, np.nan)
        self._finish = np.full(n, np.nan)
        self._local = 0
        self._remaining = n
        for index, r in enumerate(requests):
            self._check(index, r)
            self._at(r.timestamp, lambda i=index, r=r: self._arrive(i, r))
            if budget is not None:  # the bound on the engine's clock, and just after it
                self._at(r.timestamp + max(budget.ttft_s - self._latency, 0.0) * (1 + 1e-9)
                         + 1e-9, lambda i=index: self._deadline(i, budget))
        self._at(0.0, self._push_stats)
        while self._events and self._remaining and not (budget and budget.spent):
            self.now, _, action = heapq.heappop(self._events)
            action()
        stopped = bool(budget and budget.spent)
        if self._remaining and not stopped:
            raise RuntimeError(f"simulation stalled with {self._remaining} requests unfinished "
                               "(a prompt larger than a worker's KV pool?)")
        return SimResult(np.array([r.timestamp for r in requests]), self._first + self._latency,
                         self._finish + self._latency,
                         np.array([r.output_len for r in requests]),
                         sum(w.num_steps for w in self.workers),
                         sum(w.busy_s for w in self.workers), self._num_preemptions,
                         self._local, self._num_failed, stopped=stopped)

    def _deadline(self, index: int, budget: MissBudget) -> None:
        if math.isnan(self._first[index]):
            budget.misses += 1

    def _check(self, index: int, r: TraceRequest) -> None:
        if not r.prompt_token_ids:
            raise ValueError(f"request {index}: the simulator needs the prompt's token ids "
                             "(tokenize text prompts first: planner.plan.tokenized)")
        total = len(r.prompt_token_ids) + r.output_len
        if total > self._max_model_len:
            raise ValueError(f"request {index}: {total} prompt + output tokens exceed the "
                             f"profile's max_model_len {self._max_model_len}")

    def _push_stats(self) -> None:
        for w in self.workers:
            w.push_stats()
        # With nothing else pending nothing can change any more: the run is over (or stalled).
        if not (self._remaining and self._events):
            return
        # Nothing changes before the next event, so the pushes until then would repeat this
        # one: the next push is the first on the timer's grid at or after that event (an
        # event at the same instant still comes first: it was queued before this push).
        when = self.now + STATS_INTERVAL_S
        while when < self._events[0][0]:
            when += STATS_INTERVAL_S
        self._at(when, self._push_stats)

    # ---- router ----

    def _arrive(self, index: int, r: TraceRequest) -> None:
        request = Request(str(index), r.prompt_token_ids, _params(r.output_len),
                          max_model_len=self._max_model_len, arrival_time=r.timestamp)
        # The prompt's block hashes, computed once for the router and both engines (each
        # would compute the same ones).
        hashes = self._prefix.hashes(request.prompt_token_ids)
        request.block_hashes = list(hashes)
        self._dispatch(index, request, hashes)

    def _dispatch(self, index: int, request: Request, hashes: list[bytes]) -> None:
        placement = place_request(self._prefix, request.prompt_token_ids,
                                  [w.load() for w in self.decode_pool],
                                  [w.load() for w in self.prefill_pool],
                                  self.shape.local_prefill_threshold, hashes)
        decode = self._by_id[placement.decode_worker]
        decode.in_flight += 1
        if placement.prefill_worker is None:
            self._local += 1
            self._command(decode, lambda: decode.scheduler.add_request(request))
            return
        prefill = self._by_id[placement.prefill_worker]
        self._command(decode, lambda: self._reserve(index, request, hashes, decode, prefill))

    def _reserve(self, index: int, request: Request, hashes: list[bytes], decode: _Worker,
                 prefill: _Worker) -> None:
        if not decode.scheduler.reserve_remote(request):
            decode.in_flight -= 1
            if self.now - request.arrival_time > RESERVE_TIMEOUT_S:
                self._remaining -= 1  # failed: no KV freed up in time (TTFT stays NaN)
                self._num_failed += 1
                return
            self._at(self.now + RESERVE_RETRY_S, lambda: self._dispatch(index, request, hashes))
            return
        # The prefill worker computes its own copy of the prompt, minus D's cached blocks
        # (which are not shipped); its own prefix cache may save more.
        copy = Request(request.request_id, request.prompt_token_ids, request.params,
                       max_model_len=self._max_model_len, arrival_time=request.arrival_time)
        copy.block_hashes = list(hashes)
        self._jobs[request.request_id] = (decode, request, request.num_computed_tokens)
        prefill.in_flight += 1
        self._command(prefill, lambda: prefill.scheduler.add_request(copy))

    # ---- workers ----

    def _command(self, worker: _Worker, command: Callable[[], None]) -> None:
        """Runs before the worker's next step; an idle worker wakes once everything that
        happens at this instant has reached it (as its loop drains all queued commands)."""
        worker.commands.append(command)
        if not worker.busy:
            worker.busy = True
            self._at(self.now, lambda: self._kick(worker))

    def _kick(self, worker: _Worker) -> None:
        worker.busy = False
        worker.changed = True
        commands, worker.commands = worker.commands, []
        for command in commands:
            command()
        out = worker.scheduler.schedule()
        self._num_preemptions += len(out.preempted)
        if not out.scheduled:
            return
        worker.busy = True
        worker.num_steps += 1
        seconds = self._step_seconds(worker, out.items())
        worker.busy_s += seconds
        self._at(self.now + seconds, lambda: self._step_done(worker, out))

    def _step_seconds(self, worker: _Worker, items: list[tuple[int, int, bool]]) -> float:
        seconds = worker.profile.step_time(items)
        if worker.role == "prefill":
            seconds *= worker.profile.prefill_role_factor
        if worker.neighbours and worker.profile.neighbour_slowdown:  # else a factor of 1
            busy_neighbours = sum(w.busy for w in worker.neighbours)
            seconds *= 1 + worker.profile.neighbour_slowdown * busy_neighbours
        cv = worker.profile.step_cv
        if cv > 0:  # log-normal of mean 1 and coefficient of variation cv
            sigma = math.sqrt(math.log1p(cv * cv))
            seconds *= math.exp(sigma * self._normal() - sigma * sigma / 2)
        return seconds

    def _normal(self) -> float:
        """The next standard normal draw (drawn in blocks: one numpy call per step costs
        more than the rest of the step's arithmetic)."""
        if not self._normals:
            self._normals = self._rng.standard_normal(4096).tolist()
        return self._normals.pop()

    def _step_done(self, worker: _Worker, out: SchedulerOutput) -> None:
        sampled = {s.request.request_id: [_TOKEN] for s in out.scheduled if s.samples}
        for request in worker.scheduler.postprocess(out, sampled):
            if worker.role == "prefill":
                self._prefilled(worker, request)
            else:
                self._token(worker, request)
        self._kick(worker)

    def _token(self, worker: _Worker, request: Request) -> None:
        if len(request.output_token_ids) == 1:
            self._first[int(request.request_id)] = self.now
        if request.is_finished:
            self._finish[int(request.request_id)] = self.now
            worker.in_flight -= 1
            self._remaining -= 1

    def _prefilled(self, prefill: _Worker, copy: Request) -> None:
        decode, request, num_cached = self._jobs.pop(copy.request_id)
        shipped = len(copy.block_ids) - num_cached // prefill.profile.block_size
        # The transfer model's per-block part is bytes on the wire: it waits for both ends'
        # NICs; its constant (setup, the last layer's latency) overlaps other transfers.
        fixed = prefill.profile.transfer_time(0)
        wire = (prefill.profile.transfer_time(shipped) - fixed) * self._wire_factor
        start = max(self.now, self._nic_free.get(prefill.worker_id, 0.0),
                    self._nic_free.get(decode.worker_id, 0.0))
        self._nic_free[prefill.worker_id] = self._nic_free[decode.worker_id] = start + wire
        self._at(start + wire + fixed,
                 lambda: self._transferred(prefill, copy, decode, request))

    def _transferred(self, prefill: _Worker, copy: Request, decode: _Worker,
                     request: Request) -> None:
        prefill.in_flight -= 1
        self._command(prefill, lambda: prefill.scheduler.finish(copy.request_id, "stop"))

        def complete() -> None:
            decode.scheduler.complete_remote(request.request_id, _TOKEN)
            self._token(decode, request)

        self._command(decode, complete)
