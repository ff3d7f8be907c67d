# One-command setup: `make demo` and `make test` each create .venv on first use.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
# Python caches the bytecode of what it imports: pip compiles nothing at install (most
# installed modules are never imported here), and with PYTHONDONTWRITEBYTECODE each of the
# suite's hundreds of interpreters would compile its imports again
unexport PYTHONDONTWRITEBYTECODE

.PHONY: demo test lint bench clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	# torch first and pinned: a CPU wheel of exactly this version is on disk;
	# letting pip resolve torch itself would pull several GB of CUDA. The build
	# backend too, so that the editable install builds without an isolated environment.
	$(PY) -m pip install -q --no-compile torch==2.13.0 "hatchling>=1.21" editables
	$(PY) -m pip install -q --no-compile --no-build-isolation -e ".[torch,dev]"
	touch $(STAMP)

demo: $(STAMP)
	$(PY) examples/demo.py

test: $(STAMP)
	# two processes, whole files each: a file's module fixtures are built once; files
	# in the order tests/conftest.py gives them (the slow ones first)
	$(PY) -m pytest -q -n 2 --dist loadfile --no-loadscope-reorder --durations=15

lint: $(STAMP)
	$(VENV)/bin/ruff check . && $(VENV)/bin/ruff format --check .

bench: $(STAMP)
	$(PY) benchmarks/convert.py
	$(PY) benchmarks/loader.py

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache
