# Nereus: `make demo` runs the service with a real job; `make test` runs every test.
SHELL := /bin/bash
PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
# The PyTorch build to install. The default is the CPU build these machines carry; a GPU machine
# sets TORCH_REQ='torch>=2.6,<2.14' (PyPI's Linux wheels are CUDA builds) or a ROCm index.
TORCH_REQ ?= torch==2.13.0
TORCH_PIP_ARGS ?=

.PHONY: install browser kernels demo test lint format doctor clean

$(STAMP): pyproject.toml
	@$(PYTHON) -c 'import sys; sys.exit(sys.version_info < (3, 11))' \
		|| { echo "Nereus needs Python 3.11 or newer (found $$($(PYTHON) --version))"; exit 1; }
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --disable-pip-version-check $(TORCH_PIP_ARGS) '$(TORCH_REQ)'
	$(BIN)/pip install --quiet --disable-pip-version-check -e '.[dev]'
	touch $@

# The compiled kernels follow their sources: a library built from other sources is stale (not
# loaded), so a change under csrc/ rebuilds it before the tests or the demo run.
KERNEL_SOURCES := $(shell find csrc -name '*.h' -o -name '*.cuh' -o -name '*.cpp' -o -name '*.cu')
KERNEL_STAMP := build/kernels/.built

$(KERNEL_STAMP): $(STAMP) $(KERNEL_SOURCES) runtime/kernels/build.py
	$(BIN)/python -m runtime.kernels.build || echo "kernels: using the pure-PyTorch fallback"
	@mkdir -p $(dir $@) && touch $@

kernels: install
	$(BIN)/python -m runtime.kernels.build --verbose

install: $(STAMP) $(KERNEL_STAMP)

# The browser end-to-end test drives Debian's chromium (headless); install it when missing.
browser:
	@command -v chromium >/dev/null 2>&1 || { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium; }

demo: install
	$(BIN)/nereus demo

doctor: install
	$(BIN)/nereus doctor

lint: install
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

format: install
	$(BIN)/ruff check --fix .
	$(BIN)/ruff format .

test: install browser lint
	$(BIN)/pytest $(PYTEST_ARGS)

clean:
	rm -rf $(VENV) var build .pytest_cache .ruff_cache
