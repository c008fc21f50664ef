# Tessera — the two commands a fresh machine needs are `make run` and `make test`.
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
RUN_DIR := .run
MODEL ?= dgx-h100
METRICS ?= 127.0.0.1:9400

.PHONY: run test lint typecheck unit reliability bench gpu-check gpu-bundle clean docs proto

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[test]'
	touch $(STAMP)

SAMPLE_UID := 0b9e7a3c-5d0e-4c7a-9b1e-2f6d8c4a1e01

run: $(STAMP)
	@# an agent already on this state directory holds agent.lock (flock, agent/statelock.py):
	@# stop before overwriting its claim file; the second agent would only exit at the lock
	@if [ -e $(RUN_DIR)/state/agent.lock ] && ! flock -n $(RUN_DIR)/state/agent.lock true; then \
		echo "make run: an agent already runs on $(abspath $(RUN_DIR)/state) (it holds agent.lock);" \
			"its files are left as they are. Stop it (Ctrl-C in its terminal) first, or use" \
			"another directory: make run RUN_DIR=.run2 METRICS=127.0.0.1:9401" >&2; \
		exit 1; \
	fi
	@mkdir -p $(RUN_DIR)/state/resourceclaims
	@# the tour's claim (a whole GPU, else a MIG device), allocated on this model by the allocator
	@cp deploy/daemonset/examples/sample-gpu.yaml $(RUN_DIR)/state/resourceclaims/sample-gpu.yaml
	@$(VENV)/bin/tessera explain $(RUN_DIR)/state/resourceclaims/sample-gpu.yaml \
		--class deploy/daemonset/deviceclasses.yaml --simulate $(MODEL) --state-dir $(RUN_DIR)/state \
		--write
	@echo "Tessera on a simulated $(MODEL) node; state, simulator and sysfs tree under $(RUN_DIR)/state"
	@echo "Try it from another terminal:"
	@echo "  curl http://$(METRICS)/metrics ; curl http://$(METRICS)/readyz"
	@echo "  $(VENV)/bin/tessera top --state-dir $(RUN_DIR)/state"
	@echo "  $(VENV)/bin/tessera discover --simulate $(MODEL) --state-dir $(RUN_DIR)/state"
	@echo "  $(VENV)/bin/tessera topo --simulate $(MODEL) --state-dir $(RUN_DIR)/state"
	@echo "  ls $(RUN_DIR)/state/resourceslices/"
	@echo "  $(VENV)/bin/tessera kubelet info --socket $(RUN_DIR)/state/kubelet/plugins_registry/gpu.tessera.dev-reg.sock"
	@echo "  $(VENV)/bin/tessera kubelet prepare --socket $(RUN_DIR)/state/kubelet/plugins/gpu.tessera.dev/dra.sock \\"
	@echo "      --claim default/sample-gpu/$(SAMPLE_UID)    # then: cat $(RUN_DIR)/state/cdi/*.json"
	@echo "Ctrl-C stops it."
	$(VENV)/bin/tessera run --simulate $(MODEL) --state-dir $(RUN_DIR)/state --no-kube \
		--metrics-address $(METRICS) --log-format text

lint: $(STAMP)
	$(VENV)/bin/ruff check agent dra_driver tests bench
	$(VENV)/bin/ruff format --check agent dra_driver tests bench
	$(VENV)/bin/lint-imports

typecheck: $(STAMP)
	$(VENV)/bin/mypy

# Tests run in a random order (pytest-randomly) on one worker more than there are cores
# (pytest-xdist: about a quarter of the summed test time is waiting, on daemons' ticks, timeouts
# and exits, which a third worker fills on a 2-core machine: 291 s -> 238 s; worksteal: a worker
# that runs out takes tests queued for another, so a few long tests at the end do not leave a
# core idle); `make test SEED=N` repeats one order, `make test WORKERS=N` sets the workers.
# Temporary files go to a tmpfs of the session's own (tests/tmproot.py).
# Bytecode is cached (PYTHONDONTWRITEBYTECODE unset for the run, __pycache__ is ignored by git):
# the tests start hundreds of Python processes (daemons, CLIs, the simulated tools) that would
# each compile the agent again.
WORKERS ?= $(shell echo $$(( $$(nproc) + 1 )))
ifeq ($(SEED),)
SEED := $(shell od -An -N4 -tu4 /dev/urandom | tr -d ' ')
endif
unit: $(STAMP)
	@.ci/promtool $(VENV)/bin
	@echo "test order: random, seed $(SEED) (repeat it with: make test SEED=$(SEED))"
	PYTHONDONTWRITEBYTECODE= $(PY) -m pytest -q -m "not reliability" -p randomly \
		--randomly-seed=$(SEED) -n $(WORKERS) --dist worksteal

test: lint typecheck unit

# The long suites (crash injection, API faults, fuzzing, disk trouble, soak); each records its
# figures (tests/reliability/report.py) and the run ends with one table of them.
RELIABILITY_RESULTS := bench/results/reliability
reliability: $(STAMP)
	@rm -rf $(RELIABILITY_RESULTS)
	@echo "test order: random, seed $(SEED) (repeat it with: make reliability SEED=$(SEED))"
	$(PY) -m pytest -q -m reliability -p randomly --randomly-seed=$(SEED) -n 2
	$(PY) -m pytest -q tests/test_fuzz_decoders.py tests/dra_driver/test_explain_no_traceback.py --hypothesis-profile=reliability -p no:randomly
	$(PY) -m tests.reliability.summary

# One table of every benchmark's figures (docs/performance.md); QUICK=1: fewer repeats, a look.
bench: $(STAMP)
	$(PY) -m bench $(if $(QUICK),--quick)

# On a GPU node: the real GPUs against the simulator's model of them, reading only (exit 0 same,
# 1 different, 2 cannot run; docs/troubleshooting.md). Without a GPU: ARGS='--simulate dgx-h100'.
# More: ARGS='-o json --save .run/gpu-check'. With no venv it runs the offline bundle when there
# is one (make gpu-bundle, copied to the GPU machine); make exits 2 on any failure, so the
# check's own code is the last line and $(RUN_DIR)/gpu-check.exit (bench/gpu_check/make_gpu_check.sh).
GPU_BUNDLE ?= build/gpu-bundle
gpu-check:
	@VENV='$(VENV)' PY='$(PY)' STAMP='$(STAMP)' GPU_BUNDLE='$(GPU_BUNDLE)' RUN_DIR='$(RUN_DIR)' \
		bench/gpu_check/make_gpu_check.sh $(ARGS)

# gpu-check for a GPU machine with no package index and about 64 MiB of room: at most 50 MiB,
# pure Python, with its launcher (bench/gpu_check/bundle.py); copy it to build/gpu-bundle there.
gpu-bundle: $(STAMP)
	$(PY) -m bench.gpu_check.bundle --out $(GPU_BUNDLE)

clean:
	rm -rf $(VENV) $(RUN_DIR) .mypy_cache .pytest_cache .ruff_cache

docs: $(STAMP)
	$(PY) -m agent.cli.docs > docs/configuration.md.tmp && mv docs/configuration.md.tmp docs/configuration.md

# Generated gRPC modules live in the package that uses them; a test fails when they are stale.
PROTO_GEN := $(PY) -m grpc_tools.protoc -Idra_driver/kubeletapi=proto/kubelet \
	--python_out=. --grpc_python_out=. --pyi_out=.
proto: $(STAMP)
	$(PROTO_GEN) $(patsubst proto/kubelet/%,dra_driver/kubeletapi/%,$(wildcard proto/kubelet/*.proto))
	$(PY) -m grpc_tools.protoc -Iagent/telemetry/api=proto/telemetry \
		--python_out=. --grpc_python_out=. --pyi_out=. agent/telemetry/api/telemetry.proto
