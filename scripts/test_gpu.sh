#!/usr/bin/env bash
# `make test-gpu`: check a GPU machine. First the tests marked `device` (those taking the `device` fixture) run
# on CUDA against their CPU float64 references, then `flexmoe bench --suite --device cuda` measures every suite
# target there (few steps: about six minutes in all on one H100). Without a CUDA device it prints one line saying
# so and exits 0.
#
#   scripts/test_gpu.sh [RESULTS_DIR]    (default: gpu-results)
#
# RESULTS_DIR receives machine.txt (the card, driver and torch), tests.txt and tests.xml (pytest's log and JUnit
# report) and bench_suite.txt (the suite's table). PYTHON names the interpreter (default: .venv/bin/python, or
# python3 where there is no .venv, e.g. a machine where `make setup` cannot reach a registry); it needs torch and
# pytest, and uses pytest-xdist when present. Exit status: pytest's when a test failed, else the bench's.
set -u
cd "$(dirname "$0")/.."
results="${1:-gpu-results}"
python="${PYTHON:-.venv/bin/python}"
if [ -z "${PYTHON:-}" ] && [ ! -x "$python" ]; then
    python=python3
fi
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}"

if ! gpus=$("$python" -c 'import torch; print(torch.cuda.device_count() if torch.cuda.is_available() else 0)'); then
    echo "test-gpu: $python cannot import torch (set PYTHON to an interpreter that has torch and pytest)" >&2
    exit 2
fi
if [ "$gpus" = 0 ]; then
    echo "test-gpu: skipped: no CUDA device here (torch.cuda.is_available() is False for $python)"
    exit 0
fi

mkdir -p "$results"
"$python" - <<'PY' | tee "$results/machine.txt"
import torch

names = ", ".join(torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count()))
free, total = torch.cuda.mem_get_info()
print(f"test-gpu: {torch.cuda.device_count()} CUDA device(s): {names}; torch {torch.__version__}, "
      f"CUDA {torch.version.cuda}, {total / 2**30:.0f} GiB on device 0")
PY

workers=()
if "$python" -c 'import xdist' 2>/dev/null; then
    workers=(-n 8)  # the compile cases are CPU-bound (inductor); eight processes share the one GPU well
fi
# --maxfail 25: one run reports every failure a GPU shows, not the first only. --test-timeout: a hung kernel stops its test's process with a traceback instead of hanging the run.
timeout 180 "$python" -m pytest -q -m device --device cuda --maxfail 25 --test-timeout 120 ${workers[@]+"${workers[@]}"} \
    -p no:cacheprovider --junitxml="$results/tests.xml" 2>&1 | tee "$results/tests.txt"
tests_rc=${PIPESTATUS[0]}

# The suite with few steps per case (medians of 3 timed steps after 1 untimed one), all checks in one process:
# a fresh process per check (the CPU default, against glibc's heap state) would cost a CUDA start each.
timeout 240 "$python" -m flexmoe bench --suite --suite-one-process --device cuda --steps 3 --warmup 1 2>&1 \
    | tee "$results/bench_suite.txt"
bench_rc=${PIPESTATUS[0]}

echo "test-gpu: tests exit $tests_rc, bench suite exit $bench_rc; logs in $results/"
if [ "$tests_rc" -ne 0 ]; then
    exit "$tests_rc"
fi
exit "$bench_rc"
