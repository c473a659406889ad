"""`pdcluster stop`: drain and stop a cluster that `serve --detach` started."""

from __future__ import annotations

import argparse
import sys
from typing import Any

from protocol import defaults


def add_parser(sub: Any) -> argparse.ArgumentParser:
    """Register `stop` with the `pdcluster` subcommands.

    Args:
        sub: what `ArgumentParser.add_subparsers()` returned.

    Returns:
        The subcommand's parser.
    """
    stop = sub.add_parser("stop", help="drain and stop a `serve --detach` cluster")
    stop.add_argument("--address", default=None,
                      help="the Ray cluster ('auto', 'ray://host:10001'; default: auto)")
    stop.add_argument("--name", default="pdcluster", help="the cluster's --name")
    stop.add_argument("--drain-timeout", type=float, default=defaults.DRAIN_TIMEOUT_S,
                      help="seconds running requests get to finish")
    stop.set_defaults(func=_stop)
    return stop


def _stop(args: argparse.Namespace) -> int:
    from cluster.frontdoor import stop

    removed = stop(args.address, args.name, args.drain_timeout)
    if not removed:
        print(f"no detached cluster named {args.name!r}", file=sys.stderr)
        return 1
    print(f"stopped {args.name!r} ({removed} actors removed)")
    return 0
