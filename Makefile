# Everything a fresh machine needs, in order: a venv, the local CPU torch wheel (any other torch
# spec downloads a multi-GB CUDA build), kvtier with its C++ kernel, redis-server, SGLang.
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
PYTEST_ARGS ?=

.PHONY: setup bench test lint redis-server sglang-env clean

$(BIN)/python:
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade "pip>=23" setuptools wheel
	$(BIN)/pip install -q torch==2.13.0

# --no-build-isolation: the C++ extension builds against the torch installed above.
setup: $(BIN)/python
	$(BIN)/pip install -q --no-build-isolation -e '.[dev]'

bench: setup
	$(BIN)/kvtier bench

redis-server:
	@command -v redis-server >/dev/null && command -v redis-cli >/dev/null || \
		{ apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q redis-server; }

# SGLang 0.5.23 for CPU, next to torch 2.13.0 (never pulls a CUDA torch; ~1.5 min cold).
sglang-env: setup
	bash scripts/setup_sglang.sh $(VENV)

lint: setup
	$(BIN)/ruff check kvtier tests benchmarks examples
	$(BIN)/mypy

test: setup redis-server sglang-env lint
	$(BIN)/python -m pytest -q -p no:cacheprovider $(PYTEST_ARGS)

clean:
	rm -rf $(VENV) build kvtier/*.so *.egg-info
