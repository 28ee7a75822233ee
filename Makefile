# Two entry points for a fresh machine; each creates the virtual environment it needs.
#   make train   -- the main job: a character-level language model trained on 2 CPU ranks (gloo);
#                   flags go in ARGS, e.g. make train ARGS="--bf16 --steps 800" (all: --help);
#                   the script checks them, then starts its ranks with torchrun's launcher
#   make test    -- lint + the test suite (real gloo process groups, 2 and 4 ranks)
#   make bench   -- the benchmark suite vs FSDP2 (BENCHMARKS.md); make bench-quick: < 1 min
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.funcshard-installed

.PHONY: train test lint bench bench-quick

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --disable-pip-version-check torch==2.13.0
	$(BIN)/pip install --quiet --disable-pip-version-check -e '.[dev]'
	touch $(STAMP)

train: $(STAMP)
	$(BIN)/python examples/train_lm.py $(ARGS)

lint: $(STAMP)
	$(BIN)/ruff check .

test: lint
	$(BIN)/python -m pytest

BENCH_STAMP := $(VENV)/.funcshard-bench-installed

$(BENCH_STAMP): $(STAMP)
	$(BIN)/pip install --quiet --disable-pip-version-check -e '.[dev,bench]'
	touch $(BENCH_STAMP)

bench: $(BENCH_STAMP)
	$(BIN)/python -m benchmarks.run $(ARGS)

bench-quick: $(BENCH_STAMP)
	$(BIN)/python -m benchmarks.run --quick $(ARGS)
