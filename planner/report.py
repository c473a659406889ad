"""The plan as people read it: a table of every configuration (the recommended one
marked), predicted beside measured after `--validate`, and a goodput plot."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

from rich.console import Console

from planner.plan import label

# Piped or redirected, rich would assume 80 columns and cut the tables' cells.
console = Console() if sys.stdout.isatty() else Console(width=1000)


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value:.0f}" if value >= 100 else f"{value:.1f}"


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
                      f"{p['attainment']:.1%}", f"{p['goodput_rps']:.3g}",
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
        console.print(f"serve it:\n  {deploy['serve_command']}", soft_wrap=True)
        console.print(f"KubeRay worker groups:\n{deploy['kuberay_worker_groups']}",
                      soft_wrap=True, highlight=False)
        for note in deploy["notes"]:
            console.print(f"note: {note}")


def print_validation(doc: dict[str, Any]) -> None:
    """Predicted beside measured for each validated configuration."""
    from rich.table import Table

    table = Table(title="predicted vs measured")
    for column in ("config", "figure", "predicted", "measured", "error"):
        table.add_column(column)
    for c in doc["configs"]:
        if "measured" not in c:
            continue
        for key, error in c["error"].items():
            table.add_row(label(c), key, _ms(c["predicted"][key]), _ms(c["measured"][key]),
                          "-" if error is None else f"{error:+.1%}" if key != "attainment"
                          else f"{error * 100:+.1f} pt")
    console.print(table)


def plot_plan(doc: dict[str, Any], path: Path) -> None:
    """Goodput against the split (bars), the planned rate as a line."""
    from matplotlib.figure import Figure

    configs = doc["configs"]
    fig = Figure(figsize=(max(6, 0.6 * len(configs)), 4))
    ax = fig.add_subplot()
    colors = ["tab:green" if c["meets_slo"] else "tab:gray" for c in configs]
    ax.bar([label(c) for c in configs], [c["predicted"]["goodput_rps"] for c in configs],
           color=colors)
    ax.axhline(doc["rate_rps"], color="tab:red", linestyle="--", label="offered rate")
    ax.set_ylabel("predicted goodput (req/s)")
    ax.set_title("goodput by split (green: meets the SLO)")
    ax.tick_params(axis="x", rotation=60)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
