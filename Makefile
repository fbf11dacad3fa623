# The two commands of the README:
#   make demo   local 3-node fleet on loopback (mTLS agents over investigations/*.db): query + explain
#   make test   installs everything (apt packages as root, venv), lints, type-checks, runs all tests
VENV := .venv
BIN := $(VENV)/bin

.PHONY: demo test setup setup-system lint typecheck test-fast bench investigations clean

demo: setup
	$(BIN)/python scripts/fleet_demo.py

test: setup-system lint typecheck
	$(BIN)/python -m pytest

setup:
	scripts/setup.sh

setup-system:
	scripts/setup.sh --system

lint:
	$(BIN)/ruff check ingero tests bench scripts
	$(BIN)/ruff format --check ingero tests bench scripts

typecheck:
	$(BIN)/mypy

test-fast: setup
	$(BIN)/python -m pytest -n 2 -m "not bpf and not netns and not slow"

bench: setup
	$(BIN)/python bench/run_all.py

investigations: setup
	$(BIN)/ingero investigations --out investigations

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache build *.egg-info
