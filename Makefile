# Everything a fresh machine needs: `make train` (the main job) and `make test` (the tests).
# Both build .venv first, with every package at its version in requirements.lock (pip constraints: torch 2.13.0
# included, whose CPU or CUDA build is whichever pip finds; the package itself asks torch>=2.13).
# `make lock` rewrites the lock from the newest releases that pyproject.toml's ranges admit (torch at LOCK_TORCH).
# PyPI's torch on Linux is the CUDA build; TORCH_INDEX=https://download.pytorch.org/whl/cpu gives the CPU-only one
# (or .../whl/cu126 a given CUDA), TORCH_SPEC another release than the lock's (then torch alone is unlocked).
# They apply when .venv is built (rm -r .venv first).
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
LOCK := requirements.lock
TORCH_SPEC ?=
TORCH_INDEX ?=
LOCK_TORCH ?= torch==2.13.0
# make test-latest and make test-oldest ask the registry itself: PIP_CONFIG_FILE=/dev/null leaves out any
# site-wide pip configuration (a constraints file there would hold the newest releases back unseen).
FRESH_PIP := PIP_CONFIG_FILE=/dev/null
# The oldest Python the package declares (requires-python), where this machine has one.
OLDEST_PYTHON ?= $(firstword $(shell command -v python3.11) $(PYTHON))

# Built from scratch whenever the lock or the package's metadata changes, so that nothing outside the lock lingers.
$(VENV)/.installed: pyproject.toml $(LOCK)
	rm -rf $(VENV)
	$(PYTHON) -m venv $(VENV)
	$(if $(TORCH_SPEC),grep -v '^torch==' $(LOCK),cat $(LOCK)) > $(VENV)/constraints.txt
	$(PY) -m pip install --quiet -c $(VENV)/constraints.txt pip setuptools wheel
	$(PY) -m pip install --quiet -c $(VENV)/constraints.txt "$(or $(TORCH_SPEC),torch)" $(if $(TORCH_INDEX),--index-url $(TORCH_INDEX))
	$(PY) -m pip install --quiet -c $(VENV)/constraints.txt --no-build-isolation -e ".[train,test]"
	$(if $(TORCH_SPEC),,$(PY) scripts/lock.py check $(PY) $(LOCK))
	touch $@

.PHONY: setup train bench test test-slow test-gpu mutate lock test-latest test-oldest
setup: $(VENV)/.installed

# The main job: train the MoE GPT on the embedded tiny Shakespeare (about 3.5 minutes on 2 cores) into runs/default.
# --resume: a second `make train` continues (or, once finished, keeps) that run instead of refusing to touch it.
train: setup
	$(VENV)/bin/flexmoe train --out runs/default --resume

bench: setup
	$(VENV)/bin/flexmoe bench

test: setup
	$(PY) -m pytest -q -n auto

test-slow: setup
	$(PY) -m pytest -q -n auto -m slow

# Each mutant of scripts/mutants.json (a plausible one-line bug) applied to a copy of the tree, its covering tests
# run there: it must be killed. Ends with "N killed, M survived"; exit 1 if any survived or no longer applies.
mutate: setup
	$(PY) scripts/mutate.py

# A GPU machine, within 8 minutes: the device-parametrised tests on CUDA (issue 41's parts reported each in
# parts.txt), then `flexmoe bench --suite --device cuda` in the time left; one line and exit 0 without a GPU. No setup step (it runs where `make setup` cannot reach a registry): PYTHON=... names the
# interpreter (default .venv/bin/python, else python3). Logs go to RESULTS (default gpu-results).
RESULTS ?= gpu-results
test-gpu:
	scripts/test_gpu.sh $(RESULTS)

# Rewrites requirements.lock: a scratch environment with the newest releases that pyproject.toml's ranges admit
# (torch at LOCK_TORCH), frozen. Run `make test` after it (it rebuilds .venv from the new lock) before committing.
lock:
	rm -rf .venv-lock
	$(PYTHON) -m venv .venv-lock
	.venv-lock/bin/python -m pip install --quiet --upgrade pip setuptools wheel
	.venv-lock/bin/python -m pip install --quiet "$(LOCK_TORCH)"
	.venv-lock/bin/python -m pip install --quiet -e ".[train,test]"
	$(PYTHON) scripts/lock.py write .venv-lock/bin/python > $(LOCK)
	rm -rf .venv-lock
	@echo "$(LOCK) rewritten; git diff $(LOCK) shows what moved"

# The suite on the newest release of every dependency, torch included (the lock and any site-wide pip constraint
# left out): what a user who installs today gets. Its own environment, .venv-latest; .venv is not touched.
test-latest:
	rm -rf .venv-latest
	$(PYTHON) -m venv .venv-latest
	$(FRESH_PIP) .venv-latest/bin/python -m pip install --quiet --upgrade pip setuptools wheel
	$(FRESH_PIP) .venv-latest/bin/python -m pip install --quiet --upgrade -e ".[train,test]"
	.venv-latest/bin/python -m pip list --format=freeze | grep -i -E '^(torch|transformers|peft|safetensors|numpy)=='
	.venv-latest/bin/python -m pytest -q -n auto

# The suite at the lowest version of every declared dependency (scripts/lock.py oldest) on the oldest Python
# declared (3.11), where this machine has it: the ranges in pyproject.toml are true. Its own environment, .venv-oldest.
test-oldest:
	rm -rf .venv-oldest
	$(OLDEST_PYTHON) -m venv .venv-oldest
	$(PYTHON) scripts/lock.py oldest pyproject.toml > .venv-oldest/oldest.txt
	$(FRESH_PIP) .venv-oldest/bin/python -m pip install --quiet --upgrade pip setuptools wheel
	$(FRESH_PIP) .venv-oldest/bin/python -m pip install --quiet -c .venv-oldest/oldest.txt -e ".[train,test]"
	.venv-oldest/bin/python --version
	.venv-oldest/bin/python -m pip list --format=freeze | grep -i -E '^(torch|transformers|peft|safetensors|numpy)=='
	.venv-oldest/bin/python -m pytest -q -n auto
