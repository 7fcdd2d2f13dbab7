# Two entry points (see README): `make run` and `make test`. Both set up .venv first, idempotently.
PYTHON ?= python3.11
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.setup-stamp

.PHONY: setup run test torch-setup test-torch lint typecheck bench clean

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
	$(PY) -m pytest -q -p no:cacheprovider -n 2 --dist loadfile --durations=25 tests

# `make test-torch TORCH=2.6.0`: the whole suite on another torch release, in a venv of its own
# (.venv-torch-2.6.0, set up once like .venv) with the dev lock's other packages; the packages that torch
# pins itself (sympy, triton, its CUDA libraries) are left to it, and so is moto's cfn-lint (the locked one needs
# sympy>=1.14, which torch 2.6 refuses). PyPI's Linux torch wheels are CUDA builds:
# a few GB of download and disk per release (they run on the CPU too). `.venv` is not touched.
TORCH ?=
TVENV := .venv-torch-$(TORCH)
TORCH_OWN := ^(torch|sympy|triton|nvidia-.*|cfn-lint)==

.venv-torch-%/.setup-stamp: requirements-dev.txt constraints-dev.txt pyproject.toml
	test -x .venv-torch-$*/bin/python || $(PYTHON) -m venv .venv-torch-$*
	grep -Ev '$(TORCH_OWN)' requirements-dev.txt > .venv-torch-$*/requirements.txt
	grep -Ev '$(TORCH_OWN)' constraints-dev.txt > .venv-torch-$*/constraints.txt
	.venv-torch-$*/bin/python -m pip install -q --disable-pip-version-check "torch==$*" \
		-r .venv-torch-$*/requirements.txt -c .venv-torch-$*/constraints.txt
	.venv-torch-$*/bin/python -m pip install -q --disable-pip-version-check --no-deps -e .
	touch $@

torch-setup:
	@test -n "$(TORCH)" || { echo "usage: make test-torch TORCH=2.6.0 (a torch release in pyproject.toml's range)"; exit 2; }
	@$(MAKE) --no-print-directory $(TVENV)/.setup-stamp

test-torch: torch-setup
	$(TVENV)/bin/python -c 'import sys, torch; print("shardsafe tests on torch", torch.__version__, sys.version.split()[0])'
	$(TVENV)/bin/python -m pytest -q -p no:cacheprovider tests

bench: setup
	$(PY) -m pip install -q --disable-pip-version-check -r requirements-bench.txt -c constraints-dev.txt
	$(PY) bench/run.py
	$(PY) bench/incremental.py --size-mib 1024 --reps 5

clean:
	rm -rf $(VENV) .venv-torch-* build *.egg-info src/*.egg-info .mypy_cache .ruff_cache
