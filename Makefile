# The two commands a newcomer needs:  make repro  (set up + run the pipeline)
#                                      make test   (set up + the whole test suite)
# Both are idempotent. The venv's bin/ goes first on PATH so that `python`, `torchrun` and `dvc`
# in dvc.yaml's commands resolve to it.

PYTHON ?= python3
VENV   ?= .venv
BIN    := $(abspath $(VENV))/bin
export PATH := $(BIN):$(PATH)
FASHION_DIR := /usr/share/datasets/fashion-mnist

.PHONY: setup data-package repro test test-fast lint bench clean-runs

setup: $(VENV)/.installed data-package

$(VENV)/.installed: pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --upgrade pip
	$(BIN)/python -m pip install -e '.[dev]'
	touch $@

# The default dataset without internet: Debian's package, where apt-get exists and we are root.
# Elsewhere the fetch stage downloads it (or set data.source_dir; see README).
data-package:
	@if [ -d $(FASHION_DIR) ]; then :; \
	elif command -v apt-get >/dev/null 2>&1 && [ "$$(id -u)" = 0 ]; then \
		(apt-get update -q && apt-get install -y -q dataset-fashion-mnist) \
		|| echo "warning: could not install dataset-fashion-mnist; the fetch stage will try to download"; \
	else echo "note: $(FASHION_DIR) missing and apt-get unavailable (or not root); the fetch stage will download"; fi

repro: setup
	dvc repro

test: setup
	python -m pytest

test-fast: setup
	python -m pytest -m "not slow"

lint: setup
	ruff check src stages tests bench

bench: setup
	python -c "import lightning" 2>/dev/null || python -m pip install -e '.[dev,bench]'
	python bench/run_all.py
