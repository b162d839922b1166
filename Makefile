# Set-up and the two entry points of README.md. Works on a fresh Debian/Ubuntu machine with python3.
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
# Where no torch is installed, this one is: on CPU machines the CPU build (a local wheel here);
# on GPU machines pip's default CUDA build. Override: make setup TORCH='torch==2.13.0+cu128 ...'
TORCH  ?= torch==2.13.0
SUDO   := $(shell [ "$$(id -u)" = 0 ] || echo sudo)
DATA_PACKAGES := bible-kjv dataset-fashion-mnist
PYTEST_ARGS ?=

.PHONY: setup data-packages mlflow-server quickstart test bench clean

setup: $(VENV)/.installed data-packages

$(VENV)/.installed: pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -c "import torch" 2>/dev/null || $(BIN)/python -m pip install -q "$(TORCH)"
	$(BIN)/python -m pip install -q -e '.[dev]'
	touch $@

# The real data sets the CPU experiments train on (public domain / MIT), from Debian's archive.
data-packages:
	@if ! command -v bible >/dev/null || [ ! -f /usr/share/datasets/fashion-mnist/train-images-idx3-ubyte.gz ]; then \
		echo "installing Debian packages $(DATA_PACKAGES)"; \
		$(SUDO) apt-get update -qq && $(SUDO) apt-get install -y -qq $(DATA_PACKAGES) >/dev/null; \
	fi

# The MLflow tracking server the tracking tests log to, in an environment of its own (the server's
# package holds pyarrow below 26; the project's environment has only MLflow's client).
mlflow-server: .mlflow-server/.installed

.mlflow-server/.installed:
	test -x .mlflow-server/bin/python || $(PYTHON) -m venv .mlflow-server
	.mlflow-server/bin/python -m pip install -q "mlflow>=3"
	touch $@

quickstart: setup
	$(BIN)/raytrain-par run experiments/quickstart.yaml

test: setup mlflow-server
	$(BIN)/python -m pytest -q $(PYTEST_ARGS)

bench: setup
	$(BIN)/python benchmarks/overhead.py

clean:
	rm -rf $(VENV) .mlflow-server results .pytest_cache
