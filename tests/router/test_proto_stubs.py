"""The checked-in gRPC stubs are exactly what `scripts/generate_proto.sh` makes from the
.proto."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PROTO_DIR = ROOT / "router" / "proto"
STUBS = ("pdcluster_pb2.py", "pdcluster_pb2.pyi", "pdcluster_pb2_grpc.py")


def test_stubs_match_proto(tmp_path: Path) -> None:
    subprocess.run(["bash", str(ROOT / "scripts" / "generate_proto.sh"), str(tmp_path)], check=True,
                   env={**os.environ, "PYTHON": sys.executable}, timeout=60)
    for name in STUBS:
        fresh = (tmp_path / "pdcluster" / "v1" / name).read_text()
        checked_in = (PROTO_DIR / "pdcluster" / "v1" / name).read_text()
        assert fresh == checked_in, f"{name} is stale: run scripts/generate_proto.sh"
