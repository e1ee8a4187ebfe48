#!/usr/bin/env bash
# GPU check of cudarecv on a lent machine, in one prepared run of at most BUDGET seconds (default 420: a
# lent machine gives about 15 minutes, its start included, so one run and room to rerun it). Every step is
# bounded with `timeout` (which signals the step's whole process group, ranks included) by the smaller of
# its own limit and what is left of BUDGET; a step with under 5 s left is skipped and counted as failed. A
# failed step does not stop the next ones, but the script then exits 1. In order:
#    1. nvidia-smi;
#    2. wheels:  the carried wheels (gpu-wheels/) and cudarecv itself, built from this checkout with its
#       native host copies, installed with --no-deps --target into $SITE (the image's torch stays); the
#       tests import that copy, never the checkout's (PYTHONSAFEPATH; pytest imports it first, as its
#       plugin given with -p, before the checkout's conftest.py puts the checkout on sys.path);
#    3. versions: python, torch, CUDA, cupy, NVRTC, tensordict, pytest plugins, cudarecv; NCCL twice: the
#       library loaded (ncclGetVersion through ctypes, cudarecv.testing.gpu.nccl_runtime_version) and the one
#       torch was built with (torch.cuda.nccl.version()); how nccl_ranks runs 2 and 3 ranks here;
#    4. former-failures: the 18 tests that failed on the H200 on 2026-12-04 (docs/gpu.md), named first
#       (FORMER below: the failed cases' tests, a superset where the record names no case);
#    5. nccl-self: one process, an NCCL group of world 1, then a batch of a send to itself and a receive
#       from itself (bench/nccl_smoke.py self; NCCL's INIT/NET log in nccl-self.<pid>.log);
#    6. nccl-pair: two processes on GPU 0, torch only, each its own NCCL_HOSTID, NCCL's socket transport on
#       loopback (bench/nccl_smoke.py pair): send/recv, batch_isend_irecv, all_reduce, bounded; with
#       NCCL_DEBUG=INFO NCCL_DEBUG_SUBSYS=INIT,NET: each rank's log in nccl-pair-rank<r>.log, their NCCL
#       lines in nccl-pair-init-net.log;
#    7. nccl-tests: pytest --gpus N tests/test_gpu*.py -k nccl (cudarecv.testing.gpu.nccl_ranks: on one GPU
#       with NCCL < 2.30, the NCCL_HOSTID mode of step 6), with NCCL_DEBUG=WARN; --maxfail 2 where step 6
#       failed (then torch alone could not run two NCCL ranks here);
#    8. gpu-tests: the rest of tests/test_gpu*.py, tests/test_tags.py, tests/test_digest.py (-k "not nccl",
#       the former failures deselected);
#    9. gpu-benches: bench/bench_gpu.py -k "$BENCH_K" --benchmark-json gpu-bench.json (default: the NCCL
#       benches left out where the ranks would share a GPU: their times would be loopback sockets'); where
#       vLLM is installed, bench/bench_vllm.py -k gpu; then python -m cudarecv report;
#   10. cpu-tests, only where CPU_TESTS names them (CI runs the CPU suite).
# Each pytest step writes $OUT/<step>.xml (JUnit) and prints its 30 slowest tests. Results, all under OUT:
# gpu-check.log, former-failures.xml, nccl-self.*.log, nccl-pair-rank*.log, nccl-pair-init-net.log,
# nccl-tests.xml, gpu-tests.xml, gpu-benches.xml, gpu-bench.json, gpu-report.txt, gpu-report.png.
# Without a GPU every step still runs (quickly): the pytest steps with --gpus 0 (all skipped, their xml
# written) and every GPU step counted as failed.
#
# The lent machine's image (Python 3.12, torch 2.11+cu130, NCCL 2.28.9, cupy-cuda13x, pytest-benchmark) has
# no tensordict, pyvers or blake3 and cannot download: fill gpu-wheels/ here first with
# `bash bench/gpu_wheels.sh`, and carry gpu-wheels/ with the call (it is git-ignored).
#
# Usage (from anywhere):  bash bench/gpu_check.sh [OUT]     (bash bench/gpu_check.sh --former: step 4's test ids)
#   OUT               results folder (default: $OUT, else ./gpu-results)
#   PYTHON=...        the interpreter (default: python3)
#   WHEELS=...        the carried wheels (default: gpu-wheels); SITE=... where they go (/tmp/cudarecv-site)
#   BUDGET=...        seconds the whole check may take (default 420)
#   GPUS=N            --gpus for pytest (default: 2 if torch sees 2 GPUs or more, 1 with one, 0 with none)
#   BENCH_K=...       pytest -k of step 9 (default: "not nccl" where NCCL ranks would share a GPU, else all)
#   CPU_TESTS=...     CPU tests run last with what is left of BUDGET (default: none)
#   CUDARECV_NCCL_MODE=per_gpu|multi_rank|hostid   forces how nccl_ranks runs NCCL ranks (cudarecv.testing.gpu)
set -uo pipefail

cd "$(dirname "$0")/.." || exit 2

# the tests that failed on the H200 on 2026-12-04 (docs/gpu.md, "What has run on a GPU"): 12 consolidated and
# chunks cases of the gloo roundtrip (all 20 listed: the record does not say which 12), the pending-receive
# cases (cuBLAS not warmed up), CUDA IPC weight sync's memory, Transfer.done() after wait() (the irecv future
# cases) and CUDA IPC for a fast-wire link first used with host memory
FORMER=()
for c in consolidated-stock_cpu-to-cudarecv_cuda consolidated-cudarecv_cuda-to-stock_cpu \
    consolidated-cudarecv_cuda-to-cudarecv_cuda consolidated-stock_cpu-to-cudarecv_pinned \
    consolidated-cudarecv_cuda-to-cudarecv_pinned chunks-64-cudarecv_cuda-to-cudarecv_cuda \
    chunks-262144-cudarecv_cuda-to-cudarecv_cuda chunks-262144-cudarecv_cpu-to-cudarecv_cuda \
    chunks-262144-cudarecv_cuda-to-cudarecv_pinned chunks-262144-cudarecv_pinned-to-cudarecv_cuda; do
    for b in blocking async; do
        FORMER+=("tests/test_gpu.py::test_gloo_cuda_roundtrip[$c-$b]")
    done
done
FORMER+=(
    "tests/test_gpu.py::test_pending_receive_does_not_block_the_current_stream[consolidated]"
    "tests/test_gpu.py::test_pending_receive_does_not_block_the_current_stream[chunks]"
    "tests/test_gpu.py::test_cuda_ipc_weight_sync_exact_and_memory_flat[one_gpu_two_processes]"
    "tests/test_gpu.py::test_irecv_future_orders_the_current_stream[per-leaf]"
    "tests/test_gpu.py::test_irecv_future_orders_the_current_stream[consolidated]"
    "tests/test_gpu.py::test_irecv_future_orders_the_current_stream[buckets]"
    "tests/test_gpu.py::test_irecv_future_orders_the_current_stream[chunks]"
    "tests/test_gpu.py::test_cuda_ipc_fast_wire_exact_and_memory_flat[one_gpu_two_processes-chunks]"
)
DESELECT=()
for id in "${FORMER[@]}"; do
    DESELECT+=(--deselect "$id")
done

if [ "${1:-}" = "--former" ]; then  # the list of step 4, one test id a line (tests/test_gpu_check.py)
    printf '%s\n' "${FORMER[@]}"
    exit 0
fi

OUT="${1:-${OUT:-gpu-results}}"
mkdir -p "$OUT" || exit 2
OUT="$(cd "$OUT" && pwd)"
PY="${PYTHON:-python3}"
WHEELS="${WHEELS:-gpu-wheels}"
SITE="${SITE:-/tmp/cudarecv-site}"
BUDGET="${BUDGET:-420}"
CPU_TESTS="${CPU_TESTS:-}"
export PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONSAFEPATH=1  # no `python -m`/`-c` puts the checkout first on sys.path: the installed copy is tested
export PYTHONUNBUFFERED=1
# cudarecv from $SITE first; every pytest step: its JUnit xml, its 30 slowest tests, failures and skips said
PYTEST=("$PY" -m pytest -p no:cacheprovider -p cudarecv.testing.pytest_plugin -q -rfEs --durations=30)
exec > >(tee -a "$OUT/gpu-check.log") 2>&1

failed=()

# step NAME SECONDS COMMAND...: run COMMAND for at most SECONDS (and what is left of BUDGET); record a
# failure, never stop. RAN: 1 where it ran, 0 where no time was left.
step() {
    local name=$1 limit=$2 start=$SECONDS rc left
    shift 2
    left=$((BUDGET - SECONDS - 10))  # (10: timeout's --kill-after)
    if [ "$left" -lt "$limit" ]; then
        limit=$left
    fi
    RAN=0
    if [ "$limit" -lt 5 ]; then
        echo "=== $name: SKIPPED, $((BUDGET - SECONDS)) s left of the ${BUDGET} s budget" >&2
        failed+=("$name (no time left)")
        return 0
    fi
    RAN=1
    echo "=== $name (at most ${limit} s, at ${SECONDS} s): $*" >&2
    timeout --kill-after=10 "$limit" "$@"
    rc=$?
    if [ "$rc" -eq 124 ] || [ "$rc" -eq 137 ]; then
        echo "=== $name: TIMED OUT after $((SECONDS - start)) s" >&2
    else
        echo "=== $name: exit $rc after $((SECONDS - start)) s" >&2
    fi
    if [ "$rc" -ne 0 ]; then
        failed+=("$name (exit $rc)")
    fi
    return 0
}

# gpu_step NAME SECONDS COMMAND...: a step that needs a GPU: failed where torch sees none, whatever it did
gpu_step() {
    step "$@"
    if [ "$RAN" -eq 1 ] && [ "$NGPU" -lt 1 ]; then
        echo "=== $1: FAILED, torch sees no GPU here (its tests were skipped)" >&2
        failed+=("$1 (no GPU)")
    fi
}

# 1. --------------------------------------------------------------------------------------------------
step nvidia-smi 15 nvidia-smi

# 2. --------------------------------------------------------------------------------------------------
if compgen -G "$WHEELS/*.whl" > /dev/null; then
    step wheels 40 "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target "$SITE" "$WHEELS"/*.whl
else
    echo "$WHEELS/ holds no wheel: run bash bench/gpu_wheels.sh here and carry $WHEELS/ (tensordict is needed)"
    failed+=("wheels (none in $WHEELS/)")
fi
# cudarecv from this checkout, its dependencies left as the image has them (its torch 2.11 meets the floor);
# the native host copies are built with it (a missing compiler leaves memmove: the versions step says which)
step install 45 "$PY" -m pip install -q --no-index --no-deps --no-build-isolation --no-compile --upgrade \
    --target "$SITE" .

# 3. --------------------------------------------------------------------------------------------------
step versions 30 "$PY" - <<'PYEOF'
import importlib.metadata as md, os, platform
import torch
print("python", platform.python_version(), "|", platform.platform())
print("torch", torch.__version__, "| CUDA", torch.version.cuda, "| cuda available", torch.cuda.is_available(),
      "| devices", torch.cuda.device_count())
for i in range(torch.cuda.device_count()):
    print(f"  cuda:{i}", torch.cuda.get_device_name(i))
try:
    print("NCCL torch was built with:", torch.cuda.nccl.version())
except Exception as exc:
    print("NCCL torch was built with: none", repr(exc))
try:
    import cupy
    print("cupy", cupy.__version__, "| CUDA runtime", cupy.cuda.runtime.runtimeGetVersion(),
          "| devices", cupy.cuda.runtime.getDeviceCount())
except Exception as exc:
    print("cupy: unusable", repr(exc))
try:
    from cupy.cuda import nvrtc
    print("NVRTC", nvrtc.getVersion(), "| archs", nvrtc.getSupportedArchs())
except Exception as exc:
    print("NVRTC: unusable", repr(exc))
for name in ("tensordict", "pyvers", "numpy", "blake3", "pytest", "pytest-benchmark", "pytest-timeout",
             "pytest-xdist", "matplotlib", "nvidia-nccl-cu13", "nvidia-nccl-cu12"):
    try:
        print(name, md.version(name))
    except md.PackageNotFoundError:
        print(name, "NOT INSTALLED")
import cudarecv
print("cudarecv", cudarecv.__version__, "from", cudarecv.__file__)
from cudarecv.testing import gpu
print("NCCL loaded (ncclGetVersion):", gpu.nccl_runtime_version(), "| libraries:", gpu.nccl_library_paths())
for world in (2, 3):
    print(f"nccl_ranks({world}): mode", gpu.current_nccl_mode(world), "| problem:", gpu.nccl_ranks_problem(world))
from cudarecv.core import host_copy as _host_copy
print("host copies:", "native" if _host_copy.NATIVE else _host_copy.WHY_NOT_NATIVE)
if not cudarecv.__file__.startswith(os.environ["PYTHONPATH"].split(":")[0]):
    raise SystemExit("cudarecv is not the copy installed in $SITE: the tests would not test it")
PYEOF

# GPUs torch sees, and how nccl_ranks would run two ranks here (for BENCH_K)
read -r NGPU NCCL_MODE < <(timeout 60 "$PY" -c "
import torch
try:
    from cudarecv.testing.gpu import current_nccl_mode
    mode = current_nccl_mode(2)
except Exception:
    mode = 'unknown'
print(torch.cuda.device_count(), mode)" 2>/dev/null || echo "0 unknown")
NGPU="${NGPU:-0}"
NCCL_MODE="${NCCL_MODE:-unknown}"
if [ -z "${GPUS:-}" ]; then
    if [ "$NGPU" -ge 2 ]; then GPUS=2; elif [ "$NGPU" -ge 1 ]; then GPUS=1; else GPUS=0; fi
fi
if [ -z "${BENCH_K+set}" ]; then
    if [ "$NCCL_MODE" = per_gpu ]; then BENCH_K=""; else BENCH_K="not nccl"; fi
fi
echo "GPUs visible to torch: $NGPU | pytest --gpus $GPUS | nccl_ranks(2): $NCCL_MODE | benches: -k '$BENCH_K'"

# 4. --------------------------------------------------------------------------------------------------
gpu_step former-failures 75 "${PYTEST[@]}" --gpus "$GPUS" --timeout 60 \
    --junitxml "$OUT/former-failures.xml" "${FORMER[@]}"

# 5. --------------------------------------------------------------------------------------------------
step nccl-self 30 env NCCL_DEBUG=INFO NCCL_DEBUG_SUBSYS=INIT,NET NCCL_DEBUG_FILE="$OUT/nccl-self.%p.log" \
    "$PY" bench/nccl_smoke.py self --timeout 20

# 6. --------------------------------------------------------------------------------------------------
before=${#failed[@]}
step nccl-pair 75 env NCCL_DEBUG=INFO NCCL_DEBUG_SUBSYS=INIT,NET \
    "$PY" bench/nccl_smoke.py pair --logs "$OUT" --timeout 30
MAXFAIL=()
if [ "${#failed[@]}" -gt "$before" ]; then
    MAXFAIL=(--maxfail 2)  # torch alone could not run two NCCL ranks here: two failures say enough
fi
if compgen -G "$OUT/nccl-pair-rank*.log" > /dev/null; then
    grep -h "NCCL INFO" "$OUT"/nccl-pair-rank*.log > "$OUT/nccl-pair-init-net.log"
    echo "--- nccl-pair: $(wc -l < "$OUT/nccl-pair-init-net.log") NCCL INFO lines in nccl-pair-init-net.log; the transport:"
    grep -hE "Using network|NET/Socket|via NET|Duplicate GPU|NCCL_HOSTID|hostHash|Connected all" \
        "$OUT"/nccl-pair-rank*.log | head -20
fi

# 7. --------------------------------------------------------------------------------------------------
gpu_step nccl-tests 150 env NCCL_DEBUG=WARN "${PYTEST[@]}" --gpus "$GPUS" --timeout 120 \
    ${MAXFAIL[@]+"${MAXFAIL[@]}"} --junitxml "$OUT/nccl-tests.xml" tests/test_gpu*.py -k nccl

# 8. --------------------------------------------------------------------------------------------------
gpu_step gpu-tests 150 "${PYTEST[@]}" --gpus "$GPUS" --timeout 60 \
    --junitxml "$OUT/gpu-tests.xml" tests/test_gpu*.py tests/test_tags.py tests/test_digest.py \
    -k "not nccl" "${DESELECT[@]}"

# 9. --------------------------------------------------------------------------------------------------
BENCH_JSON="$OUT/gpu-bench.json"
rm -f "$BENCH_JSON"
if timeout 20 "$PY" -c "import pytest_benchmark" 2>/dev/null; then
    BENCH_ARGS=(--benchmark-json "$BENCH_JSON")
else
    echo "pytest-benchmark is not installed: bench/bench_gpu.py's stand-in fixture writes $BENCH_JSON"
    export CUDARECV_BENCH_JSON="$BENCH_JSON"
    BENCH_ARGS=()
fi
K_ARGS=()
if [ -n "$BENCH_K" ]; then
    K_ARGS=(-k "$BENCH_K")
fi
gpu_step gpu-benches 110 "${PYTEST[@]}" --gpus "$GPUS" --timeout 100 --junitxml "$OUT/gpu-benches.xml" \
    bench/bench_gpu.py ${K_ARGS[@]+"${K_ARGS[@]}"} ${BENCH_ARGS[@]+"${BENCH_ARGS[@]}"}

# vLLM's own GPU weight-transfer backends (ipc, nccl) against cudarecv's, updating a running engine (bf16, 200M):
# only where vLLM is installed (the lent image has none, and a CUDA build of vLLM is far beyond what a call
# carries)
if timeout 60 "$PY" -c "import vllm" 2>/dev/null; then
    gpu_step vllm-bench 300 "${PYTEST[@]}" --gpus "$GPUS" --timeout 280 --junitxml "$OUT/vllm-bench.xml" \
        bench/bench_vllm.py -k gpu --benchmark-json "$OUT/vllm-gpu-bench.json"
    [ -s "$OUT/vllm-gpu-bench.json" ] && "$PY" bench/bench_vllm.py "$OUT/vllm-gpu-bench.json"
else
    echo "=== vllm-bench: skipped, vllm cannot be imported here (bench/bench_vllm.py -k gpu: cudarecv vs vLLM's ipc and nccl)" >&2
fi

if [ -s "$BENCH_JSON" ]; then
    if timeout 20 "$PY" -c "import matplotlib" 2>/dev/null; then
        PNG=(--png "$OUT/gpu-report.png")
    else
        echo "matplotlib is not installed: no plot"
        PNG=(--no-png)
    fi
    step report 15 "$PY" -m cudarecv report "$BENCH_JSON" "${PNG[@]}" > "$OUT/gpu-report.txt"
    cat "$OUT/gpu-report.txt"
else
    echo "=== report: skipped, no $BENCH_JSON" >&2
    failed+=("report (no $BENCH_JSON)")
fi

# 10. -------------------------------------------------------------------------------------------------
if [ -n "$CPU_TESTS" ]; then
    XDIST=()
    if timeout 10 "$PY" -c "import xdist" 2>/dev/null; then
        XDIST=(-n 4)
    fi
    # shellcheck disable=SC2086  # CPU_TESTS is a list of paths
    step cpu-tests 600 "${PYTEST[@]}" ${XDIST[@]+"${XDIST[@]}"} --junitxml "$OUT/cpu-tests.xml" \
        $CPU_TESTS --ignore=tests/test_gpu.py
fi

echo "after ${SECONDS} s; results in $OUT:"
ls -l "$OUT"
if [ "${#failed[@]}" -gt 0 ]; then
    echo "FAILED steps: ${failed[*]}"
    exit 1
fi
echo "all steps passed"
