# The verbs people type. `make demo` and `make test` are the README's two commands; each sets up first.
SHELL := /bin/bash
.DEFAULT_GOAL := help

PYTHON ?= python3.11
VENV ?= .venv
BIN := $(VENV)/bin
# Re-run setup when the dependencies change (or the venv is new); otherwise `make setup` is instant.
STAMP := $(VENV)/.ballast-setup.stamp
# The CPU wheel lies on disk; installing it first keeps pip from pulling a multi-GB CUDA build for the range.
TORCH_VERSION := 2.13.0
PYTEST_ARGS ?=

.PHONY: help setup test test-fast lint demo bench bench-divergence clean distclean

help:
	@echo "make demo       run the main job end to end on embedded defaults"
	@echo "make test       set up (if needed) and run the whole test suite (SQLite and PostgreSQL)"
	@echo "make test-fast  the fast core: no ray/slow/browser tests, SQLite only (no PostgreSQL needed)"
	@echo "make setup      create $(VENV) with $(PYTHON), torch==$(TORCH_VERSION), then the package with [dev]"
	@echo "make lint       ruff over the tree, mypy over api orchestrator workers migrations"
	@echo "make bench      run benchmarks/bench_*.py"
	@echo "make bench-divergence   the divergence benchmark, both halves (~30-55 min on 2 cores)"
	@echo "make clean      remove local state and caches (distclean: the venv too)"

setup: $(STAMP)

$(STAMP): pyproject.toml
	@test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet "torch==$(TORCH_VERSION)"
	$(BIN)/python -m pip install --quiet -e '.[dev]'
	@touch $@

# pytest's own exit codes pass through: 5 ("no tests collected") fails the target like any failure.
test: setup
	$(BIN)/python -m pytest $(PYTEST_ARGS)

# The developer's loop. SQLite only: the PostgreSQL half doubles every store and API test and does not fit the
# budget of this target; `make test` runs both backends.
test-fast: setup
	BALLAST_TEST_BACKENDS=sqlite $(BIN)/python -m pytest -m "not ray and not slow and not browser" $(PYTEST_ARGS)

lint: setup
	@status=0; \
	$(BIN)/ruff check . || status=1; \
	$(BIN)/mypy api ballast contracts orchestrator workers migrations || status=1; \
	exit $$status

demo: setup
	PATH="$(abspath $(BIN)):$$PATH" bash scripts/demo.sh

bench: setup
	$(BIN)/python -m pip install --quiet -e '.[bench]'
	@found=0; for f in benchmarks/bench_*.py; do \
	  [ -e "$$f" ] || continue; found=1; \
	  echo "== $$f"; $(BIN)/python "$$f" || exit 1; \
	done; \
	[ $$found = 1 ] || echo "no benchmarks yet (benchmarks/bench_*.py)"

bench-divergence: setup
	$(BIN)/python -m pip install --quiet -e '.[bench]'
	$(BIN)/python -m benchmarks.divergence.run --half all --out benchmarks/divergence/results

clean:
	rm -rf .ballast .pytest_cache .mypy_cache .ruff_cache .hypothesis build dist
	find . -path ./$(VENV) -prune -o -name __pycache__ -type d -prune -exec rm -rf {} +

distclean: clean
	rm -rf $(VENV) *.egg-info
