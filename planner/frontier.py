"""What a plan offers beyond its pick: the goodput-per-dollar Pareto front over the
simulated configurations, and a rate sweep of the recommended one.

A configuration's sustained goodput is the highest arrival rate at which it still meets
the SLO (`max_rate_rps`, found by the search's bisection on the rate); at that rate at
least the attainment target of its requests are within the SLO. The front keeps each
configuration that no other beats on both cost per hour (lower) and sustained rate
(higher).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from protocol.serving import Slo

# The sweep's rates as fractions of the recommended configuration's sustained rate: from
# light load to twice what it sustains (past saturation).
SWEEP_FRACTIONS = (0.25, 0.5, 0.75, 1.0, 1.25, 1.5, 2.0)


def _label(config: dict[str, Any]) -> str:
    tp = "" if "decode_tp" not in config else f" TP{config['decode_tp']}" \
        if config["mode"] == "colocated" else f" TP{config['prefill_tp']}/{config['decode_tp']}"
    split = f"{config['decode']} colocated" if config["mode"] == "colocated" else \
        f"{config['prefill']}P+{config['decode']}D"
    return split + tp


def pareto_front(configs: Sequence[dict[str, Any]],
                 recommended: dict[str, Any] | None = None) -> list[dict[str, Any]]:
    """The configurations no other dominates on (cost per hour, sustained rate), cheapest
    first (so the sustained rate rises along the list).

    A configuration that sustains no rate (`max_rate_rps` 0 or absent) offers nothing and
    is left out; of several at one cost only the one sustaining the most is kept (the
    first listed on a tie).

    Args:
        configs: a plan's `configs` entries, each with `predicted.max_rate_rps`.
        recommended: the plan's recommended entry, marked in the front.

    Returns:
        One entry per configuration on the front (`docs/planner.md`, "pareto").
    """
    def rate(c: dict[str, Any]) -> float:
        return float(c["predicted"].get("max_rate_rps") or 0.0)

    front: list[dict[str, Any]] = []
    best = 0.0
    for c in sorted(configs, key=lambda c: (c["cost_per_hour"], -rate(c))):
        if rate(c) > best:
            best = rate(c)
            front.append({
                "config": _label(c), "mode": c["mode"], "prefill": c["prefill"],
                "decode": c["decode"], "prefill_tp": c.get("prefill_tp"),
                "decode_tp": c.get("decode_tp"), "cost_per_hour": c["cost_per_hour"],
                "max_rate_rps": rate(c),
                "requests_per_dollar": 3600 * rate(c) / c["cost_per_hour"]
                if c["cost_per_hour"] > 0 else None,
                "meets_slo": c["meets_slo"], "recommended": c is recommended})
    return front


def sweep_rates(config: dict[str, Any], planned_rate: float) -> list[float]:
    """The sweep's rates, rising: `SWEEP_FRACTIONS` of the configuration's sustained rate
    (of the planned rate when it has none) and the planned rate itself."""
    top = float(config["predicted"].get("max_rate_rps") or 0.0) or planned_rate
    return sorted({round(f * top, 9) for f in SWEEP_FRACTIONS} | {planned_rate})


def rate_sweep(config: dict[str, Any], slo: Slo, planned_rate: float,
               at: Callable[[float], dict[str, Any]]) -> dict[str, Any]:
    """The configuration's figures from light load to past saturation.

    Args:
        config: a plan's entry, with `predicted` at `planned_rate` (reused as one point)
            and `predicted.max_rate_rps`.
        slo: the plan's objectives.
        planned_rate: the rate `config["predicted"]` was simulated at.
        at: the simulated figures (`planner.plan.figures`) at a rate, asked for each of
            `sweep_rates` but the planned one (the search computes them beforehand, on
            its process pool).

    Returns:
        `{"config": label, "points": [...]}`, the points in rising rate, each with
        `rate_rps`, `attainment`, `goodput_rps`, `ttft_p90_ms`, `tpot_p90_ms`, `meets_slo`.
    """
    points = []
    for rate in sweep_rates(config, planned_rate):
        figures = config["predicted"] if rate == planned_rate else at(rate)
        points.append({"rate_rps": rate, "attainment": figures["attainment"],
                       "goodput_rps": figures["goodput_rps"],
                       "ttft_p90_ms": figures["ttft_p90_ms"],
                       "tpot_p90_ms": figures["tpot_p90_ms"],
                       "meets_slo": slo.meets(figures)})
    return {"config": _label(config), "points": points}
