#!/usr/bin/env bash
# `make test-gpu`: check a GPU machine in one call of at most --budget seconds (default 480: 8 minutes on one
# H100 / H200 with 16 cores). Two steps:
#  1. the tests marked `device` (those taking the `device` fixture) on CUDA against their CPU float64 references,
#     in one pytest run. Among them the parts of issue 41, each reported on its own (scripts/gpu_parts.py):
#     the layer's calls under torch.cuda.set_sync_debug_mode("error") (tests/test_gpu_sync.py), the CUDA-graph
#     captures (tests/test_cuda_graphs.py), two ranks on the one GPU over gloo against one process, and one rank on
#     NCCL (world size 1);
#  2. `flexmoe bench --suite --device cuda` in the time left, its groups in the order below (few steps per case;
#     a group that the budget cuts off is named in the log; the expert-parallel group runs on CPU ranks only).
#
#   scripts/test_gpu.sh [--dry-run] [--budget SECONDS] [RESULTS_DIR]    (default RESULTS_DIR: gpu-results)
#
# RESULTS_DIR receives machine.txt (the card, driver and torch), tests.txt and tests.xml (pytest's log and JUnit
# report), parts.txt (each part's verdict) and bench_suite.txt (the suite's rows as measured, then its table).
# Without a CUDA device it prints one line saying so and exits 0. --dry-run needs no GPU: it checks that every
# part's tests are collected and the bench groups exist, prints the commands with their time limits, and runs
# none of them. PYTHON names the interpreter (default: .venv/bin/python, or python3 where there is no .venv, e.g.
# a machine where `make setup` cannot reach a registry); it needs torch and pytest, and uses pytest-xdist when
# present. Exit status: pytest's when a test failed, else 1 when a part did not pass, else the bench's (124 when
# the budget cut it off).
set -u
cd "$(dirname "$0")/.."

dry_run=0
budget=480
results=gpu-results
while [ $# -gt 0 ]; do
    case "$1" in
        --dry-run) dry_run=1 ;;
        --budget)
            if [ $# -lt 2 ] || ! [[ "$2" =~ ^[0-9]+$ ]] || [ "$2" -lt 240 ]; then
                echo "test-gpu: --budget takes a whole number of seconds, at least 240 (got '${2:-}')" >&2
                exit 2
            fi
            budget=$2
            shift ;;
        -*) echo "test-gpu: unknown option $1 (expected --dry-run, --budget SECONDS, RESULTS_DIR)" >&2; exit 2 ;;
        *) results=$1 ;;
    esac
    shift
done

python="${PYTHON:-.venv/bin/python}"
if [ -z "${PYTHON:-}" ] && [ ! -x "$python" ]; then
    python=python3
fi
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}"

# Step 1 may take half the budget, step 2 takes what is left (a margin kept for the summary).
tests_limit=$(( budget / 2 ))
margin=15
bench_groups=layer,hf,decode-hf,decode,fine-grained,compile

workers=()
if "$python" -c 'import xdist' 2>/dev/null; then
    workers=(-n 8)  # the compile cases are CPU-bound (inductor); eight processes share the one GPU well
fi
# --maxfail 25: one run reports every failure a GPU shows, not the first only. --test-timeout: a hung kernel stops
# its test's process with a traceback instead of hanging the run.
tests_cmd=("$python" -m pytest -q -m device --device cuda --maxfail 25 --test-timeout 150
           ${workers[@]+"${workers[@]}"} -p no:cacheprovider --junitxml="$results/tests.xml")
# The suite with few steps per case (medians of 3 timed steps after 1 untimed one), all checks in one process: a
# fresh process per check (the CPU default, against glibc's heap state) would cost a CUDA start each. Each row is
# printed as it is measured, so the rows a cut-off run measured stay in the log.
bench_cmd=("$python" -m flexmoe bench --suite --suite-one-process --suite-groups "$bench_groups" --device cuda
           --steps 3 --warmup 1)

if [ "$dry_run" = 1 ]; then
    echo "test-gpu --dry-run: budget ${budget}s, results in $results/"
    echo "1. device tests (at most ${tests_limit}s): ${tests_cmd[*]}"
    echo "   parts of issue 41 among them:"
    "$python" scripts/gpu_parts.py check || exit 1
    echo "2. bench (the time left, at least $(( budget - tests_limit - margin ))s): ${bench_cmd[*]}"
    "$python" -c "
import sys
from flexmoe.apps.bench.suite import SUITE_GROUPS
unknown = [g for g in sys.argv[1].split(',') if g not in SUITE_GROUPS]
sys.exit(f'test-gpu: unknown bench group(s) {unknown}; the suite has {list(SUITE_GROUPS)}' if unknown else 0)
" "$bench_groups" || exit 1
    echo "test-gpu --dry-run: every part is collected and every bench group exists; nothing was run"
    exit 0
fi

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

timeout "$tests_limit" "${tests_cmd[@]}" 2>&1 | tee "$results/tests.txt"
tests_rc=${PIPESTATUS[0]}
if [ -f "$results/tests.xml" ]; then
    "$python" scripts/gpu_parts.py report "$results/tests.xml" | tee "$results/parts.txt"
    parts_rc=${PIPESTATUS[0]}
else
    echo "test-gpu: no JUnit report (the tests ran out of their ${tests_limit}s?)" | tee "$results/parts.txt"
    parts_rc=1
fi

bench_limit=$(( budget - SECONDS - margin ))
if [ "$bench_limit" -lt 30 ]; then
    echo "test-gpu: bench skipped: ${bench_limit}s left of the ${budget}s budget" | tee "$results/bench_suite.txt"
    bench_rc=124
else
    timeout "$bench_limit" "${bench_cmd[@]}" 2>&1 | tee "$results/bench_suite.txt"
    bench_rc=${PIPESTATUS[0]}
    if [ "$bench_rc" = 124 ]; then
        echo "test-gpu: the bench ran out of its ${bench_limit}s; the rows above were measured" \
            | tee -a "$results/bench_suite.txt"
    fi
fi

echo "test-gpu: tests exit $tests_rc, parts exit $parts_rc, bench suite exit $bench_rc, ${SECONDS}s of ${budget}s;" \
     "logs in $results/"
if [ "$tests_rc" -ne 0 ]; then
    exit "$tests_rc"
fi
if [ "$parts_rc" -ne 0 ]; then
    exit 1
fi
exit "$bench_rc"
