# Two entry points for a fresh machine; each creates the virtual environment it needs.
#   make train   -- the main job: a character-level language model trained on 2 CPU ranks (gloo);
#                   flags go in ARGS, e.g. make train ARGS="--bf16 --steps 800" (all: --help);
#                   the script checks them, then starts its ranks with torchrun's launcher
#   make test    -- lint + the test suite (real gloo process groups, 2 and 4 ranks), but the
#                   tests marked inductor (steps compiled by inductor: make test-compile runs them)
#   make bench   -- the benchmark suite vs FSDP2 (BENCHMARKS.md); make bench-quick: < 1 min
#   make test-compile TORCH=2.11.0 -- the fs.jit and torch.compile tests (those marked inductor
#                   among them) on another torch release (in a virtual environment of its own,
#                   .venv-torch-2.11.0; default: 2.13.0, .venv-torch-2.13.0; docs/compile.md)
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.funcshard-installed

.PHONY: train test lint bench bench-quick test-compile

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
	$(BIN)/python -m pytest -m "not inductor"

BENCH_STAMP := $(VENV)/.funcshard-bench-installed

$(BENCH_STAMP): $(STAMP)
	$(BIN)/pip install --quiet --disable-pip-version-check -e '.[dev,bench]'
	touch $(BENCH_STAMP)

bench: $(BENCH_STAMP)
	$(BIN)/python -m benchmarks.run $(ARGS)

bench-quick: $(BENCH_STAMP)
	$(BIN)/python -m benchmarks.run --quick $(ARGS)

# CI tests torch 2.13 (.venv); these run the compile tests on another release of the supported
# range (pyproject.toml), e.g. make test-compile TORCH=2.11.0
TORCH       ?= 2.13.0
TORCH_VENV  := .venv-torch-$(TORCH)
TORCH_STAMP := $(TORCH_VENV)/.funcshard-installed
COMPILE_TESTS := tests/test_compile.py tests/test_compile_cache.py tests/test_jit.py \
	tests/test_recompute.py tests/test_optim.py tests/test_parallel_init_compile.py \
	tests/test_benchmarks.py tests/test_docs.py tests/test_cuda_graph.py tests/test_train_lm.py \
	tests/test_train_llama.py

$(TORCH_STAMP): pyproject.toml
	$(PYTHON) -m venv $(TORCH_VENV)
	$(TORCH_VENV)/bin/pip install --quiet --disable-pip-version-check torch==$(TORCH)
	$(TORCH_VENV)/bin/pip install --quiet --disable-pip-version-check -e '.[dev]'
	touch $(TORCH_STAMP)

test-compile: $(TORCH_STAMP)
	PYTHONPATH=$(CURDIR) $(TORCH_VENV)/bin/python -m pytest -q $(COMPILE_TESTS) \
		-k 'compile or gpu_part or jit'
