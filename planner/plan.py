"""Size the pools: simulate every split (and colocated N) on the trace, keep the cheapest
configuration that meets the SLO attainment target.

For each mode and worker count the search also tries each local-prefill threshold and step
token budget given, keeping the variant with the best attainment (then goodput). Each
configuration's `max_rate_rps` is the highest arrival rate (the trace's arrivals scaled)
at which it still meets the SLO, found by doubling then bisecting.

A simulation is scored by `protocol.slo`, as `pdcluster bench` scores a measured run (TTFT,
TPOT and E2E each at most their bound; a one-token answer has no TPOT); a configuration
meets `--slo` when the share of requests within it (attainment) reaches the target and
every named percentile is within its bound (`Slo.meets`).
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np

from engine import defaults
from planner.deploy import deployment
from planner.frontier import pareto_front, rate_sweep
from planner.profile import Profile, check_same_model
from planner.simulator import ClusterShape, MissBudget, SimResult, Simulation
from protocol.defaults import LOCAL_PREFILL_THRESHOLD
from protocol.serving import Slo, TraceRequest, read_trace
from protocol.slo import ATTAINMENT, GOODPUT, Latencies, score

SCHEMA = "pdcluster.plan/1"
MODES = ("disaggregated", "colocated")


def figures(result: SimResult, slo: Slo) -> dict[str, float | None]:
    """A simulation's figures, scored as `pdcluster bench` scores a measured run
    (`protocol.slo.score`: latency percentiles in ms, `attainment`, `goodput_rps`).

    A request the simulation failed (NaN first token) counts against attainment; a one-token
    answer has no TPOT and meets any TPOT bound.
    """
    latencies = Latencies(result.ttft, result.tpot, result.finish - result.arrival)
    return score(latencies, result.duration, slo)


# ---- traces ----

def load_trace(path: Path, model: str) -> list[TraceRequest]:
    """Read a JSONL trace (`protocol.serving`) with every prompt as token ids (text prompts
    tokenized with `model`'s tokenizer).

    Raises:
        ValueError: a bad line, or an empty trace.
    """
    return tokenized(read_trace(Path(path)), model)


def tokenized(requests: Sequence[TraceRequest], model: str) -> list[TraceRequest]:
    """The requests with text prompts replaced by their token ids (the simulator hashes
    prompt blocks for prefix hits)."""
    if not requests:
        raise ValueError("the trace has no requests")
    if all(r.prompt_token_ids is not None for r in requests):
        return list(requests)
    from engine.model_loader import resolve_model_dir
    from engine.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(resolve_model_dir(model))
    return [r if r.prompt is None else
            TraceRequest(r.timestamp, r.output_len, tokenizer.encode(r.prompt))
            for r in requests]


def trace_rate(requests: Sequence[TraceRequest]) -> float:
    """The trace's mean arrival rate (requests/s), `inf` when they all arrive at once."""
    span = max(r.timestamp for r in requests) - min(r.timestamp for r in requests)
    return (len(requests) - 1) / span if span > 0 else float("inf")


def at_rate(requests: Sequence[TraceRequest], rate: float) -> list[TraceRequest]:
    """The same requests with their arrivals scaled to a mean rate of `rate`.

    Raises:
        ValueError: a rate <= 0, or a trace whose requests all arrive at once.
    """
    if not rate > 0:
        raise ValueError(f"rate must be > 0 requests/s, got {rate}")
    current = trace_rate(requests)
    if len(requests) > 1 and np.isinf(current):
        raise ValueError("the trace's requests all arrive at once: --rate cannot rescale them")
    scale = current / rate if len(requests) > 1 else 1.0
    return [replace(r, timestamp=r.timestamp * scale) for r in requests]


# ---- search ----

@dataclass(frozen=True)
class PlanRequest:
    """What to plan for.

    Args:
        prefill_profile: profile of prefill workers.
        decode_profile: profile of decode (and colocated) workers.
        requests: the trace (already at the planned rate).
        slo: objectives and attainment target.
        max_workers: most workers in a configuration.
        modes: modes to consider.
        thresholds: local-prefill thresholds to try (disaggregated).
        budgets: step token budgets to try.
        max_num_seqs: running requests per worker.
        cost_per_hour: $/h of a prefill and of a decode (or colocated) worker.
        find_max_rate: also search each configuration's highest rate meeting the SLO.
        sweep_rates: also simulate the recommended configuration from light load to past
            saturation (`planner.frontier.rate_sweep`; else the plan's `rate_sweep` is
            None).
        simulated_requests: where a profile has a step-time spread (`Profile.step_cv`),
            each simulation runs the trace again with the next seeds until at least this
            many requests are simulated, and every figure is over all the runs
            (`simulate`).
        serve_model: the model's folder the `deploy` command serves (None: a placeholder
            that `pdcluster serve` refuses).
    """

    prefill_profile: Profile
    decode_profile: Profile
    requests: list[TraceRequest]
    slo: Slo
    max_workers: int = 4
    modes: tuple[str, ...] = MODES
    thresholds: tuple[int, ...] = (LOCAL_PREFILL_THRESHOLD,)
    budgets: tuple[int, ...] = (defaults.MAX_NUM_BATCHED_TOKENS,)
    max_num_seqs: int = defaults.MAX_NUM_SEQS
    cost_per_hour: dict[str, float] = field(
        default_factory=lambda: {"prefill": 1.0, "decode": 1.0})
    find_max_rate: bool = True
    sweep_rates: bool = True
    simulated_requests: int = 1600
    serve_model: str | None = None

    def __post_init__(self) -> None:
        check_same_model([self.prefill_profile, self.decode_profile])
        if not self.requests:
            raise ValueError("the trace has no requests")
        if self.max_workers < 1:
            raise ValueError(f"max_workers must be >= 1, got {self.max_workers}")
        if self.simulated_requests < 1:
            raise ValueError(f"simulated_requests must be >= 1, got {self.simulated_requests}")
        bad = set(self.modes) - set(MODES)
        if bad or not self.modes:
            raise ValueError(f"modes must be among {', '.join(MODES)}, got {list(self.modes)}")
        if self.modes == ("disaggregated",) and self.max_workers < 2:
            raise ValueError("disaggregated needs max_workers >= 2 (one prefill, one decode)")


def shapes(request: PlanRequest) -> list[list[ClusterShape]]:
    """Every configuration to simulate, grouped by (mode, P, D): the variants of one group
    differ by threshold and budget."""
    groups = []
    for mode in request.modes:
        if mode == "colocated":
            splits = [(0, n) for n in range(1, request.max_workers + 1)]
            thresholds: Sequence[int] = request.thresholds[:1]
        else:
            splits = [(p, d) for total in range(2, request.max_workers + 1)
                      for p in range(1, total) for d in [total - p]]
            thresholds = request.thresholds
        for p, d in splits:
            groups.append([ClusterShape(mode, p, d, budget, request.max_num_seqs, threshold)
                           for threshold, budget in itertools.product(thresholds,
                                                                      request.budgets)])
    return groups


def simulate(request: PlanRequest, shape: ClusterShape,
             requests: Sequence[TraceRequest] | None = None,
             verdict_only: bool = False) -> SimResult:
    """`shape` on the request's trace (or on `requests`), run with seeds 0, 1, ... until
    `request.simulated_requests` requests are simulated, the runs laid end to end. With
    `verdict_only`, the runs stop as soon as the SLO is certain to be missed
    (`miss_budget`; the result is then `stopped`, its figures partial): for `meets_slo_at`.

    With a step-time spread one run of a short trace is one draw of its percentiles, not
    their expected value: on a 100-request point whose decode steps were bimodal (those
    beside another's prefill, those not), one seed put the TPOT p50 at 70 ms, 16 seeds'
    runs together at 51 (measured: 46). Without a spread every run is the same, so one
    is made.
    """
    trace = requests or request.requests
    spread = max(request.prefill_profile.step_cv, request.decode_profile.step_cv) > 0
    runs = -(-request.simulated_requests // len(trace)) if spread else 1
    budget = miss_budget(request.slo, runs * len(trace)) if verdict_only else None
    results: list[SimResult] = []
    for seed in range(runs):
        results.append(Simulation(shape, request.prefill_profile, request.decode_profile,
                                  seed).run(trace, budget))
        if results[-1].stopped:
            break
    return SimResult.end_to_end(results)


def miss_budget(slo: Slo, num_requests: int) -> MissBudget | None:
    """The most of `num_requests` requests that may miss the SLO's TTFT bound with the
    attainment still at its target (None: the SLO bounds no TTFT)."""
    bound = slo.bound("ttft")
    if bound is None:
        return None
    allowed = int(num_requests * (1 - slo.attainment)) + 2
    while allowed > 0 and (num_requests - allowed) / num_requests < slo.attainment:
        allowed -= 1
    return MissBudget(bound / 1e3, allowed)


def meets_slo_at(request: PlanRequest, shape: ClusterShape,
                 requests: Sequence[TraceRequest]) -> bool:
    """Whether `shape` meets the SLO on `requests`: `simulate`'s verdict, the simulation
    stopped as soon as a miss is certain."""
    result = simulate(request, shape, requests, verdict_only=True)
    return not result.stopped and request.slo.meets(figures(result, request.slo))


def predict(request: PlanRequest, shape: ClusterShape) -> dict[str, Any]:
    """The predicted figures of one configuration at the planned rate."""
    result = simulate(request, shape)
    predicted = figures(result, request.slo)
    served = np.isfinite(result.finish)
    tokens_per_s = float(result.output_len[served].sum()) / result.duration
    predicted["cost_per_mtok"] = cost_per_hour(request, shape) / (tokens_per_s * 3600) * 1e6
    predicted["mean_step_ms"] = 1e3 * result.busy_s / max(result.num_steps, 1)
    predicted["num_preemptions"] = result.num_preemptions / result.runs  # per run of the trace
    predicted["num_failed"] = result.num_failed / result.runs
    return predicted


def cost_per_hour(request: PlanRequest, shape: ClusterShape) -> float:
    return (shape.num_prefill * request.cost_per_hour["prefill"]
            + shape.num_decode * request.cost_per_hour["decode"])


def max_rate(request: PlanRequest, shape: ClusterShape, iterations: int = 6) -> float:
    """Highest mean arrival rate (requests/s) at which `shape` meets the SLO; 0 if none.

    Doubling from the planned rate (or halving) brackets it; bisection narrows it to
    2^-iterations of the bracket.
    """
    base = trace_rate(request.requests)
    if np.isinf(base) or len(request.requests) < 2:
        return 0.0

    def ok(rate: float) -> bool:
        return meets_slo_at(request, shape, at_rate(request.requests, rate))

    low, high = 0.0, base
    for _ in range(8):
        if not ok(high):
            break
        low, high = high, high * 2
    else:
        return low
    for _ in range(iterations):
        mid = (low + high) / 2
        low, high = (mid, high) if ok(mid) else (low, mid)
    return low


def plan(request: PlanRequest) -> dict[str, Any]:
    """Search the configurations and recommend the cheapest that meets the SLO.

    Returns:
        The `pdcluster.plan/1` document (see docs/planner.md), with `deploy`: the
        recommended configuration's serve config file, command and RayCluster.
    """
    configs = []
    for group in shapes(request):
        scored = [(shape, predict(request, shape)) for shape in group]
        shape, predicted = max(scored, key=lambda sp: (request.slo.meets(sp[1]),
                                                       sp[1][ATTAINMENT],
                                                       sp[1][GOODPUT]))
        if request.find_max_rate:
            predicted["max_rate_rps"] = max_rate(request, shape)
        configs.append(config_entry(request, shape, predicted))
    good = [c for c in configs if c["meets_slo"]]
    recommended = min(good, key=lambda c: (c["cost_per_hour"], -c["predicted"][GOODPUT],
                                           c["prefill"] + c["decode"]), default=None)
    deploy = None if recommended is None else deployment(
        recommended, request.prefill_profile, request.decode_profile, request.max_num_seqs,
        request.serve_model)
    sweep = None
    if recommended is not None and request.sweep_rates and sweepable(request.requests):
        shape = shape_of(recommended, request.max_num_seqs)
        sweep = rate_sweep(recommended, request.slo, trace_rate(request.requests),
                           lambda rate: figures(simulate(request, shape, at_rate(
                               request.requests, rate)), request.slo))
    return {"schema": SCHEMA, "model": request.decode_profile.model,
            "slo": request.slo.as_dict(),
            "rate_rps": trace_rate(request.requests), "num_requests": len(request.requests),
            "recommended": recommended, "deploy": deploy, "configs": configs,
            "pareto": pareto_front(configs, recommended), "rate_sweep": sweep}


def sweepable(requests: Sequence[TraceRequest]) -> bool:
    """Whether the trace's arrivals can be rescaled (two or more, not all at once)."""
    return len(requests) > 1 and bool(np.isfinite(trace_rate(requests)))


def shape_entry(shape: ClusterShape, threads_per_worker: int) -> dict[str, Any]:
    """What a plan file's configuration entry says of the servers (`validate.serve_flags`
    builds them from it)."""
    return {"mode": shape.mode, "prefill": shape.num_prefill, "decode": shape.num_decode,
            "threads_per_worker": threads_per_worker,
            "max_num_batched_tokens": shape.max_num_batched_tokens,
            "local_prefill_threshold": shape.local_prefill_threshold}


def config_entry(request: PlanRequest, shape: ClusterShape, predicted: dict[str, Any]
                 ) -> dict[str, Any]:
    """One configuration as the plan file lists it."""
    return {**shape_entry(shape, request.decode_profile.torch_threads),
            "cost_per_hour": cost_per_hour(request, shape),
            "meets_slo": request.slo.meets(predicted), "predicted": predicted}


def shape_of(config: dict[str, Any],
             max_num_seqs: int = defaults.MAX_NUM_SEQS) -> ClusterShape:
    """The simulator shape of a plan file's configuration entry."""
    return ClusterShape(config["mode"], config["prefill"], config["decode"],
                        config["max_num_batched_tokens"], max_num_seqs,
                        config["local_prefill_threshold"])


def label(config: dict[str, Any]) -> str:
    """`2P+2D` or `4 colocated`."""
    if config["mode"] == "colocated":
        return f"{config['decode']} colocated"
    return f"{config['prefill']}P+{config['decode']}D"
