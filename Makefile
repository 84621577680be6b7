# splash — two commands: `make demo` and `make test`.
PY      ?= python3.11
VENV    := .venv
BIN     := $(VENV)/bin
STAMP   := $(VENV)/.installed

.PHONY: setup demo test lint clean

setup: $(STAMP)

$(STAMP): pyproject.toml
	@test -x $(BIN)/python || $(PY) -m venv $(VENV)
	@$(BIN)/python -m pip install -q --upgrade pip >/dev/null 2>&1 || true
	@# torch first, from the CPU wheel on disk: never let pip resolve a CUDA build.
	@$(BIN)/python -c "import torch" 2>/dev/null || $(BIN)/python -m pip install -q "torch==2.13.0"
	$(BIN)/python -m pip install -q -e ".[dev]"
	@touch $(STAMP)

demo: setup
	$(BIN)/python -m splash.demo

test: setup
	$(BIN)/python -m pytest -q -ra

lint: setup
	$(BIN)/ruff check splash tests

clean:
	rm -rf $(VENV) out build *.egg-info
