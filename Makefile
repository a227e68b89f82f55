# `make serve` and `make test` work on a fresh machine: each creates .venv when missing.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
# torch is pinned in pyproject.toml (2.13.0): the CPU wheel on this project's machines.

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip

$(VENV)/.installed: pyproject.toml | $(BIN)/python
	$(BIN)/python -m pip install -q -e .
	touch $@

$(VENV)/.installed-dev: pyproject.toml | $(BIN)/python
	$(BIN)/python -m pip install -q -e ".[dev]"
	touch $(VENV)/.installed $@

.PHONY: install install-dev serve test test-slow lint format
install: $(VENV)/.installed
install-dev: $(VENV)/.installed-dev

# Until the HTTP server lands, serving means generating from the bundled model.
serve: install
	$(BIN)/fulcrum generate --prompt "ROMEO:" --max-tokens 96

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
