# Two entry points (see README): `make run` and `make test`. Both set up .venv first, idempotently.
PYTHON ?= python3.11
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.setup-stamp

.PHONY: setup run test lint typecheck bench clean

$(STAMP): requirements-dev.txt constraints-dev.txt pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --disable-pip-version-check -r requirements-dev.txt -c constraints-dev.txt
	$(PY) -m pip install -q --disable-pip-version-check --no-deps -e .
	touch $(STAMP)

setup: $(STAMP)

run: setup
	$(PY) examples/train.py

lint: setup
	$(PY) -m ruff check src tests examples bench
	$(PY) -m ruff format --check src tests examples bench

typecheck: setup
	$(PY) -m mypy

test: setup lint typecheck
	$(PY) -m pytest -q -p no:cacheprovider tests

bench: setup
	$(PY) -m pip install -q --disable-pip-version-check -r requirements-bench.txt -c constraints-dev.txt
	$(PY) bench/run.py
	$(PY) bench/incremental.py --size-mib 1024 --reps 5

clean:
	rm -rf $(VENV) build *.egg-info src/*.egg-info .mypy_cache .ruff_cache
