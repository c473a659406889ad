#!/usr/bin/env bash
# Regenerate the Python stubs for pdcluster.v1 (run from anywhere; the stubs are checked in).
#   scripts/generate_proto.sh [OUT_DIR]   (default: router/proto, next to the .proto)
# Two tweaks after protoc: the gRPC stub's `from pdcluster.v1 import ...` becomes absolute
# within this repository (the stubs import as `router.proto.pdcluster.v1`), and the type
# stub gets a `# ruff: noqa` line (pyproject excludes the generated .py files, not the .pyi).
set -euo pipefail
HERE="$(cd "$(dirname "$0")/../router/proto" && pwd)"
OUT="${1:-$HERE}"
PYTHON="${PYTHON:-python3}"
mkdir -p "$OUT/pdcluster/v1"
"$PYTHON" -m grpc_tools.protoc -I "$HERE" --python_out="$OUT" --pyi_out="$OUT" \
    --grpc_python_out="$OUT" "$HERE/pdcluster/v1/pdcluster.proto"
sed -i 's/^from pdcluster\.v1 import/from router.proto.pdcluster.v1 import/' \
    "$OUT/pdcluster/v1/pdcluster_pb2_grpc.py"
sed -i '1i # ruff: noqa' "$OUT/pdcluster/v1/pdcluster_pb2.pyi"
