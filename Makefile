# Developer entry points. `make test` is what CI runs (see .ci/run and the README).
PYTHON ?= python3
VENV ?= .venv
PIP := $(VENV)/bin/pip
PY := $(VENV)/bin/python
# torch is pinned in constraints.txt; on a machine without CUDA this resolves to the CPU build
# when a local wheel or a CPU index is configured for pip.
TORCH_SPEC ?= torch==2.13.0

.PHONY: venv test lint fmt bench clean

$(VENV)/.installed: pyproject.toml constraints.txt
	$(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q -c constraints.txt "$(TORCH_SPEC)"
	$(PIP) install -q -c constraints.txt -e ".[test]"
	touch $@

venv: $(VENV)/.installed

test: venv
	$(VENV)/bin/ruff check .
	$(PY) -m pytest -q $(PYTEST_ARGS)

lint: venv
	$(VENV)/bin/ruff check .

fmt: venv
	$(VENV)/bin/ruff format .

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache
