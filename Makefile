# ddp-cifar: the project's commands. `make test` is THE test command (README, .ci/run).
SHELL := /bin/bash
.SHELLFLAGS := -euo pipefail -c
.DEFAULT_GOAL := help

VENV       ?= .venv
PY         := $(VENV)/bin/python
PYTHON3    ?= python3
VERSION    := $(shell sed -n 's/^version *= *"\(.*\)"/\1/p' pyproject.toml | head -n1)
BASE_IMAGE ?= nvcr.io/nvidia/pytorch:26.08-py3
IMAGE      ?= ddp-cifar:latest
CPU_BASE   ?= ddp-cifar-base:cpu
CPU_IMAGE  ?= ddp-cifar:cpu
# The legacy builder: present with every Docker engine, needs no buildx, and uses a local base as is.
export DOCKER_BUILDKIT ?= 0

.PHONY: help setup lint image cpu-base image-cpu test bench demo clean clean-images

help:
	@echo "make setup      create $(VENV) with the project and its dev dependencies"
	@echo "make lint       ruff check ."
	@echo "make image      build $(IMAGE) on $(BASE_IMAGE) (override with BASE_IMAGE=...)"
	@echo "make cpu-base   build $(CPU_BASE) from nothing (debootstrap + local CPU torch wheel)"
	@echo "make image-cpu  build $(CPU_IMAGE) on $(CPU_BASE)"
	@echo "make test       setup + image-cpu + lint + pytest: the whole test suite"
	@echo "make bench      run the benchmarks in bench/"
	@echo "make demo       the end-to-end demo (scripts/demo.sh)"
	@echo "make clean      remove build caches (docker/wheels, .cache, __pycache__); images stay"

# The venv is (re)installed when pyproject.toml changes; the stamp records the last install.
setup: $(VENV)/.installed
$(VENV)/.installed: pyproject.toml
	@test -x $(PY) || $(PYTHON3) -m venv $(VENV)
	$(PY) -m pip install --quiet -e '.[dev]'
	@touch $@

lint: setup
	$(VENV)/bin/ruff check .

image:
	docker build --build-arg BASE_IMAGE=$(BASE_IMAGE) --build-arg VERSION=$(VERSION) -t $(IMAGE) .

cpu-base: setup
	PIP=$(VENV)/bin/pip CPU_BASE_TAG=$(CPU_BASE) docker/cpu-base/build.sh

image-cpu: cpu-base
	docker build --build-arg BASE_IMAGE=$(CPU_BASE) --build-arg VERSION=$(VERSION) -t $(CPU_IMAGE) .

# pytest exits 5 when it collected nothing: that is a failure here too (make fails on any non-zero).
test: setup image-cpu lint
	$(PY) -m pytest tests

bench: setup
	$(PY) -m bench

demo: setup
	scripts/demo.sh

clean:
	rm -rf docker/wheels .cache .pytest_cache .ruff_cache
	find . -path ./$(VENV) -prune -o -name __pycache__ -type d -prune -exec rm -rf {} +

# Not part of clean: images are slow to rebuild and may be in use by running containers.
clean-images:
	-docker image rm $(CPU_IMAGE) $(CPU_BASE) ddp-cifar-rootfs:bookworm
