#!/usr/bin/env bash
# Build the pdcluster wheel into the folder given (default dist/) from a copy of the files
# git would commit: neither a stale build/ folder nor an untracked file reaches the wheel.
# PYTHON picks the interpreter whose pip builds it (default python3). Prints the wheel.
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
out="$(mkdir -p "${1:-$root/dist}" && cd "${1:-$root/dist}" && pwd)"
src=$(mktemp -d /tmp/pdcluster-wheel-src.XXXXXX)
trap 'rm -rf "$src"' EXIT
(cd "$root" && git ls-files -co --exclude-standard -z | while IFS= read -r -d '' f; do
    [ -f "$f" ] && printf '%s\0' "$f"; done | xargs -0 cp --parents -t "$src")
rm -f "$out"/pdcluster-*.whl
"${PYTHON:-python3}" -m pip wheel -q --no-deps -w "$out" "$src" >&2
ls "$out"/pdcluster-*.whl
