# zerodp: `make quickstart` trains a small GPT on 2 processes; `make test` runs the test suite.
# Both create .venv and install zerodp into it. Without a GPU the CPU build of torch is installed
# first (torch==2.13.0); with one, pip keeps/installs the CUDA build that torch's range resolves to.

VENV ?= .venv
PY := $(VENV)/bin/python
HAS_GPU := $(shell command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1 && echo 1)
NPROC ?= 2
# On a machine without GPUs DeepSpeed must be told to use its CPU accelerator (gloo collectives).
ifeq ($(HAS_GPU),)
export DS_ACCELERATOR := cpu
TORCH_PIN := torch==2.13.0
endif

.PHONY: install quickstart test bench clean

install: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(if $(TORCH_PIN),$(PY) -m pip install -q $(TORCH_PIN))
	$(PY) -m pip install -q -e '.[dev]' ninja
	touch $@

quickstart: install
	$(VENV)/bin/deepspeed --num_gpus $(NPROC) --module zerodp train configs/tiny.yaml

test: install
	$(PY) -m pytest -q tests

bench: install
	$(PY) benchmarks/strategy_overhead.py

clean:
	rm -rf $(VENV) runs
