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

# compose/docker-compose.yml reads these (see its header); compose-data writes a synthetic set there.
DDP_DATA_DIR ?= $(CURDIR)/out/compose/data
SYNTH_TRAIN  ?= 2000
SYNTH_TEST   ?= 500

.PHONY: help setup lint image cpu-base image-cpu test test-gpu bench demo compose-data compose-cpu clean clean-images

help:
	@echo "make setup      create $(VENV) with the project and its dev dependencies"
	@echo "make lint       ruff check ., mypy (type hints of orchestrate/, trainer/, devcluster/), lint-imports (layers), shellcheck (every *.sh, .ci/run)"
	@echo "make image      build $(IMAGE) on $(BASE_IMAGE) (override with BASE_IMAGE=...)"
	@echo "make cpu-base   build $(CPU_BASE) from nothing (debootstrap + local CPU torch wheel)"
	@echo "make image-cpu  build $(CPU_IMAGE) on $(CPU_BASE)"
	@echo "make test       setup + image-cpu + lint + pytest: the whole test suite"
	@echo "make test-gpu   the GPU tier (pytest -m gpu tests/trainer/gpu): on a machine with CUDA; fails without"
	@echo "make bench      run the benchmarks in bench/ (docs/benchmarks.md: each exits 1 past its bound)"
	@echo "make demo       the end-to-end demo on 2 simulated nodes (scripts/demo.sh)"
	@echo "make compose-cpu  two-node training on this host with compose/docker-compose.yml"
	@echo "make clean      remove build caches (docker/wheels, .cache/cpu-base, __pycache__); images stay"

# The venv is (re)installed when pyproject.toml changes; the stamp records the last install.
# pip compiles every installed module on one core (17 s of a fresh install here); compileall does it on every core
# (12 s). The bytecode is needed: where PYTHONDONTWRITEBYTECODE is set (as on this project's machines), a module
# without its .pyc is compiled again by every process that imports it. torch's py312_intrinsics.py is Python 3.12
# syntax that pip's compile skips quietly: compileall's other failures fail the install.
setup: $(VENV)/.installed
$(VENV)/.installed: pyproject.toml
	@test -x $(PY) || $(PYTHON3) -m venv $(VENV)
	$(PY) -m pip install --quiet --no-compile -e '.[dev]'
	$(PY) -m compileall -q -j 0 -x 'py312_intrinsics' $(VENV)/lib
	@touch $@

# Every shell script of the repo: the image's, the machine's, the ones run on hosts, CI's.
SHELL_SCRIPTS = $(shell find docker scripts orchestrate devcluster .ci -name '*.sh') .ci/run

lint: setup
	$(VENV)/bin/ruff check .
	$(VENV)/bin/mypy
	$(VENV)/bin/lint-imports  # .importlinter: the layers of docs/orchestrate.md, no import cycles
	shellcheck $(SHELL_SCRIPTS)

# The base is pulled first when missing (the build would pull it anyway), so that its registry digest is known and
# recorded in the image's label org.opencontainers.image.base.digest (docs/image.md: nodes pull the base themselves).
image:
	docker image inspect $(BASE_IMAGE) >/dev/null 2>&1 || docker pull $(BASE_IMAGE)
	repo=$(BASE_IMAGE); [[ $${repo##*/} != *:* ]] || repo=$${repo%:*}; \
	digest=$$(docker image inspect -f '{{range .RepoDigests}}{{println .}}{{end}}' $(BASE_IMAGE) \
	          | sed -n "s|^$$repo@||p" | head -n1); \
	docker build --build-arg BASE_IMAGE=$(BASE_IMAGE) --build-arg BASE_DIGEST=$$digest \
	  --build-arg VERSION=$(VERSION) -t $(IMAGE) .

cpu-base: setup
	PIP=$(VENV)/bin/pip CPU_BASE_TAG=$(CPU_BASE) docker/cpu-base/build.sh

image-cpu: cpu-base
	docker build --build-arg BASE_IMAGE=$(CPU_BASE) --build-arg VERSION=$(VERSION) -t $(CPU_IMAGE) .

# pytest exits 5 when it collected nothing: that is a failure here too (make fails on any non-zero).
# --durations: CI prints its 40 slowest tests; the run ends with a summary per tier (tests/kit/summary.py) and writes
# each module's seconds to out/test-durations.json (copy it over tests/durations.json to re-balance the workers).
# The tests write the repo's bytecode (__pycache__, ignored by git and by the image's build context): with
# PYTHONDONTWRITEBYTECODE set, every CLI run and every local torchrun process compiled orchestrate/ or trainer/ again.
# TEST_WORKERS: pytest-xdist workers. Each test module is a unit of work, handed to whichever worker is free, the
# longest first by tests/durations.json (tests/conftest.py); every worker makes the test hosts it needs.
TEST_WORKERS ?= 3
# The image build waits on the network and the disk much of its time, so lint runs beside it (-j2; -O keeps each
# one's output in one piece); the tests need both.
test: setup
	$(MAKE) --no-print-directory -j2 -O image-cpu lint
	@mkdir -p out
	env -u PYTHONDONTWRITEBYTECODE DDP_TEST_IMAGE=$(CPU_IMAGE) $(PY) -m pytest -n $(TEST_WORKERS) --durations=40 --store-durations out/test-durations.json tests

# The GPU tier: CUDA kernels, NCCL, the GPU benchmark (docs/gpu-nodes.md). Needs a CUDA build of torch in the venv
# (the dev extra pins the CPU wheel); every test fails, never skips, where CUDA is missing.
test-gpu: setup
	$(PY) -m pytest -m gpu --durations=20 tests/trainer/gpu

# The input-pipeline benchmark compares with torchvision, which the project venv does not carry: it gets
# its own venv (.venv-bench, made once). launch_scaling needs root, dockerd and the CPU image.
BENCH_VENV ?= .venv-bench
# DeepSpeed's launcher, the baseline of bench/launch_latency.py, in a venv of its own (CPU torch).
DS_VENV    ?= .venv-bench-ds
bench: setup image-cpu
	@test -x $(BENCH_VENV)/bin/python || { $(PYTHON3) -m venv $(BENCH_VENV) && \
		$(BENCH_VENV)/bin/pip install --quiet torch==2.14.1 torchvision==0.29.1 numpy; }
	$(BENCH_VENV)/bin/python bench/input_pipeline.py
	$(PY) bench/rank_timing.py
	$(PY) bench/async_checkpoint.py
	$(PY) bench/fsdp_memory.py
	$(PY) bench/image_delta.py --image $(CPU_IMAGE)
	@test -x $(DS_VENV)/bin/deepspeed || { $(PYTHON3) -m venv $(DS_VENV) && \
		$(DS_VENV)/bin/pip install --quiet torch==2.13.0 deepspeed; }
	@command -v pdsh >/dev/null || apt-get install -y -q pdsh
	$(PY) bench/launch_latency.py --image $(CPU_IMAGE)
	$(PY) bench/devcluster_hosts.py --image $(CPU_IMAGE)
	DDP_TEST_IMAGE=$(CPU_IMAGE) $(PY) bench/recovery.py
	$(PY) bench/launch_scaling.py  # last: its 1.5x goal wants a core per test host (2 cores under load miss it)

demo: setup image-cpu
	scripts/demo.sh

# Synthetic CIFAR-10 written by the image's own trainer (no host Python needed).
compose-data: image-cpu
	@mkdir -p $(DDP_DATA_DIR)
	docker run --rm --init -v $(DDP_DATA_DIR):/data $(CPU_IMAGE) \
		python -m trainer.data synth --out /data --train $(SYNTH_TRAIN) --test $(SYNTH_TEST)

compose-cpu: compose-data
	@mkdir -p $(CURDIR)/out/compose/checkpoints
	export DDP_DATA_DIR=$(DDP_DATA_DIR); rc=0; \
	docker-compose -f compose/docker-compose.yml up || rc=$$?; \
	docker-compose -f compose/docker-compose.yml down; exit $$rc

clean:
	rm -rf docker/wheels .cache/cpu-base .pytest_cache .ruff_cache
	find . -path ./$(VENV) -prune -o -name __pycache__ -type d -prune -exec rm -rf {} +

# Not part of clean: images are slow to rebuild and may be in use by running containers.
clean-images:
	-docker image rm $(CPU_IMAGE) $(CPU_BASE) ddp-cifar-rootfs:bookworm
