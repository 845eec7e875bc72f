# Everything a fresh machine needs: `make train` (the main job) and `make test` (the tests).
# Both build .venv first: torch 2.13.0 (any torch>=2.3 works for the package itself) and flexmoe.
# PyPI's torch on Linux is the CUDA build; TORCH_INDEX=https://download.pytorch.org/whl/cpu gives the CPU-only one
# (or .../whl/cu126 a given CUDA), TORCH_SPEC another version. They apply when .venv is built (rm -r .venv first).
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
TORCH_SPEC ?= torch==2.13.0
TORCH_INDEX ?=

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet "$(TORCH_SPEC)" $(if $(TORCH_INDEX),--index-url $(TORCH_INDEX))
	$(PY) -m pip install --quiet -e ".[train,test]"
	touch $@

.PHONY: setup train bench test test-slow test-gpu mutate
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
