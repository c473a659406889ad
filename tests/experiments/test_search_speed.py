"""The search-speed experiment's trace and summary."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from experiments.search_speed import summary, trace


def test_the_trace_is_the_documented_mix_at_the_asked_rate() -> None:
    requests = trace(2000, 60.0)
    prompts = [len(r["prompt_token_ids"]) for r in requests]
    outputs = [r["output_len"] for r in requests]
    assert min(prompts) >= 500 and max(prompts) <= 2999
    assert min(outputs) >= 100 and max(outputs) <= 399
    gaps = np.diff([r["timestamp"] for r in requests])
    assert requests[0]["timestamp"] == 0.0 and abs(1 / gaps.mean() - 60.0) < 4.0
    assert trace(5, 1.0) == trace(5, 1.0)


def test_the_summary_keeps_the_search_counts_and_the_pick(tmp_path: Path) -> None:
    pick = {"mode": "colocated", "prefill": 0, "prefill_tp": None, "decode": 5,
            "decode_tp": 1, "accelerators": 5, "cost_per_hour": 12.5, "predicted": {}}
    doc = {"rate_rps": 60.0001, "num_requests": 1200, "recommended": pick,
           "pareto": [{}, {}], "search": {"within_budget": 397, "seconds": 30.5}}
    path = tmp_path / "p16.json"
    path.write_text(json.dumps(doc))
    (run,) = summary([path])["runs"]
    assert run["within_budget"] == 397 and run["seconds"] == 30.5 and run["pareto"] == 2
    assert run["rate_rps"] == 60.0 and run["requests"] == 1200
    assert run["recommended"] == {k: v for k, v in pick.items() if k != "predicted"}
