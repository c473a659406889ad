"""The plan as people read it: a table of every configuration (the recommended one
marked), predicted beside measured after `--validate`, and a goodput plot."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

from rich.console import Console

from planner.plan import label
from protocol.slo import ATTAINMENT, GOODPUT

# Piped or redirected, rich would assume 80 columns and cut the tables' cells.
console = Console() if sys.stdout.isatty() else Console(width=1000)


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value:.0f}" if value >= 100 else f"{value:.1f}"


def _figure(key: str, value: float | None) -> str:
    """A plan figure as printed: milliseconds, attainment in %, goodput in req/s."""
    if value is None or key.endswith("_ms"):
        return _ms(value)
    return f"{value:.1%}" if key == ATTAINMENT else f"{value:.3g}"


def print_plan(doc: dict[str, Any]) -> None:
    """The configurations as a rich table, the recommended one marked."""
    from rich.table import Table

    slo = ", ".join(f"{k}={v:g}" for k, v in doc["slo"].items())
    table = Table(title=f"plan · {doc['model']} · {doc['num_requests']} requests at "
                        f"{doc['rate_rps']:.3g} req/s · {slo}")
    for column in ("config", "threshold", "budget", "TTFT p50/p90 ms", "TPOT p50/p90 ms",
                   "attainment", "goodput req/s", "max rate", "$/h", "$/Mtok", "SLO"):
        table.add_column(column)
    best = doc["recommended"]
    for c in doc["configs"]:
        p = c["predicted"]
        mark = "[bold green]recommended[/]" if c is best or c == best else \
            ("yes" if c["meets_slo"] else "[red]no[/]")
        tp = f" TP{c['prefill_tp'] or '-'}/{c['decode_tp']}" if "decode_tp" in c else ""
        table.add_row(label(c) + tp, str(c["local_prefill_threshold"]),
                      str(c["max_num_batched_tokens"]),
                      f"{_ms(p['ttft_p50_ms'])} / {_ms(p['ttft_p90_ms'])}",
                      f"{_ms(p['tpot_p50_ms'])} / {_ms(p['tpot_p90_ms'])}",
                      f"{p[ATTAINMENT]:.1%}", f"{p[GOODPUT]:.3g}",
                      f"{p.get('max_rate_rps', float('nan')):.3g}", f"{c['cost_per_hour']:g}",
                      f"{p['cost_per_mtok']:.3g}", mark)
    console.print(table)
    if best is None:
        console.print("[red]no configuration meets the SLO within --max-workers "
                      "(or --max-accelerators)[/]")
    calibration = doc.get("calibration")
    if calibration is not None:
        console.print("calibrated to this machine's speed now" if calibration["applied"]
                      else f"not calibrated: {calibration['reason']}")
    if (deploy := doc.get("deploy")) is not None:
        console.print(f"serve it: write {deploy['serve_config_file']} (the plan's "
                      f"deploy.serve_config):\n{deploy['serve_config']}",
                      soft_wrap=True, highlight=False)
        console.print(f"then run:\n  {deploy['serve_command']}", soft_wrap=True)
        console.print("on KubeRay: the plan's deploy.kuberay_manifest (a RayCluster)")
        for note in deploy["notes"]:
            console.print(f"note: {note}")


def print_validation(doc: dict[str, Any]) -> None:
    """Predicted beside measured for each validated configuration, with its role
    (recommended, rejected: predicted to miss the SLO, other) and whether it met the SLO.
    The prediction shown is the one the error is of: `repredicted` (calibrated through
    the served configuration) where the entry has one, else the plan's; where the
    re-prediction turned the plan's SLO verdict, the verdict row says so."""
    from rich.table import Table

    table = Table(title="predicted vs measured")
    for column in ("config", "role", "figure", "predicted", "measured", "error"):
        table.add_column(column)
    for c in doc["configs"]:
        if "measured" not in c:
            continue
        predicted = c.get("repredicted", c["predicted"])
        for key, error in c["error"].items():
            table.add_row(label(c), c.get("validation_role", "-"), key,
                          _figure(key, predicted[key]), _figure(key, c["measured"][key]),
                          "-" if error is None else f"{error:+.1%}" if key != ATTAINMENT
                          else f"{error * 100:+.1f} pt")
        meets = c.get("repredicted_meets_slo", c["meets_slo"])
        verdict = "yes" if meets else "no"
        if c.get("slo_verdict_changed"):
            verdict += f" (plan: {'yes' if c['meets_slo'] else 'no'})"
        table.add_row(label(c), c.get("validation_role", "-"), "meets SLO", verdict,
                      "yes" if c["measured"]["meets_slo"] else "no", "")
    console.print(table)
    for c in doc["configs"]:
        served = c.get("served_calibration")
        if served is not None and not served["applied"]:
            console.print(f"{label(c)}: not calibrated through the server "
                          f"({served['reason']}); compared with the plan's prediction")


def plot_plan(doc: dict[str, Any], path: Path) -> None:
    """Goodput against the split (bars), the planned rate as a line."""
    from matplotlib.figure import Figure

    configs = doc["configs"]
    fig = Figure(figsize=(max(6, 0.6 * len(configs)), 4))
    ax = fig.add_subplot()
    colors = ["tab:green" if c["meets_slo"] else "tab:gray" for c in configs]
    ax.bar([label(c) for c in configs], [c["predicted"][GOODPUT] for c in configs],
           color=colors)
    ax.axhline(doc["rate_rps"], color="tab:red", linestyle="--", label="offered rate")
    ax.set_ylabel("predicted goodput (req/s)")
    ax.set_title("goodput by split (green: meets the SLO)")
    ax.tick_params(axis="x", rotation=60)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def print_front(doc: dict[str, Any]) -> None:
    """The goodput-per-dollar Pareto front and the recommended configuration's rate
    sweep, as rich tables (`planner.frontier`)."""
    from rich.table import Table

    if doc.get("pareto"):
        table = Table(title="Pareto front: cost per hour against the highest rate meeting "
                            "the SLO")
        for column in ("config", "$/h", "sustained req/s", "requests per $", "SLO at plan"):
            table.add_column(column)
        for p in doc["pareto"]:
            per_dollar = p["requests_per_dollar"]
            table.add_row(p["config"] + (" [bold green](recommended)[/]"
                                         if p["recommended"] else ""),
                          f"{p['cost_per_hour']:g}", f"{p['max_rate_rps']:.3g}",
                          "-" if per_dollar is None else f"{per_dollar:.4g}",
                          "yes" if p["meets_slo"] else "no")
        console.print(table)
    if (sweep := doc.get("rate_sweep")) is not None:
        table = Table(title=f"rate sweep · {sweep['config']}")
        for column in ("rate req/s", "attainment", "goodput req/s", "TTFT p90 ms",
                       "TPOT p90 ms", "SLO"):
            table.add_column(column)
        for p in sweep["points"]:
            table.add_row(f"{p['rate_rps']:.3g}", f"{p['attainment']:.1%}",
                          f"{p['goodput_rps']:.3g}", _ms(p["ttft_p90_ms"]),
                          _ms(p["tpot_p90_ms"]), "yes" if p["meets_slo"] else "[red]no[/]")
        console.print(table)


def plot_front(doc: dict[str, Any], path: Path) -> None:
    """Two panels: every configuration's cost per hour against its sustained rate, the
    Pareto front joined; the recommended configuration's attainment and p90 latencies
    against the rate."""
    from matplotlib.figure import Figure

    fig = Figure(figsize=(11, 4))
    cost, sweep = fig.add_subplot(1, 2, 1), fig.add_subplot(1, 2, 2)
    configs = [c for c in doc["configs"] if c["predicted"].get("max_rate_rps") is not None]
    cost.scatter([c["cost_per_hour"] for c in configs],
                 [c["predicted"]["max_rate_rps"] for c in configs], color="tab:gray",
                 label="simulated")
    front = doc.get("pareto") or []
    cost.plot([p["cost_per_hour"] for p in front], [p["max_rate_rps"] for p in front],
              "o-", color="tab:green", label="Pareto front")
    for p in front:
        cost.annotate(p["config"], (p["cost_per_hour"], p["max_rate_rps"]), fontsize=7)
    cost.set_xlabel("cost per hour")
    cost.set_ylabel("highest rate meeting the SLO (req/s)")
    cost.legend()
    if (rs := doc.get("rate_sweep")) is not None:
        rates = [p["rate_rps"] for p in rs["points"]]
        sweep.plot(rates, [p["attainment"] for p in rs["points"]], "o-", color="tab:blue",
                   label="attainment")
        sweep.axhline(doc["slo"]["attainment"], color="tab:blue", linestyle=":")
        sweep.set_ylim(0, 1.05)
        sweep.set_xlabel("arrival rate (req/s)")
        sweep.set_ylabel("attainment")
        latency = sweep.twinx()
        for key, color in (("ttft_p90_ms", "tab:red"), ("tpot_p90_ms", "tab:orange")):
            latency.plot(rates, [p[key] if p[key] is not None else float("nan")
                                 for p in rs["points"]], "s--", color=color, label=key)
        latency.set_yscale("log")
        latency.set_ylabel("p90 (ms)")
        latency.legend(loc="center right")
        sweep.set_title(f"rate sweep · {rs['config']}")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
