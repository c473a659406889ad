"""The accelerator-budget search: exact bound counts, the cheapest level found by
bisection, TP per role, the CLI."""

from __future__ import annotations

import functools
import json
import os
from dataclasses import replace
from pathlib import Path

import yaml

from commands.cli import main
from planner.search import BudgetRequest, SimulationPool, candidates, search
from protocol.serving import Slo
from tests.planner.synthetic import poisson_arrivals, random_prompts, synthetic_profile, trace
from tests.planner.test_plan import LONG_PROMPTS

# TP 2 halves the step: a 1000-token prompt takes 0.5 s instead of 1 s. (64-token blocks:
# tests/planner/test_plan.py's LONG_PROMPTS.)
TP1 = replace(LONG_PROMPTS, hardware={"tp": 1})
TP2 = replace(synthetic_profile(prefill=(0.001, 5e-4, 0.0, 0.0), decode=(0.005, 0.0, 0.0),
                                block_size=64, num_blocks=LONG_PROMPTS.num_blocks),
              hardware={"tp": 2})
# 1.5 prompts of 1000 tokens a second, one output token each.
REQUESTS = trace(poisson_arrivals(100, 1.5, seed=1), random_prompts(100, 1000, seed=2), 1)


# 0.3 a second: one TP-1 prefill worker keeps up.
LIGHT = trace(poisson_arrivals(100, 0.3, seed=3), random_prompts(100, 1000, seed=4), 1)


def budget(slo: str, requests: list | None = None) -> BudgetRequest:
    return BudgetRequest((TP1, TP2), (TP1,), requests or REQUESTS, Slo.parse(slo),
                         max_accelerators=4,
                         cost_per_accelerator_hour={"prefill": 1.0, "decode": 1.0},
                         modes=("disaggregated",), max_num_batched_tokens=1024)


def test_throughput_bounds_prune_what_cannot_keep_up() -> None:
    """Within 4 accelerators: prefill TP 1 with decode TP 1 has 6 splits, prefill TP 2 two
    (1P+1D, 1P+2D). 1500 prompt tokens a second need 1.5 TP-1 prefill workers (about 1000
    tokens/s each): the three 1P splits at TP 1 are pruned; one TP-2 worker suffices."""
    found, counts = candidates(budget("ttft_p90_ms=3000"))
    assert counts == {"within_budget": 8, "pruned_by_throughput": 3, "pruned_by_latency": 0}
    assert [(c.prefill, c.prefill_tp, c.decode, c.cost_per_hour) for c in found] == [
        (2, 1, 1, 3.0), (1, 2, 1, 3.0), (2, 1, 2, 4.0), (3, 1, 1, 4.0), (1, 2, 2, 4.0)]


def test_the_cheapest_level_that_meets_the_slo_is_recommended() -> None:
    """Two prefill workers at rho 0.75 meet TTFT p90 <= 3 s (tests/planner/test_plan.py):
    the first cost level (3 accelerators) meets, so nothing dearer is simulated."""
    doc = search(budget("ttft_p90_ms=3000"))
    best = doc["recommended"]
    assert (best["prefill"], best["prefill_tp"], best["decode"], best["accelerators"],
            best["cost_per_hour"]) == (2, 1, 1, 3, 3.0)
    assert doc["search"]["simulated"] == 1 and doc["search"]["cost_levels"] == 2
    # Its sustained rate lies between the planned rate and the throughput bound (2 req/s).
    assert 1.5 <= best["predicted"]["max_rate_rps"] <= 2.0
    config = yaml.safe_load(doc["deploy"]["serve_config"])
    assert (config["mode"], config["prefill"]["replicas"], config["decode"]["replicas"]) == (
        "disaggregated", 2, 1)


@functools.cache
def light_search() -> dict:
    """The search on the light trace against TTFT p90 <= 0.9 s, made once: tests/planner/
    test_frontier.py reads it too (and neither test changes it)."""
    return search(budget("ttft_p90_ms=900", LIGHT))


def test_an_unloaded_latency_bound_rules_out_a_tp_degree() -> None:
    """0.3 prompts a second, TTFT p90 <= 0.9 s: a TP-1 prompt takes 1 s even alone, so all
    six TP-1 prefill splits are pruned; one TP-2 prefill worker (0.5 s a prompt, rho 0.15:
    P(wait <= 0.4 s) = 0.85 e^0.12 = 0.96 in M/D/1) is picked, for prefill only."""
    doc = light_search()
    assert doc["search"]["pruned_by_throughput"] == 0
    assert doc["search"]["pruned_by_latency"] == 6
    best = doc["recommended"]
    assert (best["prefill"], best["prefill_tp"], best["decode"], best["decode_tp"]) == (
        1, 2, 1, 1)
    assert doc["deploy"]["tensor_parallel"] == {"prefill": 2, "decode": 1}


def test_plan_cli_searches_the_budget(tmp_path: Path) -> None:
    paths = []
    for name, profile in (("tp1", TP1), ("tp2", TP2)):
        paths.append(tmp_path / f"{name}.json")
        profile.save(paths[-1])
    trace_path = tmp_path / "t.jsonl"
    trace_path.write_text("".join(json.dumps({"timestamp": r.timestamp, "output_len": 1,
                                              "prompt_token_ids": r.prompt_token_ids}) + "\n"
                                  for r in LIGHT))
    out = tmp_path / "plan.json"
    assert main(["plan", "--prefill-profile", f"{paths[0]},{paths[1]}", "--decode-profile",
                 str(paths[0]), "--trace", str(trace_path), "--slo", "ttft_p90_ms=900",
                 "--modes", "disaggregated", "--max-num-batched-tokens", "1024",
                 "--max-accelerators", "4", "--cost-per-accelerator-hour-prefill", "2.5",
                 "-o", str(out)]) == 0
    doc = json.loads(out.read_text())
    assert (doc["recommended"]["prefill_tp"], doc["recommended"]["cost_per_hour"]) == (2, 6.0)
    assert doc["calibration"]["applied"] is False
    assert main(["plan", "--profile", f"{paths[0]},{paths[1]}", "--trace", str(trace_path),
                 "--slo", "ttft_p90_ms=900", "-o", str(out)]) == 2


def test_colocated_candidates_use_the_decode_profiles_alone() -> None:
    """Colocated workers prefill on themselves (no transfer, no prefill profile): with
    different prefill and decode profiles the colocated splits are the decode TP's."""
    request = replace(budget("ttft_p90_ms=3000", LIGHT), modes=("colocated",))
    found, counts = candidates(request)
    assert counts["within_budget"] == 4  # 1 to 4 colocated TP-1 workers
    assert {(c.mode, c.prefill, c.decode_tp) for c in found} == {("colocated", 0, 1)}


def _worker_pid(request: BudgetRequest) -> tuple[int, int]:
    return os.getpid(), len(request.requests)


def test_the_front_and_the_sweep_are_the_same_on_a_process_pool() -> None:
    """The sustained rates and the sweep run on a pool of processes (each receives the
    request once); the plan is the serial one, figure for figure."""
    request = replace(budget("ttft_p90_ms=2000"), max_accelerators=6,
                      modes=("disaggregated", "colocated"))
    with SimulationPool(request, workers=2) as pool:
        pid, seen = pool.submit(_worker_pid).result()
    assert pid != os.getpid() and seen == len(REQUESTS)
    timings = ("search_seconds", "seconds", "cpu_seconds")

    def untimed(doc: dict) -> dict:
        return {**doc, "search": {k: v for k, v in doc["search"].items() if k not in timings}}

    serial, pooled = search(request, workers=1), search(request, workers=2)
    assert [("max_rate_rps" in c["predicted"]) for c in serial["configs"]] == [True] * 3
    assert serial["rate_sweep"] is not None and len(serial["pareto"]) == 3
    assert untimed(pooled) == untimed(serial)
