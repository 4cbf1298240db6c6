# The two set-up commands of the README: `make demo` and `make test`.
# Each creates .venv on first use and installs r3cache with its dev extras.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: demo test bench lint

# torch is an extra: the CPU build (pinned, so no multi-GB CUDA build is pulled) goes in
# only where the environment has none.
TORCH_CPU ?= torch==2.13.0

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -e ".[dev]"
	$(BIN)/python -c "import torch" 2>/dev/null || $(BIN)/python -m pip install --quiet "$(TORCH_CPU)"
	touch $(STAMP)

demo: $(STAMP)
	$(BIN)/r3cache demo

test: $(STAMP)
	$(BIN)/python -m pytest

bench: $(STAMP)
	$(BIN)/python scripts/bench_step.py

lint: $(STAMP)
	$(BIN)/ruff check r3cache tests scripts
