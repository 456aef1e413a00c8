# zerodp: `make quickstart` trains a small GPT on one process per usable GPU, at most 2 (2 CPU processes
# on a machine without one); `make test` runs `make lint` (ruff) and then the test suite (on the CPU, GPUs
# or not; the tests marked gpu run where there are enough GPUs). Both create .venv and install zerodp into
# it. Without a GPU the CPU build of torch is installed first (torch==2.13.0); with one, pip keeps/installs
# the CUDA build that torch's range resolves to.
#   make quickstart NPROC=1       exactly 1 process
#   make quickstart FRESH=1       start runs/tiny over (the earlier run is moved aside, not deleted)
#   CUDA_VISIBLE_DEVICES=1 make quickstart   GPU 1 only; CUDA_VISIBLE_DEVICES= make quickstart: the CPU

VENV ?= .venv
PY := $(VENV)/bin/python
# Only chooses which torch build to install: the GPUs a launch uses are counted by zerodp.distributed.devices.
HAS_GPU := $(shell command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1 && echo 1)
NPROC ?=
FRESH ?=
ifeq ($(HAS_GPU),)
TORCH_PIN := torch==2.13.0
endif

.PHONY: install quickstart lint test test-fast bench clean

install: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(if $(TORCH_PIN),$(PY) -m pip install -q $(TORCH_PIN))
	$(PY) -m pip install -q -e '.[dev]' ninja
	touch $@

# launchers/local.sh counts the GPUs (python -m zerodp.distributed.devices count, CUDA_VISIBLE_DEVICES and MIG
# included) and starts that many processes, here at most 2, or 2 CPU processes without a GPU.
quickstart: install
	PATH="$(abspath $(VENV))/bin:$$PATH" MAX_GPUS=2 NPROC=$(NPROC) launchers/local.sh configs/tiny.yaml $(if $(filter-out 0,$(FRESH)),--fresh)

# ruff's settings are pyproject.toml's [tool.ruff]: a lint error fails `make test` too
lint: install
	$(VENV)/bin/ruff check .

# Both tiers: tests/unit (no process group, no training) and tests/distributed (real process groups), as
# TEST_JOBS pytest processes at once, each on its share of the files (tests/support/shards.py); 1: one.
TEST_JOBS ?= 2
test: install lint
	$(PY) -m tests.support.shards $(TEST_JOBS) -- -q tests

# The unit tier alone: the inner loop while changing code.
test-fast: install
	$(PY) -m pytest -q tests/unit

bench: install
	$(PY) benchmarks/strategy_overhead.py

clean:
	rm -rf $(VENV) runs
