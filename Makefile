# The two commands a newcomer needs:  make repro  (set up + run the pipeline)
#                                      make test   (set up + the whole test suite)
# Both are idempotent; Linux only (uv.lock resolves for Linux: pyproject.toml, [tool.uv]). System packages come only
# from targets that say so before installing: system-deps (as root: what the tests use), data-package (the default
# dataset, part of make repro where apt-get exists and it runs as root), server-deps (PostgreSQL, for make
# tracking-server) and image-deps (podman, runc, debootstrap).
# The venv's bin/ goes first on PATH so that `python`, `torchrun` and `dvc` in dvc.yaml's commands resolve to it.

PYTHON ?= python3
VENV   ?= .venv
BIN    := $(abspath $(VENV))/bin
export PATH := $(BIN):$(PATH)
FASHION_DIR := /usr/share/datasets/fashion-mnist

.PHONY: setup setup-runtime venv venv-runtime lock data-package repro test test-fast test-slurm test-gpu gpu-check lint bench \
	clean-runs system-deps system-check server-deps image-deps tracking-server

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
# Then each stage's locked packages (paths.stage_env/<stage>.txt, its dependency in dvc.yaml): a new version re-runs
# only the stages that import the package, and a dev tool's none.
lock: | $(UV) $(VENV)/.installed-runtime
	$(UV) lock --upgrade
	python -m ddpipe.config --stage-env
	@echo "uv.lock refreshed: run 'make test' (the suite against the new versions) before committing it"

# The default dataset without internet: Debian's package, where apt-get exists and we are root (it says so first).
# Elsewhere the fetch stage downloads it (or set data.source_dir; see README).
data-package:
	@if [ -d $(FASHION_DIR) ]; then :; \
	elif command -v apt-get >/dev/null 2>&1 && [ "$$(id -u)" = 0 ]; then \
		echo "data-package: apt-get install dataset-fashion-mnist (the default dataset, offline: $(FASHION_DIR))"; \
		(apt-get update -q && apt-get install -y -q dataset-fashion-mnist) \
		|| echo "warning: could not install dataset-fashion-mnist; the fetch stage will try to download"; \
	else echo "note: $(FASHION_DIR) missing and apt-get unavailable (or not root); the fetch stage will download"; fi

# The system packages the tests use (Debian's or Ubuntu's archive), and which tests skip without them:
#   dataset-fashion-mnist                 the tests that run the pipeline on the real data (tests/conftest.py)
#   chromium                              tests/test_ui.py: `mlflow ui` looked at as a person would
#   slurm-wlm slurmctld slurmd munge      tests/test_slurm.py, and tests/test_cluster.py's SLURM tests (also root)
#   postgresql (15, 16, 17: any)          tests/test_server.py: the team's tracking server (and make tracking-server)
#   openssh-server                        tests/test_cluster.py's DVC SSH remote on 127.0.0.1 (also root)
#   qemu-user                             tests/test_export.py's INT8 on an emulated AVX2 EPYC
#   podman runc                           tests/test_build_context.py: what an image's build is sent (also root)
# Only `make system-deps` installs them (as root; .ci/run calls it); make test checks them (system-check) and names the
# tests that will skip.
SYSTEM_PACKAGES := dataset-fashion-mnist chromium slurm-wlm slurmctld slurmd munge postgresql openssh-server \
	qemu-user podman runc

system-deps:
	@command -v apt-get >/dev/null 2>&1 || { echo "system-deps: apt-get not found (Debian or Ubuntu); elsewhere install" \
		"the equivalents of: $(SYSTEM_PACKAGES)" >&2; exit 1; }
	@[ "$$(id -u)" = 0 ] || { echo "system-deps: apt-get installs as root: sudo make system-deps" >&2; exit 1; }
	@if dpkg -s $(SYSTEM_PACKAGES) >/dev/null 2>&1; then echo "system-deps: all installed: $(SYSTEM_PACKAGES)"; \
	else echo "system-deps: apt-get install $(SYSTEM_PACKAGES)" \
		&& apt-get update -q && apt-get install -y -q $(SYSTEM_PACKAGES); fi

# What `make test` finds on this host: each missing package with the tests that will skip without it. Installs nothing.
system-check:
	@missing=; has() { command -v "$$1" >/dev/null 2>&1 || [ -x "/usr/sbin/$$1" ]; }; \
	skip() { echo "note: $$1 not installed: $$2 will skip"; missing=1; }; \
	[ -d $(FASHION_DIR) ] || skip dataset-fashion-mnist "the tests that run the pipeline on Fashion-MNIST"; \
	has chromium || skip chromium tests/test_ui.py; \
	{ has slurmctld && has slurmd && has munged; } || skip "SLURM (slurm-wlm, munge)" \
		"tests/test_slurm.py and tests/test_cluster.py's SLURM tests"; \
	{ ls /usr/lib/postgresql/*/bin/initdb || has initdb; } >/dev/null 2>&1 || skip postgresql tests/test_server.py; \
	has sshd || skip openssh-server "tests/test_cluster.py's SSH remote test"; \
	has qemu-x86_64 || skip qemu-user "tests/test_export.py's emulated AVX2 test"; \
	{ has podman && has runc; } || skip "podman, runc" tests/test_build_context.py; \
	if [ -n "$$missing" ]; then echo "note: 'make system-deps', as root, installs them (Debian or Ubuntu)"; fi; \
	if [ "$$(id -u)" != 0 ]; then echo "note: not root: the SLURM, SSH remote and podman tests will skip"; fi

# PostgreSQL (Debian's or Ubuntu's, any version: 15, 16, 17) for the team's tracking server (make tracking-server),
# installed where apt-get exists and we are root, saying so first.
server-deps:
	@if ls /usr/lib/postgresql/*/bin/initdb >/dev/null 2>&1 || command -v initdb >/dev/null 2>&1; then :; \
	elif command -v apt-get >/dev/null 2>&1 && [ "$$(id -u)" = 0 ]; then \
		echo "server-deps: apt-get install postgresql (the tracking server's database)"; \
		(apt-get update -q && apt-get install -y -q postgresql) || echo "warning: could not install PostgreSQL"; \
	else echo "note: PostgreSQL missing and apt-get unavailable (or not root): install it for make tracking-server"; fi

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
		echo "image-deps: apt-get install podman runc debootstrap (to build and run the training image)"; \
		(apt-get update -q && apt-get install -y -q podman runc debootstrap) || echo "warning: could not install podman"; \
	else echo "note: podman, runc or debootstrap missing and apt-get unavailable (or not root); tests/test_image.py will skip"; fi

image-base: image-deps
	@if $(PODMAN) image exists localhost/ddpipe-base:bookworm; then echo "localhost/ddpipe-base:bookworm exists"; else \
		root=$$(mktemp -d) && debootstrap --variant=minbase --include=python3,python3-venv,ca-certificates,git \
			bookworm $$root >/dev/null \
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
test: venv system-check
	python -m pytest -n $(TEST_WORKERS) $(TEST_DIST) -m "not image"

# The SLURM tests alone: a two-node cluster on this host runs, stops and requeues train.sbatch jobs.
test-slurm: venv system-check
	python -m pytest -k "slurm or cluster"

# The CUDA/NCCL paths (tests/test_gpu.py: autocast + GradScaler, channels_last, augmentation and pinned copies
# on the GPU, torch's SyncBatchNorm, torch.compile, GPU -> CPU model loading, the launcher under NCCL): run on
# a machine with a GPU; without one they skip.
test-gpu: venv
	python -m pytest -v tests/test_gpu.py

# One GPU check, prepared for a short session on a GPU machine (issue 71), from the lock's versions: ResNet-50's
# images/s at 224 px in bf16 and fp32, the loader's ratio to the model alone, decoding on the GPU against the workers,
# then test-gpu's tests; at most GPU_CHECK_BUDGET_S seconds once the venv is there. Figures in
# bench/results/gpu-check.json (bench/gpu_check.py; --dry-run lists its commands).
GPU_CHECK_BUDGET_S ?= 480
gpu-check: venv
	python bench/gpu_check.py --budget-s $(GPU_CHECK_BUDGET_S)

test-fast: venv system-check
	python -m pytest -n $(TEST_WORKERS) $(TEST_DIST) -m "not slow and not image"

lint: venv
	ruff check src stages tests bench

# Start the MLflow store afresh: mlflow.db and mlartifacts/ move to runs-backup-<time>/ (nothing is deleted).
clean-runs:
	@stamp=runs-backup-$$(date +%Y%m%d-%H%M%S); moved=; \
	for f in mlflow.db mlflow.db-wal mlflow.db-shm mlartifacts; do \
		if [ -e $$f ]; then mkdir -p $$stamp && mv $$f $$stamp/ && moved="$$moved $$f"; fi; done; \
	if [ -n "$$moved" ]; then echo "moved$$moved to $$stamp/"; else echo "no MLflow store here; nothing to move"; fi

bench: setup
	python bench/run_all.py
