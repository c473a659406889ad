"""Planner choices on synthetic profiles whose answers are known, the plan file, bad input."""

from __future__ import annotations

import functools
import importlib.util
import json
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from bench.loadgen import RequestRecord
from bench.serving_metrics import summarize
from commands.cli import main
from planner.plan import (
    PlanRequest,
    at_rate,
    figures,
    load_trace,
    meets_slo_at,
    miss_budget,
    plan,
    predict,
    simulate,
    trace_rate,
)
from planner.profile import Profile
from planner.simulator import ClusterShape, MissBudget, SimResult, Simulation
from protocol.serving import Slo
from tests.planner.synthetic import poisson_arrivals, random_prompts, synthetic_profile, trace

# A 1000-token prompt takes 1 s to prefill, a 32-token one 34 ms; a decode step 10 ms.
PROFILE = synthetic_profile(prefill=(0.002, 1e-3, 0.0, 0.0), decode=(0.01, 0.0, 0.0))
# The same with 64-token blocks (the same pool in tokens), for traces of 1000-token prompts
# whose KV never fills a pool: the same predictions, with a quarter of the prefix hashing
# the simulator does for each prompt.
LONG_PROMPTS = replace(PROFILE, block_size=64, num_blocks=PROFILE.num_blocks // 4)


def labels(doc: dict) -> dict[str, dict]:
    return {("c" if c["mode"] == "colocated" else f"{c['prefill']}P") + f"{c['decode']}": c
            for c in doc["configs"]}


# 1.5 prompts of 1000 tokens (1 s each) a second, one output token each.
PREFILL_BOUND = trace(poisson_arrivals(100, 1.5, seed=1), random_prompts(100, 1000, seed=2), 1)


@functools.cache
def prefill_bound_plan() -> dict:
    """The plan of every split of up to 4 workers for `PREFILL_BOUND` against TTFT p90 <=
    3 s; prefill workers at 1 $/h, decode at 2 $/h. Made once: tests/planner/
    test_frontier.py reads it too (and neither test changes it)."""
    return plan(PlanRequest(LONG_PROMPTS, LONG_PROMPTS, PREFILL_BOUND,
                            Slo.parse("ttft_p90_ms=3000"), max_workers=4,
                            modes=("disaggregated",), budgets=(1024,),
                            cost_per_hour={"prefill": 1.0, "decode": 2.0}))


def test_a_prefill_bound_trace_gets_just_enough_prefill_workers() -> None:
    """1.5 long prompts/s of 1 s each: one prefill worker is overloaded (rho 1.5), two hold
    (rho 0.75); the cheapest split meeting TTFT p90 <= 3 s is 2P+1D (no split with one
    prefill worker meets it), and 1P+1D's highest sustainable rate lies between rho 0.5
    (meets) and 1 (unstable). 100 requests are enough to tell (2P+1D at 95 %, 1P+1D at
    7 %) and half the cost of 200."""
    doc = prefill_bound_plan()

    configs = labels(doc)
    assert not any(configs[f"1P{d}"]["meets_slo"] for d in (1, 2, 3))
    assert configs["2P1"]["meets_slo"] and configs["3P1"]["meets_slo"]
    best = doc["recommended"]
    assert (best["mode"], best["prefill"], best["decode"]) == ("disaggregated", 2, 1)
    assert 0.5 < configs["1P1"]["predicted"]["max_rate_rps"] < 1.0


def test_interference_makes_the_planner_disaggregate() -> None:
    """Short prompts with 50-token answers share the cluster with rare 1 s prefills. On a
    colocated worker a short answer caught behind a long prefill misses TPOT <= 15 ms;
    with a prefill worker the decode steps stay 10 ms. At equal cost (2 workers) the
    planner must pick 1P+1D over 2 colocated."""
    n = 400
    rng = np.random.default_rng(3)
    long = rng.random(n) < 0.1
    prompts = [p if is_long else p[:32]
               for p, is_long in zip(random_prompts(n, 1000, seed=4), long, strict=True)]
    outputs = [1 if is_long else 50 for is_long in long]
    requests = trace(poisson_arrivals(n, 2.0, seed=5), prompts, outputs)
    slo = Slo.parse("ttft_p90_ms=5000,tpot_p90_ms=15", attainment=0.99)

    doc = plan(PlanRequest(PROFILE, PROFILE, requests, slo, max_workers=2,
                           find_max_rate=False, sweep_rates=False))

    assert doc["rate_sweep"] is None  # not asked for: the pick alone
    configs = labels(doc)
    assert not configs["c1"]["meets_slo"] and not configs["c2"]["meets_slo"]
    assert configs["c2"]["predicted"]["tpot_p99_ms"] > 15
    assert configs["1P1"]["meets_slo"]
    assert (doc["recommended"]["prefill"], doc["recommended"]["decode"]) == (1, 1)


def test_nothing_recommended_when_no_config_meets_the_slo() -> None:
    requests = trace(poisson_arrivals(50, 5.0, seed=6), random_prompts(50, 1000, seed=7), 1)
    doc = plan(PlanRequest(PROFILE, PROFILE, requests, Slo.parse("ttft_p90_ms=100"),
                           max_workers=2, find_max_rate=False))
    assert doc["recommended"] is None
    assert not any(c["meets_slo"] for c in doc["configs"])


def write_trace(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_plan_cli_writes_the_plan_schema(tmp_path: Path,
                                         capsys: pytest.CaptureFixture[str]) -> None:
    """`-o` writes the plan; `--json` prints the same document, and only it, on stdout."""
    profile = tmp_path / "profile.json"
    PROFILE.save(profile)
    rows = [{"timestamp": 0.5 * i, "prompt_len": 300, "output_len": 8} for i in range(40)]
    trace_path = write_trace(tmp_path / "trace.jsonl", rows)
    out = tmp_path / "plan.json"

    assert main(["plan", "--profile", str(profile), "--trace", str(trace_path), "--rate", "1",
                 "--slo", "ttft_p90_ms=2000,tpot_p90_ms=50", "--max-workers", "2",
                 "--no-calibrate", "-o", str(out), "--json"]) == 0

    doc = json.loads(out.read_text())
    assert json.loads(capsys.readouterr().out) == doc
    assert doc["schema"] == "pdcluster.plan/1"
    assert doc["rate_rps"] == pytest.approx(1.0)
    assert [(c["mode"], c["prefill"], c["decode"]) for c in doc["configs"]] == [
        ("disaggregated", 1, 1), ("colocated", 0, 1), ("colocated", 0, 2)]
    keys = {"ttft_p50_ms", "ttft_p90_ms", "tpot_p50_ms", "tpot_p90_ms", "attainment",
            "goodput_rps", "max_rate_rps", "cost_per_mtok"}
    for c in doc["configs"]:
        assert {"mode", "prefill", "decode", "threads_per_worker", "max_num_batched_tokens",
                "local_prefill_threshold", "predicted"} <= set(c)
        assert keys <= set(c["predicted"])
    assert doc["recommended"] == min((c for c in doc["configs"] if c["meets_slo"]),
                                     key=lambda c: c["cost_per_hour"])


def test_a_simulation_is_scored_as_the_bench_scores_the_same_requests_measured() -> None:
    """Five requests as the simulator returns them and as the load generator records them
    (same arrivals, first and last tokens, output lengths): the plan's figures and the bench
    summary's are the same. Against TTFT <= 300 ms and TPOT <= 50 ms two meet it (the first,
    and the third: one token, no TPOT) over the 2 s from the first arrival to the last
    token."""
    arrival = np.array([0.0, 0.5, 1.0, 1.2, 1.5])
    first = np.array([0.2, 0.9, 1.25, 1.3, np.nan])  # TTFT 200, 400, 250, 100 ms; failed
    finish = np.array([0.6, 1.3, 1.25, 2.0, np.nan])  # TPOT 40, 40 ms; none; 100 ms
    output_len = np.array([11, 11, 1, 8, 4])
    result = SimResult(arrival, first, finish, output_len)
    records = [RequestRecord(i, a, int(n), 10, a, [(f, 1), (e, int(n) - 1)][:min(n, 2)], e,
                             int(n), "length", None)
               for i, (a, f, e, n) in enumerate(zip(arrival[:4], first[:4], finish[:4],
                                                    output_len[:4], strict=True))]
    records.append(RequestRecord(4, 1.5, 4, 10, 1.5, [], 1.6, 0, None, "UNAVAILABLE"))
    slo = Slo.parse("ttft=300,tpot=50")

    predicted = figures(result, slo)

    assert result.duration == pytest.approx(2.0)
    assert predicted == summarize(records, 2.0, slo)["figures"]
    assert predicted["attainment"] == pytest.approx(2 / 5)
    assert predicted["goodput_rps"] == pytest.approx(2 / 2.0)


def test_rate_rescales_the_trace() -> None:
    requests = trace(np.arange(11) * 2.0, random_prompts(11, 20, seed=8), 4)
    assert trace_rate(requests) == pytest.approx(0.5)
    faster = at_rate(requests, 2.0)
    assert [r.timestamp for r in faster] == pytest.approx(np.arange(11) * 0.5)
    with pytest.raises(ValueError, match="all arrive at once"):
        at_rate(trace(np.zeros(3), random_prompts(3, 20, seed=9), 4), 1.0)


def test_a_spread_profile_is_simulated_until_enough_requests_and_the_runs_pooled() -> None:
    """With a step spread, 25 requests and `simulated_requests=60` make three runs (seeds
    0, 1, 2) laid end to end: each run's latencies unchanged, the duration their sum, the
    counts summed and the predicted preemptions per run; without a spread, one run."""
    requests = trace(poisson_arrivals(25, 4.0, seed=13), random_prompts(25, 300, seed=14), 8)
    spread = replace(PROFILE, step_cv=0.3)
    shape = ClusterShape("colocated", 0, 1, 512, 64)
    slo = Slo.parse("ttft_p90_ms=1000")

    pooled = simulate(PlanRequest(spread, spread, requests, slo, simulated_requests=60), shape)

    runs = [Simulation(shape, spread, spread, seed).run(requests) for seed in range(3)]
    assert pooled.runs == 3
    np.testing.assert_allclose(pooled.ttft, np.concatenate([r.ttft for r in runs]))
    np.testing.assert_allclose(pooled.tpot, np.concatenate([r.tpot for r in runs]))
    assert pooled.duration == pytest.approx(sum(r.duration for r in runs))
    assert pooled.num_steps == sum(r.num_steps for r in runs)
    assert len({r.duration for r in runs}) == 3  # the seeds differ
    predicted = predict(PlanRequest(spread, spread, requests, slo, simulated_requests=60),
                        shape)
    assert predicted["attainment"] == pytest.approx(
        np.mean([(r.ttft <= 1.0).mean() for r in runs]))
    assert predicted["num_preemptions"] == sum(r.num_preemptions for r in runs) / 3
    exact = simulate(PlanRequest(PROFILE, PROFILE, requests, slo, simulated_requests=60), shape)
    assert exact.runs == 1
    with pytest.raises(ValueError, match="simulated_requests must be >= 1"):
        PlanRequest(PROFILE, PROFILE, requests, slo, simulated_requests=0)


def test_a_verdict_stops_the_simulation_once_the_miss_is_certain() -> None:
    """1 s prefills on one colocated worker at 0.6-1.6 prompts/s, with a step spread (so
    several runs share the miss budget): at every rate the early-stopped verdict is the
    full simulation's; the overloaded rates stop early, having stepped less, their
    finished requests' first tokens those of the full run; below the overload nothing
    stops. With an attainment of 0.9 and 100 simulated requests, 10 may miss."""
    profile = replace(PROFILE, step_cv=0.05)
    requests = trace(poisson_arrivals(50, 1.0, seed=4), random_prompts(50, 1000, seed=5), 1)
    request = PlanRequest(profile, profile, requests, Slo.parse("ttft_p90_ms=4000"),
                          simulated_requests=100)
    shape = ClusterShape("colocated", 0, 1)
    assert miss_budget(request.slo, 100) == MissBudget(4.0, 10)
    assert miss_budget(Slo.parse("tpot_p90_ms=40"), 100) is None

    stopped = 0
    for rate in (0.6, 0.8, 1.0, 1.2, 1.6):
        at = at_rate(requests, rate)
        full = simulate(request, shape, at)
        early = simulate(request, shape, at, verdict_only=True)
        assert meets_slo_at(request, shape, at) == request.slo.meets(figures(full, request.slo))
        if early.stopped:
            stopped += 1
            assert not request.slo.meets(figures(full, request.slo))
            assert early.num_steps < full.num_steps
            done = np.isfinite(early.first_token)
            assert early.first_token[done] == pytest.approx(full.first_token[:len(done)][done])
        else:
            assert early.num_steps == full.num_steps
    assert stopped >= 2 and meets_slo_at(request, shape, at_rate(requests, 0.6))


def test_the_verdicts_deadline_counts_the_serving_paths_latency() -> None:
    """With 1.5 s of the 4 s TTFT bound spent on the serving path, the early verdict is
    still the full simulation's, and the overload stops sooner than without it."""
    requests = trace(poisson_arrivals(50, 1.0, seed=4), random_prompts(50, 1000, seed=5), 1)
    shape = ClusterShape("colocated", 0, 1)
    late = replace(PROFILE, response_latency_s=1.5)
    verdicts = []
    for rate in (0.5, 0.7, 1.6):
        at = at_rate(requests, rate)
        request = PlanRequest(late, late, at, Slo.parse("ttft_p90_ms=4000"))
        full = simulate(request, shape)
        verdicts.append(meets_slo_at(request, shape, at))
        assert verdicts[-1] == request.slo.meets(figures(full, request.slo))
    assert verdicts[0] and not verdicts[-1]
    at = at_rate(requests, 1.6)
    steps = [simulate(PlanRequest(p, p, at, Slo.parse("ttft_p90_ms=4000")), shape,
                      verdict_only=True).num_steps for p in (PROFILE, late)]
    assert steps[1] < steps[0]


def test_bad_input_gets_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="unknown key 'ttft_p95_ms'"):
        Slo.parse("ttft_p95_ms=100")
    with pytest.raises(ValueError, match="must be > 0"):
        Slo.parse("tpot_p90_ms=0")
    with pytest.raises(ValueError, match="attainment must be in"):
        Slo.parse("tpot_p90_ms=10", attainment=1.5)
    with pytest.raises(ValueError, match="no requests"):
        load_trace(write_trace(tmp_path / "empty.jsonl", []), "tiny")
    other = synthetic_profile(model="other")
    requests = trace(np.zeros(1), random_prompts(1, 20, seed=10), 2)
    with pytest.raises(ValueError, match="different models"):
        PlanRequest(PROFILE, other, requests, Slo.parse("ttft_p90_ms=100"))
    (tmp_path / "not.json").write_text('{"schema": "something/9"}')
    with pytest.raises(ValueError, match=r"expected 'pdcluster\.profile/1'"):
        Profile.load(tmp_path / "not.json")


def test_bad_input_through_the_cli_exits_2(tmp_path: Path, capsys: pytest.CaptureFixture
                                           ) -> None:
    profile = tmp_path / "profile.json"
    PROFILE.save(profile)
    trace_path = write_trace(tmp_path / "t.jsonl", [{"timestamp": 0, "prompt_len": 5,
                                                     "output_len": 2}])
    with pytest.raises(SystemExit) as exit_:  # refused as argparse parses it
        main(["plan", "--profile", str(profile), "--trace", str(trace_path), "--slo",
              "latency=5", "-o", str(tmp_path / "p.json")])
    assert exit_.value.code == 2
    assert "unknown key 'latency'" in capsys.readouterr().err


def test_a_plot_without_the_bench_extra_is_refused_before_planning(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture) -> None:
    """`pip install .` has no matplotlib: `--plot` says which extra to install, before the
    search runs and without writing a plan (the missing module is faked: this venv has it)."""
    profile = tmp_path / "profile.json"
    PROFILE.save(profile)
    trace_path = write_trace(tmp_path / "t.jsonl", [{"timestamp": 0, "prompt_len": 5,
                                                     "output_len": 2}])
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "matplotlib" else find_spec(name, *a))
    out = tmp_path / "p.json"

    assert main(["plan", "--profile", str(profile), "--trace", str(trace_path), "--slo",
                 "ttft_p90_ms=100", "-o", str(out), "--plot", str(tmp_path / "p.png")]) == 2

    assert ("pdcluster plan --plot/--validate needs 'matplotlib', which comes with the bench "
            "extra: pip install 'pdcluster[bench]'") in capsys.readouterr().err
    assert not out.exists()
