# Set-up and entry points. `make demo` and `make test` work on a fresh Linux machine with
# Python 3.11: they create .venv, install the pinned CPU build of torch first (an unpinned
# torch would pull several GB of CUDA packages), then this project.
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
export FLPLATFORM_HOME ?= $(CURDIR)/.flplatform
export FLWR_HOME ?= $(FLPLATFORM_HOME)/flwr
export FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION := 1
export FLWR_TELEMETRY_ENABLED := 0

# Debian's dataset-fashion-mnist (benchmarks/bench_many_sites.py's data), as root or with sudo.
.PHONY: setup setup-dev setup-data demo test test-flower-oldest test-fast test-hostile test-resume test-deploy lint bench app-config clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip

$(VENV)/.installed: $(BIN)/python pyproject.toml
	$(BIN)/pip install --quiet torch==2.13.0
	$(BIN)/pip install --quiet -e . $(if $(FLOWER_PIN),'$(FLOWER_PIN)')
	touch $@

$(VENV)/.installed-dev: $(VENV)/.installed
	$(BIN)/pip install --quiet -e '.[dev,postgres]' $(if $(FLOWER_PIN),'$(FLOWER_PIN)')
	touch $@

setup: $(VENV)/.installed

setup-dev: $(VENV)/.installed-dev

SUDO := $(if $(filter 0,$(shell id -u)),,sudo)
setup-data:
	dpkg -s dataset-fashion-mnist >/dev/null 2>&1 || \
		{ $(SUDO) apt-get update -qq && $(SUDO) apt-get install -y -qq dataset-fashion-mnist; }

demo: setup
	$(BIN)/flplatform demo cross-silo

# Every test, markers included (hostile, resume, deploy, thorough): a guarantee CI does not
# run can break unseen. One pytest-xdist worker per core and one more, four at most (each
# starts Flower and Ray; the deployment tests spend most of their time waiting on Flower's
# polling, which the extra worker fills: on 2 cores the CPU sat 9% idle with 2 workers, 2%
# with 3), the longest tests first (tests/conftest.py), a few queued per worker at a time;
# tests that share a module's costly baseline keep to one worker (xdist_group).
# The PostgreSQL contract tests run against a server the tests start (tests/postgres.py):
# FLPLATFORM_REQUIRE_POSTGRES=1 makes them fail, not skip, if it cannot be started.
# The cores this process may use (a container's or taskset's), where the OS says (Linux).
WORKERS := $(shell $(PYTHON) -c "import os; use = getattr(os, 'sched_getaffinity', None); \
	print(min(4, (len(use(0)) if use else os.cpu_count() or 1) + 1))")
PYTEST_WORKERS := -n $(WORKERS) --dist loadgroup
test: setup-dev
	FLPLATFORM_REQUIRE_POSTGRES=1 $(BIN)/python -m pytest -q $(PYTEST_WORKERS)

# The fast loop: no Flower processes.
test-fast: setup-dev
	$(BIN)/python -m pytest -q $(PYTEST_WORKERS) -m "not slow"

# A real run per attack against the attacker silent, all in one sweep (tests/integration/test_hostile.py),
# and the faults: SIGTERM, a dead SuperLink, a dying site (tests/integration/test_lifecycle.py).
test-hostile: setup-dev
	$(BIN)/python -m pytest -q $(PYTEST_WORKERS) -m hostile

# Every strategy and mode killed with SIGKILL (a run; two of them once more as a resume) and
# resumed, compared bit for bit with the run left alone (tests/integration/test_resume.py).
test-resume: setup-dev
	$(BIN)/python -m pytest -q $(PYTEST_WORKERS) -m resume

# Real deployments on 127.0.0.1: `flplatform certs`, `server` and `site`s with TLS and
# registered keys, the nodes that must be refused, Flower's traffic count equal to the
# ledger's bytes, and a server killed mid-run then resumed on its sites
# (tests/integration/test_deploy.py); a SuperLink killed mid-run, under `server` and with
# nobody following the run (tests/integration/test_superlink_death.py).
test-deploy: setup-dev
	$(BIN)/python -m pytest -q $(PYTEST_WORKERS) -m deploy

# The whole suite on the oldest Flower release the platform supports (pyproject.toml's
# flwr pin; `make test` installs the newest in it), in a virtual environment of its own.
OLDEST_FLOWER := $(shell sed -n 's/.*"flwr\[simulation\]>=\([0-9.]*\),.*/\1/p' pyproject.toml)
test-flower-oldest:
	$(MAKE) test VENV=.venv-flower-$(OLDEST_FLOWER) FLOWER_PIN=flwr[simulation]==$(OLDEST_FLOWER)

lint: setup-dev
	$(BIN)/ruff check flplatform clients strategies storage tests benchmarks examples
	$(BIN)/mypy flplatform clients strategies storage
	$(BIN)/lint-imports  # the layers (pyproject.toml's [tool.importlinter])

# [tool.flwr.app.config] of the Flower apps, written from the options table (RunConfig).
app-config: setup
	$(BIN)/python -m flplatform.app.app_config pyproject.toml examples/plain_flower_client/pyproject.toml \
		tests/integration/apps/attack_app/pyproject.toml

bench: setup
	$(BIN)/python benchmarks/bench_round.py

clean:
	rm -rf $(VENV) .venv-flower-* .flplatform .pytest_cache .mypy_cache .ruff_cache .hypothesis .grimp_cache .import_linter_cache
