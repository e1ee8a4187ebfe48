#!/usr/bin/env bash
# GPU check of cudarecv on one machine, within 9 minutes (sized for one H200; the step limits
# add up to 525 s, plus a few seconds of version probes):
#   1. nvidia-smi and the versions of torch, CUDA, NCCL, cupy, tensordict, pytest plugins;
#   2. the GPU tests:  pytest --gpus N tests/test_gpu.py tests/test_tags.py (relay fan-out over NCCL
#      and over gloo from GPU memory included: test_nccl_relay, test_gloo_relay_of_gpu_weights; CUDA IPC,
#      one GPU with two processes and two GPUs, values exact and device memory flat over 200 syncs:
#      test_cuda_ipc_weight_sync_exact_and_memory_flat, test_cuda_ipc_fast_wire_exact_and_memory_flat);
#   3. the GPU benches: pytest --gpus N bench/bench_gpu.py --benchmark-json $OUT/gpu-bench.json
#      (test_nccl_fanout_to_two: relay vs star vs NCCL's broadcast, 256 MiB to two GPUs;
#      test_cuda_ipc_weight_sync_256mib: CUDA IPC vs the staged gloo wire, GPU to GPU);
#   4. the report:     python -m cudarecv report -> $OUT/gpu-report.txt and $OUT/gpu-report.png;
#   5. the CPU suite:  pytest tests/ (without test_gpu.py), last, so it never starves the GPU steps.
# Every step is bounded with `timeout` (which signals the step's whole process group, ranks included);
# a failed step does not stop the next ones, but the script then exits 1. It installs nothing but blake3: the
# package is used from this checkout (PYTHONPATH); the repository's conftest.py loads the --gpus plugin.
# blake3 (verify=True's digest), the one dependency a GPU machine may lack,
# is installed from ./gpu-wheels/ when that folder holds its wheel (pip download blake3 -d gpu-wheels,
# then carry gpu-wheels to the machine).
#
# Usage (from anywhere):  bash bench/gpu_check.sh [OUT]
#   OUT                        results folder (default: $OUT, else ./gpu-results)
#   PYTHON=...                 the interpreter (default: python)
#   GPUS=N                     --gpus for pytest (default: 2 if torch sees 2 GPUs or more, else 1)
#   CUDARECV_NCCL_SHARED_GPU   1: NCCL tests and benches with both ranks on one GPU (needs NCCL >= 2.30);
#                              default: 1 on a one-GPU machine whose NCCL is >= 2.30, else 0
set -uo pipefail

cd "$(dirname "$0")/.." || exit 2
OUT="${1:-${OUT:-gpu-results}}"
mkdir -p "$OUT" || exit 2
PY="${PYTHON:-python}"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1
exec > >(tee -a "$OUT/gpu-check.log") 2>&1

failed=()

# step NAME SECONDS COMMAND...: run COMMAND for at most SECONDS; record a failure, never stop.
step() {
    local name=$1 limit=$2 start=$SECONDS rc
    shift 2
    echo "=== $name (at most ${limit} s): $*" >&2
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

step nvidia-smi 15 nvidia-smi

if ! timeout 20 "$PY" -c "import blake3" 2>/dev/null; then
    if compgen -G "gpu-wheels/*.whl" > /dev/null; then
        step blake3-wheel 60 "$PY" -m pip install -q --no-index --no-deps gpu-wheels/*.whl
    else
        echo "blake3 is not installed and gpu-wheels/ holds no wheel: the verify=True tests will fail"
    fi
fi

step versions 30 "$PY" - <<'PYEOF'
import importlib, importlib.metadata as md, platform
import torch
print("python", platform.python_version(), "|", platform.platform())
print("torch", torch.__version__, "| CUDA", torch.version.cuda, "| cuda available", torch.cuda.is_available(),
      "| devices", torch.cuda.device_count())
for i in range(torch.cuda.device_count()):
    print(f"  cuda:{i}", torch.cuda.get_device_name(i))
try:
    print("NCCL", torch.cuda.nccl.version())
except Exception as exc:
    print("NCCL: none", repr(exc))
try:
    import cupy
    print("cupy", cupy.__version__, "| CUDA runtime", cupy.cuda.runtime.runtimeGetVersion(),
          "| devices", cupy.cuda.runtime.getDeviceCount())
except Exception as exc:
    print("cupy: unusable", repr(exc))
for name in ("tensordict", "numpy", "blake3", "pytest", "pytest-benchmark", "pytest-timeout", "matplotlib"):
    try:
        print(name, md.version(name))
    except md.PackageNotFoundError:
        print(name, "NOT INSTALLED")
import cudarecv
print("cudarecv", cudarecv.__version__, "from", cudarecv.__file__)
PYEOF

NGPU=$(timeout 30 "$PY" -c "import torch; print(torch.cuda.device_count())" 2>/dev/null || echo 0)
if [ -z "${GPUS:-}" ]; then
    if [ "$NGPU" -ge 2 ]; then GPUS=2; else GPUS=1; fi
fi
if [ -z "${CUDARECV_NCCL_SHARED_GPU:-}" ]; then
    CUDARECV_NCCL_SHARED_GPU=$(timeout 30 "$PY" - <<'PYEOF' 2>/dev/null || echo 0
import torch
try:
    v = torch.cuda.nccl.version()
except Exception:
    v = None
if isinstance(v, int):
    v = (v // 10000, v // 100 % 100)
print(1 if torch.cuda.device_count() == 1 and v is not None and tuple(v[:2]) >= (2, 30) else 0)
PYEOF
)
fi
export CUDARECV_NCCL_SHARED_GPU
echo "GPUs visible to torch: $NGPU | pytest --gpus $GPUS | CUDARECV_NCCL_SHARED_GPU=$CUDARECV_NCCL_SHARED_GPU"

step gpu-tests 230 "$PY" -m pytest --gpus "$GPUS" -q -p no:cacheprovider \
    --junitxml "$OUT/gpu-tests.xml" tests/test_gpu.py tests/test_tags.py tests/test_digest.py

BENCH_JSON="$OUT/gpu-bench.json"
rm -f "$BENCH_JSON"
if timeout 20 "$PY" -c "import pytest_benchmark" 2>/dev/null; then
    BENCH_ARGS=(--benchmark-json "$BENCH_JSON")
else
    echo "pytest-benchmark is not installed: bench/bench_gpu.py's stand-in fixture writes $BENCH_JSON"
    export CUDARECV_BENCH_JSON="$BENCH_JSON"
    BENCH_ARGS=()
fi
step gpu-benches 170 "$PY" -m pytest --gpus "$GPUS" -q -p no:cacheprovider \
    bench/bench_gpu.py ${BENCH_ARGS[@]+"${BENCH_ARGS[@]}"}

if [ -s "$BENCH_JSON" ]; then
    if timeout 20 "$PY" -c "import matplotlib" 2>/dev/null; then
        PNG=(--png "$OUT/gpu-report.png")
    else
        echo "matplotlib is not installed: no plot"
        PNG=(--no-png)
    fi
    step report 20 "$PY" -m cudarecv report "$BENCH_JSON" "${PNG[@]}" > "$OUT/gpu-report.txt"
    cat "$OUT/gpu-report.txt"
else
    echo "=== report: skipped, no $BENCH_JSON" >&2
    failed+=("report (no $BENCH_JSON)")
fi

step cpu-tests 60 "$PY" -m pytest -q -p no:cacheprovider \
    --junitxml "$OUT/cpu-tests.xml" tests/ --ignore=tests/test_gpu.py

echo "results in $OUT: gpu-check.log, gpu-tests.xml, gpu-bench.json, gpu-report.txt, gpu-report.png, cpu-tests.xml"
if [ "${#failed[@]}" -gt 0 ]; then
    echo "FAILED steps: ${failed[*]}"
    exit 1
fi
echo "all steps passed"
