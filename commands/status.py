"""`pdcluster status`: a running cluster's pools, workers, load and KV usage, as tables or
as its status document (JSON)."""

from __future__ import annotations

import argparse
import json
from typing import Any

from commands.client import add_client_flags, connect
from commands.console import console


def add_parser(sub: Any) -> argparse.ArgumentParser:
    """Register `status` with the `pdcluster` subcommands.

    Args:
        sub: what `ArgumentParser.add_subparsers()` returned.

    Returns:
        The subcommand's parser.
    """
    status = sub.add_parser("status", help="pools, workers, load and KV usage")
    status.add_argument("--json", action="store_true",
                        help="print the status document (JSON) instead of the tables; with "
                             "several models, {\"models\": {NAME: document}}")
    status.add_argument("--model", default=None, metavar="NAME",
                        help="the served model to show (None: every one)")
    add_client_flags(status)
    status.set_defaults(func=_status)
    return status


def _status(args: argparse.Namespace) -> int:
    with connect(args) as client:
        first = client.status(args.model or "")
        names = [args.model] if args.model else first.get("models", [first.get("model")])
        statuses = {name: first if name == first.get("model") else client.status(name)
                    for name in names}
    if args.json:
        document = first if len(statuses) == 1 else {"models": statuses}
        print(json.dumps(document, indent=2, default=str))
        return 0
    out = console()
    for status in statuses.values():
        _print_status(out, status)
    return 0


def _print_status(out: Any, status: dict[str, Any]) -> None:
    """One model's workers and pool settings, as tables."""
    from rich.table import Table

    from protocol.status import workers

    table = Table(title=f"pdcluster · {status.get('model')} · {status.get('mode')}")
    for column in ("worker", "role", "state", "node", "host", "pid", "dtype", "KV blocks",
                   "running", "waiting", "KV used", "prefix hits", "busy"):
        table.add_column(column)
    for w in workers(status):
        busy = w.busy_seconds / max(w.uptime_s, 1e-9)
        table.add_row(w.worker_id, w.role, w.state, w.node[:12], w.host, str(w.pid), w.dtype,
                      f"{w.num_blocks} {w.kv_cache_dtype}", str(w.num_running),
                      str(w.num_waiting), f"{w.kv_usage:.0%}", f"{w.prefix_hit_rate:.0%}",
                      f"{busy:.0%}")
    out.print(table)
    pools = status.get("pool_settings", {})
    if pools:
        settings = Table(title=f"pool settings · {status.get('model')}")
        settings.add_column("setting")
        for role in pools:
            settings.add_column(role)
        for key in sorted({k for values in pools.values() for k in values}):
            settings.add_row(key, *(str(values.get(key, "")) for values in pools.values()))
        out.print(settings)
    generation = status.get("generation_config")
    if generation:
        defaults = ", ".join(f"{k} {v}" for k, v in generation["defaults"].items()) or "none"
        out.print(f"sampling defaults for omitted fields: {defaults} "
                  f"(--generation-config {generation['source']}"
                  f"{': ' + generation['file'] if generation.get('file') else ''})")

