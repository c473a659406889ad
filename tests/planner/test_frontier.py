"""The goodput-per-dollar Pareto front and the rate sweep (planner/frontier.py): known
fronts on synthetic profiles, attainment falling with the rate, the plot, and the plan
file's schema as docs/planner.md lists it."""

from __future__ import annotations

import itertools
import json
import re
from dataclasses import replace
from pathlib import Path

import pytest

from commands.cli import main
from planner.frontier import pareto_front
from planner.search import search
from tests.planner.test_plan import LONG_PROMPTS, PREFILL_BOUND, prefill_bound_plan
from tests.planner.test_search import LIGHT, budget, light_search

DOCS = Path(__file__).resolve().parents[2] / "docs" / "planner.md"
# 1.5 prompts of 1000 tokens (1 s each) a second, one output token each: 1P+1D cannot
# keep up (rho 1.5), 2P+1D can (tests/planner/test_plan.py).
REQUESTS = PREFILL_BOUND


@pytest.fixture(scope="module")
def prefill_bound() -> dict:
    """`REQUESTS`, every split of up to 4 workers, prefill workers at 1 $/h, decode at
    2 $/h."""
    return prefill_bound_plan()


@pytest.fixture(scope="module")
def light_budget() -> dict:
    """The budget search of tests/planner/test_search.py on its light trace."""
    return light_search()


def entry(cost: float, rate: float, name: str) -> dict:
    return {"mode": "colocated", "prefill": 0, "decode": int(name), "cost_per_hour": cost,
            "meets_slo": True, "predicted": {"max_rate_rps": rate}}


def test_the_front_keeps_what_nothing_beats_on_cost_and_rate() -> None:
    """By hand: (1 $, 1 req/s) and (3 $, 4 req/s) are beaten by nothing; (2 $, 1 req/s) is
    beaten by the first (as cheap or cheaper, as fast); of the two at 3 $ the faster stays;
    (4 $, 4 req/s) is beaten by (3 $, 4 req/s); one that sustains nothing is left out."""
    configs = [entry(2, 1.0, "2"), entry(1, 1.0, "1"), entry(3, 2.0, "3"),
               entry(3, 4.0, "4"), entry(4, 4.0, "5"), entry(0.5, 0.0, "6")]
    front = pareto_front(configs, recommended=configs[3])
    assert [(p["config"], p["cost_per_hour"], p["max_rate_rps"], p["recommended"])
            for p in front] == [("1 colocated", 1, 1.0, False), ("4 colocated", 3, 4.0, True)]
    assert front[1]["requests_per_dollar"] == pytest.approx(3600 * 4.0 / 3)


def test_the_plan_front_is_non_dominated_and_holds_the_cheapest_that_meets(
        prefill_bound: dict) -> None:
    """With decode workers dearer than prefill ones a split costs P + 2D $/h.
    1P+1D (3 $) sustains under 1 req/s; 2P+1D (4 $) is the cheapest that meets the SLO at
    1.5 req/s; 3P+1D (5 $) sustains more; every split with a second decode worker costs as
    much as one with two more prefill workers and sustains less (its one output token a
    request needs no decode worker more)."""
    doc = prefill_bound
    assert [p["config"] for p in doc["pareto"]] == ["1P+1D", "2P+1D", "3P+1D"]
    assert [p["cost_per_hour"] for p in doc["pareto"]] == [3.0, 4.0, 5.0]
    assert [p["meets_slo"] for p in doc["pareto"]] == [False, True, True]
    assert [p["recommended"] for p in doc["pareto"]] == [False, True, False]
    rec = doc["recommended"]
    assert (rec["prefill"], rec["decode"]) == (2, 1)
    for p in doc["pareto"]:
        assert not any(c["cost_per_hour"] <= p["cost_per_hour"]
                       and c["predicted"]["max_rate_rps"] >= p["max_rate_rps"]
                       and (c["cost_per_hour"], c["predicted"]["max_rate_rps"])
                       != (p["cost_per_hour"], p["max_rate_rps"]) for c in doc["configs"])


def test_the_rate_sweep_loses_attainment_as_the_rate_rises(prefill_bound: dict) -> None:
    """2P+1D on one trace with its arrivals compressed: the queue only grows, so
    attainment never rises with the rate; it meets the SLO up to its sustained rate (and
    at the planned one, the plan's own figures) and misses at twice it."""
    sweep = prefill_bound["rate_sweep"]
    top = prefill_bound["recommended"]["predicted"]["max_rate_rps"]
    points = sweep["points"]
    assert sweep["config"] == "2P+1D" and len(points) == 8
    rates = [p["rate_rps"] for p in points]
    assert rates == sorted(rates) and rates[-1] == pytest.approx(2 * top)
    attainment = [p["attainment"] for p in points]
    assert all(a >= b for a, b in itertools.pairwise(attainment))
    assert all(p["meets_slo"] for p in points if p["rate_rps"] <= top)
    assert not points[-1]["meets_slo"] and points[-1]["ttft_p90_ms"] > 3000
    planned = next(p for p in points if p["rate_rps"] == prefill_bound["rate_rps"])
    assert planned["attainment"] == prefill_bound["recommended"]["predicted"]["attainment"]


def test_the_budget_search_front_holds_its_pick(light_budget: dict) -> None:
    """0.3 prompts a second, TTFT p90 <= 0.9 s: only TP-2 prefill meets it
    (tests/planner/test_search.py), at 3 accelerators; the search also bisects the
    sustained rate of every simulated split not shown dominated, so the front has the
    pick, marked."""
    doc = light_budget
    rec = doc["recommended"]
    # A simulated split without a sustained rate was shown dominated by a cheaper one.
    rated = [c for c in doc["configs"] if "max_rate_rps" in c["predicted"]]
    assert rec in rated
    for c in doc["configs"]:
        assert c in rated or any(r["cost_per_hour"] <= c["cost_per_hour"] for r in rated)
    marked = [p for p in doc["pareto"] if p["recommended"]]
    assert [(p["prefill"], p["prefill_tp"], p["decode"]) for p in marked] == [
        (rec["prefill"], rec["prefill_tp"], rec["decode"])]
    assert doc["rate_sweep"]["config"] == "1P+1D TP2/1"
    # With `front` off the search leaves it out (a shorter trace will do: no figure is
    # checked).
    assert search(replace(budget("ttft_p90_ms=900", LIGHT[:20]), front=False))["pareto"] is None


def documented_fields() -> dict[str, set[str]]:
    """Each table of docs/planner.md's plan section: its first header cell -> the
    backticked names in its first column."""
    section = DOCS.read_text().split("### Plan: `pdcluster.plan/1`")[1].split("\n## ")[0]
    tables: dict[str, set[str]] = {}
    for block in re.split(r"\n\s*\n", section):
        rows = [r for r in block.splitlines() if r.startswith("|")]
        if len(rows) < 3:
            continue
        names = tables.setdefault(rows[0].split("|")[1].strip(), set())
        for row in rows[2:]:
            names.update(re.findall(r"`([a-z_0-9]+)`", row.split("|")[1]))
    return tables


def test_the_schema_doc_lists_every_field_a_plan_has(prefill_bound: dict, light_budget: dict,
                                                     tmp_path: Path) -> None:
    """Every key of a plan file (a `plan --plot` run through the CLI, and a budget search),
    at every level, is in docs/planner.md's table for its object; the PNGs are written."""
    profile, trace_path = tmp_path / "p.json", tmp_path / "t.jsonl"
    LONG_PROMPTS.save(profile)
    trace_path.write_text("".join(json.dumps({"timestamp": r.timestamp, "output_len": 4,
                                              "prompt_token_ids": r.prompt_token_ids}) + "\n"
                                  for r in LIGHT[:20]))
    out, png = tmp_path / "plan.json", tmp_path / "plan.png"
    assert main(["plan", "--profile", str(profile), "--trace", str(trace_path), "--slo",
                 "ttft_p90_ms=3000,tpot_p90_ms=50", "--max-workers", "2", "-o", str(out),
                 "--plot", str(png)]) == 0
    for path in (png, png.with_suffix(".front.png")):
        assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and path.stat().st_size > 10_000
    assert main(["plan", "--profile", str(profile), "--trace", str(trace_path), "--slo",
                 "ttft_p90_ms=3000", "--no-pareto", "-o", str(out)]) == 2
    docs = documented_fields()
    budget_doc = light_budget
    for doc in (json.loads(out.read_text()), prefill_bound, budget_doc):
        assert set(doc) - docs["plan"] == set()
        assert set(doc["deploy"]) - docs["`deploy`"] == set()
        for c in doc["configs"]:
            assert set(c) - docs["`configs` entry"] == set()
            assert set(c["predicted"]) - docs["`predicted`"] == set()
        for p in doc["pareto"]:
            assert set(p) - docs["`pareto` entry"] == set()
        assert set(doc["rate_sweep"]) - docs["`rate_sweep`"] == set()
        for p in doc["rate_sweep"]["points"]:
            assert set(p) - docs["`rate_sweep` point"] == set()
    assert set(budget_doc["search"]) - docs["`search`"] == set()
    # and nothing documented that no plan has (with --validate only: tests/planner/
    # test_validate.py checks those it writes against the doc)
    seen = {k for c in budget_doc["configs"] + prefill_bound["configs"] for k in c}
    assert docs["`configs` entry"] - seen == {
        "measured", "error", "validation_role", "served_calibration", "repredicted",
        "repredicted_meets_slo", "slo_verdict_changed"}
