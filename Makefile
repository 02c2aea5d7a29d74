# The two commands a newcomer needs:  make repro  (set up + run the pipeline)
#                                      make test   (set up + the whole test suite)
# Both are idempotent. The venv's bin/ goes first on PATH so that `python`, `torchrun` and `dvc`
# in dvc.yaml's commands resolve to it.

PYTHON ?= python3
VENV   ?= .venv
BIN    := $(abspath $(VENV))/bin
export PATH := $(BIN):$(PATH)
FASHION_DIR := /usr/share/datasets/fashion-mnist

.PHONY: setup setup-runtime venv venv-runtime lock data-package repro test test-fast test-slurm test-gpu lint bench \
	clean-runs ui-deps slurm-deps server-deps ssh-deps qemu-deps tracking-server

# The venv is installed from the lock (uv.lock: every package at an exact version, with its hashes) by uv, itself
# pinned here: `make repro` the runtime set, `make test` with the dev tools (pytest, ruff, the schemas' checkers).
# Byte code compiled at install: these hosts set PYTHONDONTWRITEBYTECODE=1, and without it every process of the suite
# compiles torch's and MLflow's imports again (BENCHMARKS.md, "Set-up time").
UV_VERSION := 0.13.9
UV := $(BIN)/uv
UV_SYNC := UV_PROJECT_ENVIRONMENT=$(abspath $(VENV)) $(UV) sync --locked --inexact --compile-bytecode

setup: venv data-package
setup-runtime: venv-runtime data-package

venv: $(VENV)/.installed
venv-runtime: $(VENV)/.installed-runtime

$(UV):
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q "uv==$(UV_VERSION)"

$(VENV)/.installed: uv.lock pyproject.toml | $(UV)
	$(UV_SYNC) --extra dev
	touch $@ $(VENV)/.installed-runtime

$(VENV)/.installed-runtime: uv.lock pyproject.toml | $(UV)
	$(UV_SYNC)
	touch $@

# The lock afresh: the newest versions pyproject.toml allows. An untested combination until the suite has run on it.
lock: | $(UV)
	$(UV) lock --upgrade
	@echo "uv.lock refreshed: run 'make test' (the suite against the new versions) before committing it"

# The default dataset without internet: Debian's package, where apt-get exists and we are root.
# Elsewhere the fetch stage downloads it (or set data.source_dir; see README).
data-package:
	@if [ -d $(FASHION_DIR) ]; then :; \
	elif command -v apt-get >/dev/null 2>&1 && [ "$$(id -u)" = 0 ]; then \
		(apt-get update -q && apt-get install -y -q dataset-fashion-mnist) \
		|| echo "warning: could not install dataset-fashion-mnist; the fetch stage will try to download"; \
	else echo "note: $(FASHION_DIR) missing and apt-get unavailable (or not root); the fetch stage will download"; fi

# Headless Chromium, for the test that looks at `mlflow ui` as a person would (tests/test_ui.py skips without it).
ui-deps:
	@if command -v chromium >/dev/null 2>&1; then :; \
	elif command -v apt-get >/dev/null 2>&1 && [ "$$(id -u)" = 0 ]; then \
		(apt-get update -q && apt-get install -y -q chromium) || echo "warning: could not install chromium"; \
	else echo "note: chromium missing and apt-get unavailable (or not root); tests/test_ui.py will skip"; fi

# SLURM and munge, for the tests that run deploy/slurm/train.sbatch on a throwaway one-host cluster
# (tests/test_slurm.py skips without them, or when not root).
slurm-deps:
	@if command -v slurmctld >/dev/null 2>&1 && command -v slurmd >/dev/null 2>&1 \
		&& command -v munged >/dev/null 2>&1; then :; \
	elif command -v apt-get >/dev/null 2>&1 && [ "$$(id -u)" = 0 ]; then \
		(apt-get update -q && apt-get install -y -q slurm-wlm slurmctld slurmd munge) \
		|| echo "warning: could not install SLURM"; \
	else echo "note: SLURM missing and apt-get unavailable (or not root); tests/test_slurm.py will skip"; fi

# PostgreSQL (Debian's or Ubuntu's, any version: 15, 16, 17), for the team's tracking server and the tests that run one
# (tests/test_server.py skips without it).
server-deps:
	@if ls /usr/lib/postgresql/*/bin/initdb >/dev/null 2>&1 || command -v initdb >/dev/null 2>&1; then :; \
	elif command -v apt-get >/dev/null 2>&1 && [ "$$(id -u)" = 0 ]; then \
		(apt-get update -q && apt-get install -y -q postgresql) || echo "warning: could not install PostgreSQL"; \
	else echo "note: PostgreSQL missing and apt-get unavailable (or not root); tests/test_server.py will skip"; fi

# openssh-server, for the test that reproduces experiments from a real DVC SSH remote on 127.0.0.1 (tests/test_cluster.py).
ssh-deps:
	@if [ -x /usr/sbin/sshd ]; then :; \
	elif command -v apt-get >/dev/null 2>&1 && [ "$$(id -u)" = 0 ]; then \
		(apt-get update -q && apt-get install -y -q openssh-server) || echo "warning: could not install openssh-server"; \
	else echo "note: sshd missing and apt-get unavailable (or not root); the SSH remote test will skip"; fi

# qemu-user, for the test that scores the INT8 copy made for CPUs without VNNI on an emulated AVX2 EPYC
# (tests/test_export.py skips that test without it).
qemu-deps:
	@if command -v qemu-x86_64 >/dev/null 2>&1; then :; \
	elif command -v apt-get >/dev/null 2>&1 && [ "$$(id -u)" = 0 ]; then \
		(apt-get update -q && apt-get install -y -q qemu-user) || echo "warning: could not install qemu-user"; \
	else echo "note: qemu-x86_64 missing and apt-get unavailable (or not root); the emulated AVX2 test will skip"; fi

# The training image (Containerfile) with podman: runc and cgroupfs, as deploy/podman/containers.conf says. IMAGE_BASE:
# any image with Python 3.11+; where no registry is reachable, `make image-base` makes one from Debian's packages
# (debootstrap) and names it ddpipe-base:bookworm. The uv cache of this host feeds the build.
IMAGE ?= localhost/ddpipe:latest
IMAGE_BASE ?= docker.io/library/python:3.11-slim-bookworm
PODMAN := CONTAINERS_CONF=$(abspath deploy/podman/containers.conf) podman
UV_CACHE := $(shell $(UV) cache dir 2>/dev/null || echo $(HOME)/.cache/uv)
# Behind a TLS-inspecting proxy (SSL_CERT_FILE names its CA bundle), the build trusts that bundle
IMAGE_CA := $(if $(SSL_CERT_FILE),-v $(SSL_CERT_FILE):/etc/ssl/certs/ca-certificates.crt:ro)

image-deps:
	@if command -v podman >/dev/null 2>&1 && command -v runc >/dev/null 2>&1 && command -v debootstrap >/dev/null 2>&1; then :; \
	elif command -v apt-get >/dev/null 2>&1 && [ "$$(id -u)" = 0 ]; then \
		(apt-get update -q && apt-get install -y -q podman runc debootstrap) || echo "warning: could not install podman"; \
	else echo "note: podman, runc or debootstrap missing and apt-get unavailable (or not root); tests/test_image.py will skip"; fi

image-base: image-deps
	@if $(PODMAN) image exists localhost/ddpipe-base:bookworm; then echo "localhost/ddpipe-base:bookworm exists"; else \
		root=$$(mktemp -d) && debootstrap --variant=minbase --include=python3,python3-venv,ca-certificates,git \
			bookworm $$root http://deb.debian.org/debian >/dev/null \
		&& tar -C $$root -c . | $(PODMAN) import - localhost/ddpipe-base:bookworm && rm -rf $$root; fi

image: | $(UV)
	mkdir -p $(UV_CACHE)
	$(PODMAN) build --network host -v $(UV_CACHE):/root/.cache/uv $(IMAGE_CA) -t $(IMAGE) --build-arg BASE=$(IMAGE_BASE) .

# The image built from a debootstrap base and run as a 2-node job of two containers, stopped and resumed (minutes:
# not part of `make test`)
test-image: setup image-deps
	python -m pytest -v -m image tests/test_image.py

# The team's DVC remote (`store`, .dvc/config) for development and the tests: SeaweedFS's S3 API on 127.0.0.1, its
# data in $(REMOTE_DIR), its endpoint and keys written into .dvc/config.local (never into git). A real store instead:
# `dvc remote modify --local store endpointurl https://...` and the keys there or in AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY.
REMOTE_DIR ?= .object-store
REMOTE_PORT ?= 8333
remote: setup
	python deploy/object_store.py start --dir $(REMOTE_DIR) --port $(REMOTE_PORT)
	python deploy/object_store.py dvc-remote --dir $(REMOTE_DIR)
	python deploy/object_store.py check

# A team's tracking server on this host: PostgreSQL + mlflow server with users (docs/tracking.md). The admin's
# password comes from MLFLOW_AUTH_ADMIN_PASSWORD (or TRACKING_SERVER_ARGS=--admin-password-file FILE).
TRACKING_SERVER_ARGS ?= --dir tracking-server --host 127.0.0.1 --port 5000
tracking-server: setup server-deps
	python deploy/tracking_server.py start $(TRACKING_SERVER_ARGS)

repro: setup-runtime
	dvc repro

# A test file per core at once (pytest-xdist; a file's tests stay together, so its module fixtures start once), the
# longest files first (tests/conftest.py, LONGEST_FIRST). TEST_WORKERS=0: one process, in order.
TEST_WORKERS ?= auto
TEST_DIST = --dist loadfile --no-loadscope-reorder
test: setup ui-deps slurm-deps server-deps ssh-deps qemu-deps
	python -m pytest -n $(TEST_WORKERS) $(TEST_DIST) -m "not image"

# The SLURM tests alone: a two-node cluster on this host runs, stops and requeues train.sbatch jobs.
test-slurm: setup slurm-deps
	python -m pytest -k "slurm or cluster"

# The CUDA/NCCL paths (tests/test_gpu.py: autocast + GradScaler, channels_last, augmentation and pinned copies
# on the GPU, torch's SyncBatchNorm, torch.compile, GPU -> CPU model loading, the launcher under NCCL): run on
# a machine with a GPU; without one they skip.
test-gpu: setup
	python -m pytest -v tests/test_gpu.py

test-fast: setup
	python -m pytest -n $(TEST_WORKERS) $(TEST_DIST) -m "not slow and not image"

lint: setup
	ruff check src stages tests bench

# Start the MLflow store afresh: mlflow.db and mlartifacts/ move to runs-backup-<time>/ (nothing is deleted).
clean-runs:
	@stamp=runs-backup-$$(date +%Y%m%d-%H%M%S); moved=; \
	for f in mlflow.db mlflow.db-wal mlflow.db-shm mlartifacts; do \
		if [ -e $$f ]; then mkdir -p $$stamp && mv $$f $$stamp/ && moved="$$moved $$f"; fi; done; \
	if [ -n "$$moved" ]; then echo "moved$$moved to $$stamp/"; else echo "no MLflow store here; nothing to move"; fi

bench: setup
	python bench/run_all.py
