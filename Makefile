# `make serve` and `make test` work on a fresh machine: each creates .venv when missing.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
# pyproject.toml declares ranges; constraints.txt pins what make installs (torch: the CPU wheel on this
# project's machines' disk, never a multi-GB CUDA build).

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip

$(VENV)/.installed: pyproject.toml constraints.txt | $(BIN)/python
	$(BIN)/python -m pip install -q -c constraints.txt -e .
	touch $@

$(VENV)/.installed-dev: pyproject.toml constraints.txt | $(BIN)/python
	$(BIN)/python -m pip install -q -c constraints.txt -e ".[dev]"
	touch $(VENV)/.installed $@

.PHONY: install install-dev serve test test-slow lint format bench bench-serve wheel image-cpu image-cuda vllm-venv
install: $(VENV)/.installed
install-dev: $(VENV)/.installed-dev

# The OpenAI-compatible server on the bundled model, http://$(HOST):$(PORT)/v1 (another port: make serve PORT=8001)
# plain = (not ?=): a HOST or PORT exported by the shell (zsh, a PaaS) does not change them; the command line does
HOST = 127.0.0.1
PORT = 8000
serve: install
	$(BIN)/fulcrum serve --host $(HOST) --port $(PORT)

lint: install-dev
	$(BIN)/ruff check fulcrum tests scripts
	$(BIN)/ruff format --check fulcrum tests scripts
	$(BIN)/lint-imports

test: lint
	$(BIN)/python -m pytest -q

test-slow: install-dev
	$(BIN)/python -m pytest -q -m slow

format: install-dev
	$(BIN)/ruff format fulcrum tests scripts
	$(BIN)/ruff check --fix fulcrum tests scripts

# Benchmarks print ratios against baselines measured in the same run (see benchmarks/README.md)
bench: install-dev
	$(BIN)/python benchmarks/bench_throughput.py --model bundled
	$(BIN)/python benchmarks/bench_throughput.py --model qwen05
	$(BIN)/python benchmarks/bench_prefix_cache.py --model qwen05

# fulcrum bench serve against fulcrum serve: concurrency sweep, prefix caching, chunked prefill
bench-serve: install-dev
	$(BIN)/python benchmarks/bench_serve_levers.py

# A wheel and an sdist in dist/ (the bundled models, kernel sources and presets inside): pip install dist/*.whl
wheel: install-dev
	$(BIN)/python -m build --no-isolation --outdir dist .

# The container images fulcrum deploy k8s names by default (docker/); CONTAINER=podman (or buildah bud) works too
CONTAINER ?= docker
VERSION := $(shell sed -n 's/^VERSION = "\([^"]*\)".*/\1/p' fulcrum/defaults.py)
image-cpu:
	$(CONTAINER) build -f docker/Dockerfile.cpu -t fulcrum:$(VERSION)-cpu .
image-cuda:
	$(CONTAINER) build -f docker/Dockerfile.cuda -t fulcrum:$(VERSION)-cuda .

# vLLM's CPU build in a venv of its own (.venv-vllm, never fulcrum's): the live-vLLM tests (make test-slow,
# tests/interop) and benchmarks/bench_vs_vllm.py use it; skipped with a reason when it is missing
vllm-venv: install-dev
	$(BIN)/python benchmarks/vllm_cpu.py ensure
