"""How `generate`, `status` and `scale` reach a running cluster: their shared flags and
the gRPC client they build from them."""

from __future__ import annotations

import argparse
import json
import os
from typing import Any


def add_client_flags(command: argparse.ArgumentParser) -> None:
    """The endpoint, the call's deadline, and keys and TLS towards a secured server."""
    command.add_argument("--address", default=None,
                         help="gRPC host:port (default: the running serve's endpoint)")
    command.add_argument("--timeout", type=float, default=600.0,
                         help="seconds the call may take")
    command.add_argument("--api-key", default=os.environ.get("PDCLUSTER_API_KEY"),
                         help="default $PDCLUSTER_API_KEY")
    command.add_argument("--admin-key", default=os.environ.get("PDCLUSTER_ADMIN_KEY"),
                         help="for scale; default $PDCLUSTER_ADMIN_KEY")
    command.add_argument("--tls", action="store_true", help="connect with TLS")
    command.add_argument("--tls-ca", default=None, help="CA (PEM) to verify the server with")
    command.add_argument("--tls-cert", default=None, help="client certificate (mutual TLS)")
    command.add_argument("--tls-key", default=None, help="client key (mutual TLS)")


def connect(args: argparse.Namespace) -> Any:
    """A `PdClusterClient` for the flags: `--address`, else the endpoint the running
    `serve` wrote down, else the default gRPC port on this host."""
    from cluster.serve import endpoint_file
    from router.client import PdClusterClient

    address = args.address
    if address is None:
        path = endpoint_file()
        address = json.loads(path.read_text())["grpc"] if path.exists() else "127.0.0.1:50051"
    return PdClusterClient(address, timeout=args.timeout, api_key=args.api_key,
                           admin_key=args.admin_key, tls=args.tls, tls_ca=args.tls_ca,
                           tls_cert=args.tls_cert, tls_key=args.tls_key)
