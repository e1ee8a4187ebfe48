#!/usr/bin/env bash
# GPU check of cudarecv on a lent machine, in one prepared run of at most BUDGET seconds (default 400, probes
# included: a lent machine gives about 15 minutes of device time, its start included, so one run and room to
# rerun it; call it with the timeout_s printed at the top). Every step is bounded with
# `timeout -s INT --kill-after=15` by the smaller of its own limit and what is left of BUDGET; a step with
# under 5 s left is skipped and counted as failed. SIGINT goes to the step's process group: pytest takes it for
# a Ctrl-C (it writes its --junitxml and its summary, and its fixtures close their ranks: cudarecv's Cluster
# kills them); processes in a session of their own (cudarecv's ranks, nccl_smoke.py pair's ranks) are not in
# that group and are killed by their parent on that signal. (timeout catches SIGINT itself, so the command
# it runs starts with SIGINT's default disposition even where this script was started with it ignored, as a
# background job is.) Probes between the steps
# (the GPU count, vllm, pytest_benchmark, matplotlib) are bounded the same way. A failed step does not stop
# the next ones, but the script then exits 1. The new GPU tests, which have never run on a GPU, come first:
#    1. nvidia-smi;
#    2. wheels:  the carried wheels (gpu-wheels/) and cudarecv itself, built from this checkout with its
#       native host copies, installed with --no-deps --target into $SITE (the image's torch stays); the
#       tests import that copy, never the checkout's (PYTHONSAFEPATH; pytest imports it first, as its
#       plugin given with -p, before the checkout's conftest.py puts the checkout on sys.path);
#    3. versions: python, torch, CUDA, cupy, NVRTC, tensordict, pytest plugins, cudarecv; NCCL twice: the
#       library loaded (ncclGetVersion through ctypes, cudarecv.testing.gpu.nccl_runtime_version) and the one
#       torch was built with (torch.cuda.nccl.version()); how nccl_ranks runs 2 and 3 ranks here;
#    4. new-gpu-tests: the new GPU test files without NCCL ranks (-m "not nccl": NEW_GPU below, with
#       tests/test_tags.py and tests/test_digest.py), --timeout 45;
#    5. nccl-self: one process, an NCCL group of world 1, then a batch of a send to itself and a receive
#       from itself (bench/nccl_smoke.py self; NCCL's INIT/NET log in nccl-self.<pid>.log);
#    6. nccl-pair: two processes on GPU 0, torch only, each its own NCCL_HOSTID, NCCL's socket transport on
#       loopback (bench/nccl_smoke.py pair): send/recv, batch_isend_irecv, all_reduce, process groups timing
#       out after 12 s, ranks killed after 30 s (the step's limit: 50 s); with NCCL_DEBUG=INFO
#       NCCL_DEBUG_SUBSYS=INIT,NET: each rank's log in nccl-pair-rank<r>.log, their NCCL lines in
#       nccl-pair-init-net.log;
#    7. new-nccl-tests: the new NCCL test files (-m nccl: NEW_NCCL below), each module's own pytest timeout
#       (its pytestmark), with NCCL_DEBUG=WARN; skipped where step 6 failed (torch alone could not run two
#       NCCL ranks here: the log says so);
#    8. former-failures: the 18 tests that failed on the H200 on 2026-12-04 (docs/gpu.md), named
#       (FORMER below: the failed cases' tests, a superset where the record names no case);
#    9. nccl-tests: a representative subset of tests/test_gpu.py's NCCL tests (NCCL_SUBSET below: blocking
#       roundtrips of two structures, a standalone group, weight sync, relay, staging reuse, per-leaf with a
#       stock peer; all of them with NCCL_ALL=1), --timeout 45; skipped where step 6 failed;
#   10. gpu-tests: the rest of tests/test_gpu.py (-m "not nccl", the former failures deselected: about 90
#       gloo tests, passed on the H200 on 2026-12-04), with what is left;
#   11. only with BENCH=1: bench/bench_gpu.py -k "$BENCH_K" --benchmark-json gpu-bench.json (default: the
#       NCCL benches left out where the ranks would share a GPU: their times would be loopback sockets');
#       where vLLM is installed, bench/bench_vllm.py -k gpu; then python -m cudarecv report;
#   12. cpu-tests, only where CPU_TESTS names them (CI runs the CPU suite).
# Each pytest step writes $OUT/<step>.xml (JUnit), its failures, errors and skips (-rfEs) and its 30
# slowest tests. Results, all under OUT: gpu-check.log, new-gpu-tests.xml, nccl-self.*.log,
# nccl-pair-rank*.log, nccl-pair-init-net.log, new-nccl-tests.xml, former-failures.xml, nccl-tests.xml,
# gpu-tests.xml (BENCH=1: gpu-benches.xml, gpu-bench.json, gpu-report.txt, gpu-report.png).
# Without a GPU every step still runs (quickly): the pytest steps with --gpus 0 (all skipped, their xml
# written) and every GPU step counted as failed; the NCCL test steps are skipped (step 6 failed).
#
# The lent machine's image (Python 3.12, torch 2.11+cu130, NCCL 2.28.9, cupy-cuda13x, pytest-benchmark) has
# no tensordict, pyvers or blake3 and cannot download: fill gpu-wheels/ here first with
# `bash bench/gpu_wheels.sh`, and carry gpu-wheels/ with the call (it is git-ignored).
#
# Usage (from anywhere):  bash bench/gpu_check.sh [OUT]
#   bash bench/gpu_check.sh --ids: every test id and file the steps name, one a line (tests/test_gpu_check.py)
#   bash bench/gpu_check.sh --former: step 8's test ids
#   OUT               results folder (default: $OUT, else ./gpu-results)
#   PYTHON=...        the interpreter (default: python3)
#   WHEELS=...        the carried wheels (default: gpu-wheels); SITE=... where they go (/tmp/cudarecv-site)
#   BUDGET=...        seconds the whole check may take, probes included (default 400; call with BUDGET + 30)
#   GPUS=N            --gpus for pytest (default: 2 if torch sees 2 GPUs or more, 1 with one, 0 with none)
#   NCCL_ALL=1        step 9 runs every NCCL test of tests/test_gpu.py (default: NCCL_SUBSET)
#   BENCH=1           run the benches (step 11; default: not run)
#   BENCH_K=...       pytest -k of step 11 (default: "not nccl" where NCCL ranks would share a GPU, else all)
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

# the new GPU test files (never run on a GPU yet): steps 4 (-m "not nccl") and 7 (-m nccl)
NEW_GPU=(tests/test_gpu_digest_tags.py tests/test_gpu_ipc_sharded.py tests/test_gpu_streams.py
    tests/test_tags.py tests/test_digest.py)
NEW_NCCL=(tests/test_gpu_fanout.py tests/test_gpu_staging.py tests/test_gpu_streams.py)
# step 9: tests/test_gpu.py's NCCL tests, a representative few (in hostid mode all 50 would not fit)
NCCL_SUBSET=(
    "tests/test_gpu.py::test_nccl_roundtrip[per-leaf-cudarecv_cuda-to-cudarecv_cuda-blocking]"
    "tests/test_gpu.py::test_nccl_roundtrip[chunks-4096-cudarecv_cuda-to-cudarecv_pinned-blocking]"
    "tests/test_gpu.py::test_nccl_standalone_group[consolidated-cudarecv_cuda-to-cudarecv_cuda]"
    "tests/test_gpu.py::test_nccl_weight_sync[cuda-default_group]"
    "tests/test_gpu.py::test_nccl_relay[cuda]"
    "tests/test_gpu.py::test_nccl_staging_is_reused[nccl-chunks-to-pinned]"
    "tests/test_gpu.py::test_nccl_per_leaf_with_a_stock_peer[stock-to-cudarecv]"
)

case "${1:-}" in
--former)  # the list of step 8, one test id a line (tests/test_gpu_check.py)
    printf '%s\n' "${FORMER[@]}"
    exit 0
    ;;
--ids)  # every file and test id a step names (tests/test_gpu_check.py: each still collects)
    printf '%s\n' "${NEW_GPU[@]}" "${NEW_NCCL[@]}" "${FORMER[@]}" "${NCCL_SUBSET[@]}"
    exit 0
    ;;
esac

OUT="${1:-${OUT:-gpu-results}}"
mkdir -p "$OUT" || exit 2
OUT="$(cd "$OUT" && pwd)"
PY="${PYTHON:-python3}"
WHEELS="${WHEELS:-gpu-wheels}"
SITE="${SITE:-/tmp/cudarecv-site}"
BUDGET="${BUDGET:-400}"
CPU_TESTS="${CPU_TESTS:-}"
export PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONSAFEPATH=1  # no `python -m`/`-c` puts the checkout first on sys.path: the installed copy is tested
export PYTHONUNBUFFERED=1
# every pytest step: cudarecv from $SITE first, its JUnit xml, its failures, errors and skips said, its 30
# slowest tests
PYTEST=("$PY" -m pytest -p no:cacheprovider -p cudarecv.testing.pytest_plugin -q -rfEs --durations=30)
exec > >(tee -a "$OUT/gpu-check.log") 2>&1

echo "gpu_check: BUDGET ${BUDGET} s, probes and --kill-after included: call it with timeout_s $((BUDGET + 30))" \
    "(the last listing, the exit); OUT $OUT"

failed=()

# bounded SECONDS: the smaller of SECONDS and what is left of BUDGET (the 15 s of --kill-after kept), in LIMIT
bounded() {
    LIMIT=$1
    local left=$((BUDGET - SECONDS - 15))
    if [ "$left" -lt "$LIMIT" ]; then
        LIMIT=$left
    fi
}

# probe SECONDS COMMAND...: a quick question between the steps (its output on stdout), bounded as a step;
# fails (1) where no time is left
probe() {
    bounded "$1"
    shift
    if [ "$LIMIT" -lt 2 ]; then
        return 1
    fi
    timeout -s INT --kill-after=5 "$LIMIT" "$@"
}

# step NAME SECONDS COMMAND...: run COMMAND for at most SECONDS (and what is left of BUDGET); record a
# failure, never stop. RAN: 1 where it ran, 0 where no time was left. STEP_RC: its exit code.
step() {
    local name=$1 start=$SECONDS rc
    bounded "$2"
    shift 2
    RAN=0
    STEP_RC=1
    if [ "$LIMIT" -lt 5 ]; then
        echo "=== $name: SKIPPED, $((BUDGET - SECONDS)) s left of the ${BUDGET} s budget" >&2
        failed+=("$name (no time left)")
        return 0
    fi
    RAN=1
    echo "=== $name (at most ${LIMIT} s, at ${SECONDS} s): $*" >&2
    timeout -s INT --kill-after=15 "$LIMIT" "$@"
    rc=$?
    STEP_RC=$rc
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
read -r NGPU NCCL_MODE < <(probe 30 "$PY" -c "
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
echo "GPUs visible to torch: $NGPU | pytest --gpus $GPUS | nccl_ranks(2): $NCCL_MODE (at ${SECONDS} s)"

# 4. --------------------------------------------------------------------------------------------------
gpu_step new-gpu-tests 75 "${PYTEST[@]}" --gpus "$GPUS" --timeout 45 \
    --junitxml "$OUT/new-gpu-tests.xml" -m "not nccl and not long" "${NEW_GPU[@]}"

# 5. --------------------------------------------------------------------------------------------------
step nccl-self 25 env NCCL_DEBUG=INFO NCCL_DEBUG_SUBSYS=INIT,NET NCCL_DEBUG_FILE="$OUT/nccl-self.%p.log" \
    "$PY" bench/nccl_smoke.py self --timeout 15

# 6. --------------------------------------------------------------------------------------------------
# (its ranks are killed after 30 s, well within the step's 50: where the budget cuts the step shorter,
# SIGINT makes nccl_smoke.py kill them)
step nccl-pair 50 env NCCL_DEBUG=INFO NCCL_DEBUG_SUBSYS=INIT,NET \
    "$PY" bench/nccl_smoke.py pair --logs "$OUT" --timeout 12 --deadline 30
PAIR_OK=0
if [ "$RAN" -eq 1 ] && [ "$STEP_RC" -eq 0 ]; then
    PAIR_OK=1
fi
if compgen -G "$OUT/nccl-pair-rank*.log" > /dev/null; then
    grep -h "NCCL INFO" "$OUT"/nccl-pair-rank*.log > "$OUT/nccl-pair-init-net.log"
    echo "--- nccl-pair: $(wc -l < "$OUT/nccl-pair-init-net.log") NCCL INFO lines in nccl-pair-init-net.log; the transport:"
    grep -hE "Using network|NET/Socket|via NET|Duplicate GPU|NCCL_HOSTID|hostHash|Connected all" \
        "$OUT"/nccl-pair-rank*.log | head -20
fi

# nccl_step NAME SECONDS COMMAND...: a step of NCCL ranks, run only where torch alone ran two (step 6)
nccl_step() {
    if [ "$PAIR_OK" -eq 1 ]; then
        gpu_step "$@"
    else
        echo "=== $1: SKIPPED, nccl-pair (torch alone, two NCCL ranks) did not pass here: cudarecv's NCCL tests" \
            "would fail the same way (the nccl-pair step above, nccl-pair-rank*.log say why)" >&2
        failed+=("$1 (skipped: nccl-pair did not pass)")
    fi
}

# 7. --------------------------------------------------------------------------------------------------
nccl_step new-nccl-tests 170 env NCCL_DEBUG=WARN "${PYTEST[@]}" --gpus "$GPUS" \
    --junitxml "$OUT/new-nccl-tests.xml" -m nccl "${NEW_NCCL[@]}"

# 8. --------------------------------------------------------------------------------------------------
gpu_step former-failures 60 "${PYTEST[@]}" --gpus "$GPUS" --timeout 45 \
    --junitxml "$OUT/former-failures.xml" "${FORMER[@]}"

# 9. --------------------------------------------------------------------------------------------------
if [ -n "${NCCL_ALL:-}" ]; then
    NCCL_IDS=(tests/test_gpu.py -m "nccl")
else
    NCCL_IDS=("${NCCL_SUBSET[@]}")
fi
nccl_step nccl-tests 75 env NCCL_DEBUG=WARN "${PYTEST[@]}" --gpus "$GPUS" --timeout 45 \
    --junitxml "$OUT/nccl-tests.xml" "${NCCL_IDS[@]}"

# 10. -------------------------------------------------------------------------------------------------
gpu_step gpu-tests 150 "${PYTEST[@]}" --gpus "$GPUS" --timeout 45 \
    --junitxml "$OUT/gpu-tests.xml" -m "not nccl and not long" tests/test_gpu.py "${DESELECT[@]}"

# 11. -------------------------------------------------------------------------------------------------
if [ -n "${BENCH:-}" ]; then
    if [ -z "${BENCH_K+set}" ]; then
        if [ "$NCCL_MODE" = per_gpu ]; then BENCH_K=""; else BENCH_K="not nccl"; fi
    fi
    BENCH_JSON="$OUT/gpu-bench.json"
    rm -f "$BENCH_JSON"
    if probe 20 "$PY" -c "import pytest_benchmark" 2>/dev/null; then
        BENCH_ARGS=(--benchmark-json "$BENCH_JSON")
    else
        echo "pytest-benchmark cannot be imported: bench/bench_gpu.py's stand-in fixture writes $BENCH_JSON"
        export CUDARECV_BENCH_JSON="$BENCH_JSON"
        BENCH_ARGS=()
    fi
    K_ARGS=()
    if [ -n "$BENCH_K" ]; then
        K_ARGS=(-k "$BENCH_K")
    fi
    gpu_step gpu-benches 110 "${PYTEST[@]}" --gpus "$GPUS" --timeout 100 --junitxml "$OUT/gpu-benches.xml" \
        bench/bench_gpu.py ${K_ARGS[@]+"${K_ARGS[@]}"} ${BENCH_ARGS[@]+"${BENCH_ARGS[@]}"}

    # vLLM's own GPU weight-transfer backends (ipc, nccl) against cudarecv's, updating a running engine (bf16,
    # 200M): only where vLLM is installed (the lent image has none, and a CUDA build of vLLM is far beyond
    # what a call carries)
    if probe 60 "$PY" -c "import vllm" 2>/dev/null; then
        gpu_step vllm-bench 300 "${PYTEST[@]}" --gpus "$GPUS" --timeout 280 --junitxml "$OUT/vllm-bench.xml" \
            bench/bench_vllm.py -k gpu --benchmark-json "$OUT/vllm-gpu-bench.json"
        [ -s "$OUT/vllm-gpu-bench.json" ] && probe 30 "$PY" bench/bench_vllm.py "$OUT/vllm-gpu-bench.json"
    else
        echo "=== vllm-bench: skipped, vllm cannot be imported here (bench/bench_vllm.py -k gpu: cudarecv vs vLLM's ipc and nccl)" >&2
    fi

    if [ -s "$BENCH_JSON" ]; then
        if probe 20 "$PY" -c "import matplotlib" 2>/dev/null; then
            PNG=(--png "$OUT/gpu-report.png")
        else
            echo "matplotlib cannot be imported: no plot"
            PNG=(--no-png)
        fi
        step report 15 "$PY" -m cudarecv report "$BENCH_JSON" "${PNG[@]}" > "$OUT/gpu-report.txt"
        cat "$OUT/gpu-report.txt"
    else
        echo "=== report: skipped, no $BENCH_JSON" >&2
        failed+=("report (no $BENCH_JSON)")
    fi
else
    echo "=== benches: not run (BENCH=1 runs bench/bench_gpu.py, vLLM's where installed, and the report)" >&2
fi

# 12. -------------------------------------------------------------------------------------------------
if [ -n "$CPU_TESTS" ]; then
    XDIST=()
    if probe 10 "$PY" -c "import xdist" 2>/dev/null; then
        XDIST=(-n 4)
    fi
    # shellcheck disable=SC2086  # CPU_TESTS is a list of paths
    step cpu-tests 600 "${PYTEST[@]}" ${XDIST[@]+"${XDIST[@]}"} --junitxml "$OUT/cpu-tests.xml" \
        $CPU_TESTS --ignore=tests/test_gpu.py
fi

echo "after ${SECONDS} s (budget ${BUDGET} s); results in $OUT:"
ls -l "$OUT"
if [ "${#failed[@]}" -gt 0 ]; then
    echo "FAILED steps: ${failed[*]}"
    exit 1
fi
echo "all steps passed"
