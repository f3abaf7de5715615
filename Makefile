# Developer entry points. `make test` is what CI runs (see .ci/run and the README).
PYTHON ?= python3
VENV ?= .venv
PIP := $(VENV)/bin/pip
PY := $(VENV)/bin/python
# torch is pinned in constraints.txt. Without an NVIDIA driver we want the CPU build: unless pip
# already has a local wheel source (PIP_FIND_LINKS), add PyTorch's CPU index, whose "+cpu" build
# sorts above PyPI's CUDA build of the same version.
TORCH_SPEC ?= torch==2.13.0
ifeq ($(shell command -v nvidia-smi 2>/dev/null),)
ifeq ($(PIP_FIND_LINKS),)
TORCH_INDEX ?= --extra-index-url https://download.pytorch.org/whl/cpu
endif
# The GPU kernels (Triton) are tested under Triton's interpreter here. PyTorch's CUDA builds bring
# their own pinned Triton, so it is pinned here, for CPU machines only, not in constraints.txt.
CPU_EXTRAS ?= triton==3.8.0
endif

.PHONY: venv test test-cluster test-clients gpu-rehearsal gpu-wheels lint fmt serve proto clean

# The native kernels build at install: edits to them reinstall (editable install, built in place).
$(VENV)/.installed: pyproject.toml constraints.txt setup.py $(wildcard engine/kernels/cpu/*.cpp engine/kernels/cpu/*.h)
	$(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q -c constraints.txt $(TORCH_INDEX) "$(TORCH_SPEC)"
	$(PIP) install -q -c constraints.txt -e ".[test]" $(CPU_EXTRAS)
	touch $@

venv: $(VENV)/.installed

test: venv
	$(VENV)/bin/ruff check .
	$(PY) -m pytest -q $(PYTEST_ARGS)

# The multi-node tests: a two-node Ray cluster on 127.0.0.2, the deploy scripts, jobs (a few minutes).
test-cluster: venv
	$(PY) -m pytest -q -m multinode $(PYTEST_ARGS)

# The real agents against hearth serve: Claude Code and OpenCode from npm (needs node; minutes).
test-clients: venv
	$(PY) -m pytest -q -m clients -s $(PYTEST_ARGS)

# The GPU contact check rehearsed on the CPU in an environment like the GPU machine's (torch 2.11,
# transformers 5.17, no hearth install, wheels from .whl/ only): bench/gpu_contact.sh cannot rot.
gpu-rehearsal:
	bash tools/gpu_rehearsal.sh

# The wheels the GPU machine lacks, into .whl/ (carried with the tree to a machine with no index).
gpu-wheels:
	bash tools/gpu_wheels.sh

# Serve the demo model (or MODEL=DIR) on http://127.0.0.1:8000 (OpenAI /v1, Anthropic) and gRPC :50051.
serve: venv
	$(VENV)/bin/hearth serve $(if $(MODEL),--model $(MODEL)) $(SERVE_ARGS)

# Regenerate the gRPC modules from proto/hearth.proto (tests fail when they are stale).
proto: venv
	$(PY) tools/gen_proto.py

lint: venv
	$(VENV)/bin/ruff check .

fmt: venv
	$(VENV)/bin/ruff format .

clean:
	rm -rf $(VENV) .venv-gpu .whl .pytest_cache .ruff_cache
