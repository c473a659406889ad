"""`pdcluster drain`: drain a `serve --detach` front door in place and return once it is
drained: health NOT_SERVING, new requests refused (HTTP 503 with retry-after, gRPC
UNAVAILABLE), running requests finish (up to the drain timeout). The workers keep running.
The front door stays drained until its process ends (its pod's Ray stops); the front door
Ray starts in its place serves and adopts the workers. Run by the front-door pod's preStop
hook (deploy/kuberay)."""

from __future__ import annotations

import argparse
import sys
from typing import Any


def add_parser(sub: Any) -> argparse.ArgumentParser:
    """Register `drain` with the `pdcluster` subcommands.

    Args:
        sub: what `ArgumentParser.add_subparsers()` returned.

    Returns:
        The subcommand's parser.
    """
    drain = sub.add_parser(
        "drain", help="drain a `serve --detach` front door in place; the workers go on",
        description=__doc__)
    drain.add_argument("--address", default=None,
                       help="the Ray cluster ('auto', 'ray://host:10001'; default: auto)")
    drain.add_argument("--name", default="pdcluster", help="the cluster's --name")
    drain.add_argument("--drain-timeout", type=float, default=None,
                       help="seconds running requests get to finish (default: the front "
                            "door's own serve --drain-timeout)")
    drain.set_defaults(func=_drain)
    return drain


def _drain(args: argparse.Namespace) -> int:
    from cluster.frontdoor import drain

    try:
        left = drain(args.address, args.name, args.drain_timeout)
    except (ConnectionError, RuntimeError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    if left is None:
        print(f"no detached cluster named {args.name!r}", file=sys.stderr)
        return 1
    cut = f"; {left} requests still running at the drain timeout" if left else ""
    print(f"drained {args.name!r}: refusing new requests until its front door's process "
          f"ends{cut}")
    return 0
