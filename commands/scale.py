"""`pdcluster scale`: resize a running cluster's pools live."""

from __future__ import annotations

import argparse
from typing import Any

from commands.client import add_client_flags, connect


def add_parser(sub: Any) -> argparse.ArgumentParser:
    """Register `scale` with the `pdcluster` subcommands.

    Args:
        sub: what `ArgumentParser.add_subparsers()` returned.

    Returns:
        The subcommand's parser.
    """
    scale = sub.add_parser("scale", help="resize the pools live")
    scale.add_argument("--prefill", type=int, default=None,
                       help="prefill workers wanted (None: unchanged)")
    scale.add_argument("--decode", type=int, default=None,
                       help="decode (or colocated) workers wanted (None: unchanged)")
    scale.add_argument("--model", default=None, metavar="NAME",
                       help="the served model whose pools to resize (required when the "
                            "cluster serves several)")
    add_client_flags(scale)
    scale.set_defaults(func=_scale)
    return scale


def _scale(args: argparse.Namespace) -> int:
    with connect(args) as client:
        status = client.scale(prefill=args.prefill, decode=args.decode, model=args.model or "")
    sizes = {role: len(workers) for role, workers in status.get("pools", {}).items()}
    print(f"{status.get('model')} pools now: {sizes} (removed workers drain before stopping)")
    return 0
