"""Plan under an accelerator budget: prefill and decode workers of any TP degree each
(one profile per degree and role), at most `max_accelerators` in all, cost per
accelerator-hour per role.

Every (mode, prefill TP, P, decode TP, D) within the budget is a candidate; simulating each
is out of reach at 64 accelerators (thousands of candidates, seconds each), so:

- **bounds prune** without simulating: a role's throughput bound (a worker's prompt or
  output tokens per second at full steps, the KV it holds limiting the decode batch)
  against the trace's offered tokens per second gives the fewest workers of each TP that
  can keep up; an unloaded-latency bound (each request's TTFT, or TPOT at batch 1, with no
  queue) rules out a TP degree that misses the attainment target even idle;
- a **bisection on the cost** finds the cheapest cost level at which a survivor meets the
  SLO, simulating at each level it visits its `per_level` most balanced candidates (the
  largest headroom over their bounds), each at most once (a cache). It assumes a level
  that meets has every dearer level meeting too, and that a level's most balanced
  candidates are its best: a level can be missed where neither holds;
- the pick's highest sustainable rate is found by **bisection on the rate** between the
  planned rate and its throughput bound (`sustained_rate`); with `front`, that of every
  other simulated candidate too (`_front_rates`), for the Pareto front.

The sustained rates and the rate sweep are independent simulations: they run on a process
pool (`SimulationPool`, a worker per available core), each a deterministic function of its
inputs, so the plan is the same whatever the number of workers. (The cost bisection stays
serial: each level it visits depends on the last.)
"""

from __future__ import annotations

import math
import multiprocessing
import os
import resource
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ProcessPoolExecutor
from dataclasses import dataclass
from typing import Any

import numpy as np

from engine import defaults
from planner.deploy import deployment, tensor_parallel
from planner.frontier import pareto_front, rate_sweep, sweep_rates
from planner.plan import (
    SCHEMA,
    PlanRequest,
    at_rate,
    figures,
    meets_slo_at,
    predict,
    shape_entry,
    simulate,
    sweepable,
    trace_rate,
)
from planner.profile import Profile, check_same_model
from planner.simulator import ClusterShape
from protocol.defaults import LOCAL_PREFILL_THRESHOLD
from protocol.serving import Slo, TraceRequest


@dataclass(frozen=True)
class BudgetRequest:
    """What to plan for under an accelerator budget.

    Args:
        prefill_profiles: a prefill worker's profile at each TP degree to consider.
        decode_profiles: a decode (and colocated) worker's profile at each degree.
        requests: the trace, at the planned rate.
        slo: objectives and attainment target.
        max_accelerators: the budget: prefill x its TP + decode x its TP at most this.
        cost_per_accelerator_hour: $/h of one accelerator, by role (`prefill`, `decode`).
        modes: modes to consider.
        max_num_batched_tokens: every worker's step budget.
        max_num_seqs: running requests per worker.
        local_prefill_threshold: the disaggregated threshold.
        per_level: candidates simulated per cost level the bisection visits (the most
            balanced: the largest headroom over their throughput bounds).
        front: find the sustained rate of every simulated candidate (`_front_rates`),
            for the Pareto front; else only the pick's, and `pareto` is null.
        serve_model: the model's folder the `deploy` command serves (None: a placeholder
            that `pdcluster serve` refuses).
    """

    prefill_profiles: tuple[Profile, ...]
    decode_profiles: tuple[Profile, ...]
    requests: list[TraceRequest]
    slo: Slo
    max_accelerators: int
    cost_per_accelerator_hour: dict[str, float]
    modes: tuple[str, ...] = ("disaggregated", "colocated")
    max_num_batched_tokens: int = defaults.MAX_NUM_BATCHED_TOKENS
    max_num_seqs: int = defaults.MAX_NUM_SEQS
    local_prefill_threshold: int = LOCAL_PREFILL_THRESHOLD
    per_level: int = 2
    front: bool = True
    serve_model: str | None = None

    def __post_init__(self) -> None:
        if not self.prefill_profiles or not self.decode_profiles:
            raise ValueError("give at least one prefill and one decode profile")
        check_same_model([*self.prefill_profiles, *self.decode_profiles])
        if self.max_accelerators < 1:
            raise ValueError(f"max_accelerators must be >= 1, got {self.max_accelerators}")
        if not self.requests:
            raise ValueError("the trace has no requests")


@dataclass(frozen=True)
class Candidate:
    mode: str
    prefill: int
    decode: int
    prefill_profile: Profile
    decode_profile: Profile
    cost_per_hour: float

    @property
    def prefill_tp(self) -> int:
        return tensor_parallel(self.prefill_profile)

    @property
    def decode_tp(self) -> int:
        return tensor_parallel(self.decode_profile)

    @property
    def key(self) -> tuple[str, int, int, int, int]:
        return (self.mode, self.prefill, self.prefill_tp, self.decode, self.decode_tp)

    @property
    def accelerators(self) -> int:
        return self.prefill * self.prefill_tp + self.decode * self.decode_tp


@dataclass(frozen=True)
class Load:
    """The trace's offered work per second."""

    rate: float
    prompt_tokens: float  # per second, all prompts
    long_prompt_tokens: float  # per second, prompts at or over the local-prefill threshold
    output_tokens: float
    mean_context: float  # a decoding request's mean context


def offered_load(request: BudgetRequest) -> Load:
    rate = trace_rate(request.requests)
    prompts = np.array([r.prompt_len for r in request.requests], dtype=float)
    outputs = np.array([r.output_len for r in request.requests], dtype=float)
    long = prompts >= request.local_prefill_threshold
    return Load(rate, rate * prompts.mean(), rate * (prompts * long).mean(),
                rate * outputs.mean(), float(prompts.mean() + outputs.mean() / 2))


def prefill_capacity(profile: Profile, budget: int) -> float:
    """Prompt tokens per second of a worker whose every step is a full budget."""
    return budget / profile.step_time([(0, budget, True)])


def token_capacity(profile: Profile, context: float, max_num_seqs: int, budget: int
                   ) -> float:
    """Tokens per second (prompt or output) a decoding worker computes at best: in full
    budget steps (decodes riding in a prompt's step cost a prompt token's share) or in
    decode steps of its largest batch (`max_num_seqs`, or as many requests of `context`
    as its KV holds), whichever is cheaper per token."""
    fits = int(profile.num_blocks * profile.block_size // max(context, 1))
    batch = max(min(max_num_seqs, fits), 1)
    decode = batch / profile.step_time([(int(context), 1, False)] * batch)
    return max(decode, prefill_capacity(profile, budget))


def needed(request: BudgetRequest, load: Load, mode: str, prefill: Profile,
           decode: Profile) -> tuple[float, float]:
    """The fewest (prefill, decode) workers whose best throughput carries the load: a
    lower bound, so no configuration that could meet the SLO is pruned."""
    budget = request.max_num_batched_tokens
    per_decode = token_capacity(decode, load.mean_context, request.max_num_seqs, budget)
    if mode == "colocated":
        return 0.0, (load.prompt_tokens + load.output_tokens) / per_decode
    short = load.prompt_tokens - load.long_prompt_tokens  # prefilled on the decode worker
    return (load.long_prompt_tokens / prefill_capacity(prefill, budget),
            (load.output_tokens + short) / per_decode)


def idle_attainment(request: BudgetRequest, mode: str, prefill: Profile, decode: Profile
                    ) -> float:
    """An upper bound on attainment: the share of requests whose TTFT (the prompt alone in
    budget-sized chunks, on the prefill worker then the transfer, or on the decode worker
    when colocated or under the local-prefill threshold) and TPOT (batch 1) meet their
    bounds with no queue and no neighbour."""
    ttft_bound = request.slo.bound("ttft")
    tpot_bound = request.slo.bound("tpot")
    ok = 0
    budget = request.max_num_batched_tokens
    for r in request.requests:
        remote = mode == "disaggregated" and r.prompt_len >= request.local_prefill_threshold
        worker = prefill if remote else decode
        chunks = [(start, min(budget, r.prompt_len - start))
                  for start in range(0, r.prompt_len, budget)]
        ttft = sum(worker.step_time([(s, n, True)]) for s, n in chunks) + (
            prefill.transfer_time(-(-r.prompt_len // prefill.block_size)) if remote else 0.0)
        tpot = decode.step_time([(r.prompt_len, 1, False)])
        ok += (ttft_bound is None or ttft * 1e3 <= ttft_bound) and (
            tpot_bound is None or r.output_len <= 1 or tpot * 1e3 <= tpot_bound)
    return ok / len(request.requests)


def candidates(request: BudgetRequest) -> tuple[list[Candidate], dict[str, int]]:
    """The configurations within the budget that the bounds leave, cheapest first, and
    how many each bound removed."""
    load = offered_load(request)
    cost = request.cost_per_accelerator_hour
    counts = {"within_budget": 0, "pruned_by_throughput": 0, "pruned_by_latency": 0}
    out = []
    for mode in request.modes:
        pairs = [(p, d) for p in request.prefill_profiles for d in request.decode_profiles] \
            if mode == "disaggregated" else [(d, d) for d in request.decode_profiles]
        for p, d in pairs:
            tp_p, tp_d = tensor_parallel(p), tensor_parallel(d)
            need_p, need_d = needed(request, load, mode, p, d)
            feasible = idle_attainment(request, mode, p, d) >= request.slo.attainment
            for num_p in range(1 if mode == "disaggregated" else 0,
                               request.max_accelerators // tp_p + 1 if mode == "disaggregated"
                               else 1):
                for num_d in range(1, (request.max_accelerators - num_p * tp_p) // tp_d + 1):
                    counts["within_budget"] += 1
                    if num_p < need_p or num_d < need_d:
                        counts["pruned_by_throughput"] += 1
                    elif not feasible:
                        counts["pruned_by_latency"] += 1
                    else:
                        out.append(Candidate(mode, num_p, num_d, p, d,
                                             num_p * tp_p * cost["prefill"]
                                             + num_d * tp_d * cost["decode"]))
    out.sort(key=lambda c: (c.cost_per_hour, c.accelerators, c.mode, c.prefill_tp,
                            c.decode_tp, c.prefill))
    return out, counts


def plan_request(request: BudgetRequest, c: Candidate) -> PlanRequest:
    cost = request.cost_per_accelerator_hour
    return PlanRequest(c.prefill_profile, c.decode_profile, request.requests, request.slo,
                       max_workers=max(c.prefill + c.decode, 2), modes=(c.mode,),
                       max_num_seqs=request.max_num_seqs,
                       cost_per_hour={"prefill": c.prefill_tp * cost["prefill"],
                                      "decode": c.decode_tp * cost["decode"]},
                       find_max_rate=False)


def shape(request: BudgetRequest, c: Candidate) -> ClusterShape:
    return ClusterShape(c.mode, c.prefill, c.decode, request.max_num_batched_tokens,
                        request.max_num_seqs, request.local_prefill_threshold)


def search(request: BudgetRequest, progress: Callable[[int, int], None] | None = None,
           workers: int | None = None) -> dict[str, Any]:
    """The cheapest configuration within the budget that meets the SLO (module docstring).

    Args:
        request: what to plan for.
        progress: called with (simulations done, most simulations) after each one.
        workers: processes for the sustained rates and the rate sweep (`SimulationPool`;
            None: one per available core); the plan is the same for any number.

    Returns:
        A `pdcluster.plan/1` document: `configs` holds the simulated candidates (with
        `prefill_tp`, `decode_tp`, `accelerators`), `search` the bounds' counts, the
        simulations, and the wall and CPU seconds taken (`search_seconds` to the pick,
        `seconds` with the sustained rates and the rate sweep); `pareto` and `rate_sweep`
        (`planner.frontier`).
    """
    start, cpu = time.perf_counter(), cpu_seconds()
    found, counts = candidates(request)
    levels: dict[float, list[Candidate]] = {}
    for c in found:
        levels.setdefault(round(c.cost_per_hour, 9), []).append(c)
    costs = sorted(levels)
    most = request.per_level * max(math.ceil(math.log2(len(costs) + 1)), 1)
    simulated: dict[tuple[Any, ...], dict[str, Any]] = {}
    load = offered_load(request)

    def meets(level: float) -> Candidate | None:
        """The first of the level's most balanced candidates (the largest headroom over
        their throughput bounds) that meets the SLO."""
        for c in sorted(levels[level], key=lambda c: -throughput_bound(request, c, load))[
                :request.per_level]:
            if c.key not in simulated:
                simulated[c.key] = _entry(request, c, _predict(request, c))
                if progress is not None:
                    progress(len(simulated), most)
            if simulated[c.key]["meets_slo"]:
                return c
        return None

    low, high, pick = 0, len(costs) - 1, None
    while low <= high:  # bisection on the cost: the cheapest level that meets the SLO
        mid = (low + high) // 2
        if (c := meets(costs[mid])) is not None:
            pick, high = c, mid - 1
        else:
            low = mid + 1
    searched = time.perf_counter() - start
    with SimulationPool(request, workers) as pool:
        sweep = _sustained_rates_and_sweep(request, pool, pick, [
            c for c in found if c.key in simulated and c.key != getattr(pick, "key", None)]
            if request.front else [], simulated)
    configs = sorted(simulated.values(), key=lambda e: (e["cost_per_hour"], e["accelerators"]))
    recommended = simulated[pick.key] if pick is not None else None
    deploy = None if pick is None or recommended is None else deployment(
        recommended, pick.prefill_profile, pick.decode_profile, request.max_num_seqs,
        request.serve_model)
    return {"schema": SCHEMA, "model": request.decode_profiles[0].model,
            "slo": request.slo.as_dict(), "rate_rps": trace_rate(request.requests),
            "num_requests": len(request.requests), "recommended": recommended,
            "deploy": deploy, "configs": configs,
            "pareto": pareto_front(configs, recommended) if request.front else None,
            "rate_sweep": sweep,
            "search": {**counts, "candidates": len(found), "cost_levels": len(costs),
                       "simulated": len(configs),
                       "max_accelerators": request.max_accelerators,
                       "search_seconds": searched,
                       "seconds": time.perf_counter() - start,
                       "cpu_seconds": cpu_seconds() - cpu}}


def throughput_bound(request: BudgetRequest, c: Candidate, load: Load | None = None
                     ) -> float:
    """The highest rate `c`'s workers could carry by the throughput bounds (`needed`)."""
    load = load or offered_load(request)
    need_p, need_d = needed(request, load, c.mode, c.prefill_profile, c.decode_profile)
    return load.rate * min(c.prefill / need_p if need_p else np.inf,
                           c.decode / need_d if need_d else np.inf)


def sustained_rate(request: BudgetRequest, c: Candidate, iterations: int = 5,
                   meets: bool = True, floor: float = 0.0) -> float | None:
    """The highest rate at which `c` meets the SLO: bisection between the planned rate
    and its throughput bound when it meets the SLO at the planned rate (`meets`), else
    between 0 and the planned rate, to 2^-iterations of that bracket; 0 when even the
    lowest rate tried misses. With a `floor` inside the bracket, one simulation there
    first: None when `c` misses at it (it sustains less), else the bracket starts there."""
    planned = plan_request(request, c)
    low, high = trace_rate(request.requests), throughput_bound(request, c)
    if not sweepable(request.requests):
        return low if meets else 0.0
    if not meets:
        low, high = 0.0, low
    elif not high > low:
        return low

    def ok(rate: float) -> bool:
        return meets_slo_at(planned, shape(request, c), at_rate(request.requests, rate))

    if low < floor < high:
        if not ok(floor):
            return None
        low = floor
    for _ in range(iterations):
        mid = (low + high) / 2
        low, high = (mid, high) if ok(mid) else (low, mid)
    return low


def _sustained_rates_and_sweep(request: BudgetRequest, pool: SimulationPool,
                               pick: Candidate | None, others: list[Candidate],
                               simulated: dict[tuple[Any, ...], dict[str, Any]]
                               ) -> dict[str, Any] | None:
    """Set `max_rate_rps` on the pick's entry and on each of `others` (`_front_rates`),
    and return the pick's rate sweep (None without a pick or a rescalable trace). The
    sweep's simulations start once the pick's rate is known, beside the others'."""
    pick_rate = None if pick is None else pool.submit(sustained_rate, pick)
    front = _front_rates(pool, others, simulated)
    sweep = None
    if pick is not None and pick_rate is not None:
        picked = simulated[pick.key]
        picked["predicted"]["max_rate_rps"] = float(pick_rate.result())
        planned = trace_rate(request.requests)
        if sweepable(request.requests):
            points = {rate: pool.submit(_sweep_figures, pick, rate)
                      for rate in sweep_rates(picked, planned) if rate != planned}
            sweep = rate_sweep(picked, request.slo, planned,
                               lambda rate: points[rate].result())
    for c, rate in front:
        simulated[c.key]["predicted"]["max_rate_rps"] = float(rate.result())
    return sweep


def _front_rates(pool: SimulationPool, others: list[Candidate],
                 simulated: dict[tuple[Any, ...], dict[str, Any]]
                 ) -> list[tuple[Candidate, Future[float]]]:
    """The sustained rate of each simulated candidate besides the pick, for the Pareto
    front: each bisected on its own (4 halvings), between the planned rate and its
    throughput bound when it meets the SLO there, else below the planned rate."""
    return [(c, pool.submit(sustained_rate, c, 4, simulated[c.key]["meets_slo"]))
            for c in others]


def _predict(request: BudgetRequest, c: Candidate) -> dict[str, Any]:
    """`c`'s simulated figures at the planned rate."""
    return predict(plan_request(request, c), shape(request, c))


def _sweep_figures(request: BudgetRequest, c: Candidate, rate: float) -> dict[str, Any]:
    """`c`'s simulated figures with the trace's arrivals scaled to `rate`."""
    return figures(simulate(plan_request(request, c), shape(request, c),
                            at_rate(request.requests, rate)), request.slo)


def cpu_seconds() -> float:
    """CPU seconds of this process and of its ended children (the pool's workers)."""
    children = resource.getrusage(resource.RUSAGE_CHILDREN)
    return time.process_time() + children.ru_utime + children.ru_stime


def available_cores() -> int:
    """The cores this process may run on."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") \
        else os.cpu_count() or 1


# The request a pool worker simulates, set once when the worker starts (`_start_worker`):
# it holds the whole trace, too large to send with every task.
_WORKER_REQUEST: list[BudgetRequest] = []


def _start_worker(request: BudgetRequest) -> None:
    _WORKER_REQUEST[:] = [request]


def _in_worker(fn: Callable[..., Any], *args: Any) -> Any:
    return fn(_WORKER_REQUEST[0], *args)


class SimulationPool:
    """Where a search's independent simulations run: `fn(request, *args)` on a process
    pool of `workers` (default: a worker per available core), or in this process with
    one. Forked workers inherit the loaded modules and receive the request once."""

    def __init__(self, request: BudgetRequest, workers: int | None = None) -> None:
        self.request = request
        self.workers = workers or available_cores()
        self._executor: ProcessPoolExecutor | None = None

    def __enter__(self) -> SimulationPool:
        if self.workers > 1:
            methods = multiprocessing.get_all_start_methods()
            context = multiprocessing.get_context("fork" if "fork" in methods else None)
            self._executor = ProcessPoolExecutor(self.workers, context, _start_worker,
                                                 (self.request,))
        return self

    def __exit__(self, *exc: object) -> None:
        if self._executor is not None:
            self._executor.shutdown(cancel_futures=True)

    def submit(self, fn: Callable[..., Any], *args: Any) -> Future[Any]:
        """`fn(request, *args)`, at once in this process or queued on the pool."""
        if self._executor is not None:
            return self._executor.submit(_in_worker, fn, *args)
        done: Future[Any] = Future()
        done.set_result(fn(self.request, *args))
        return done


def _entry(request: BudgetRequest, c: Candidate, predicted: dict[str, Any]) -> dict[str, Any]:
    return {**shape_entry(shape(request, c), c.decode_profile.torch_threads),
            "prefill_tp": c.prefill_tp if c.prefill else None, "decode_tp": c.decode_tp,
            "accelerators": c.accelerators, "cost_per_hour": c.cost_per_hour,
            "meets_slo": request.slo.meets(predicted), "predicted": predicted}


def profiles_by_tp(profiles: Sequence[Profile]) -> tuple[Profile, ...]:
    """The profiles, one per TP degree (the first of each), in rising TP.

    Raises:
        ValueError: none given.
    """
    by_tp: dict[int, Profile] = {}
    for p in profiles:
        by_tp.setdefault(tensor_parallel(p), p)
    if not by_tp:
        raise ValueError("no profiles")
    return tuple(by_tp[tp] for tp in sorted(by_tp))
