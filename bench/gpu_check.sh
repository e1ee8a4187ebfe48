#!/usr/bin/env bash
# GPU check of cudarecv on one machine, within 8 minutes (sized for the lent H200; every step is bounded
# and the steps' fixed limits add up to 455 s, the probes between them take a second or two each, bounded
# at 10-60 s; the CPU suite gets what is left of BUDGET):
#   1. nvidia-smi; the carried wheels (gpu-wheels/) and cudarecv itself, built from this checkout with its
#      native host copies, installed with --no-deps --target into $SITE (the image's torch stays); the
#      tests import that installed copy, never the checkout's (PYTHONSAFEPATH; pytest imports it first, as
#      its plugin given with -p, before the checkout's conftest.py puts the checkout on sys.path);
#   2. the versions of python, torch, CUDA, NCCL, cupy, NVRTC, tensordict, pytest plugins, cudarecv;
#   3. the GPU tests:  pytest --gpus N tests/test_gpu.py tests/test_tags.py tests/test_digest.py
#      (relay fan-out over NCCL and over gloo from GPU memory; CUDA IPC, one GPU with two processes
#      and two GPUs, values exact and device memory flat over 200 syncs; the kernels);
#   4. the GPU benches: pytest --gpus N bench/bench_gpu.py --benchmark-json $OUT/gpu-bench.json; where vLLM is
#      installed, bench/bench_vllm.py -k gpu (cudarecv vs vLLM's ipc and nccl backends) -> vllm-gpu-bench.json;
#   5. the report:     python -m cudarecv report -> $OUT/gpu-report.txt and $OUT/gpu-report.png;
#   6. CPU tests:      pytest $CPU_TESTS, last, so they never starve the GPU steps, within what is left
#      of BUDGET: by default the CUDA-aware logic that runs without a GPU (cuda_logic, nccl_rules,
#      same_host_channels, interop, records_fuzz), which fits; CPU_TESTS=tests/ for the whole suite
#      (10 minutes on 2 cores: more than a lent machine's call), spread over 4 workers with pytest-xdist.
# Every step is bounded with `timeout` (which signals the step's whole process group, ranks included);
# a failed step does not stop the next ones, but the script then exits 1. Results, all under OUT:
# gpu-check.log, gpu-tests.xml, gpu-bench.json, gpu-report.txt, gpu-report.png, cpu-tests.xml.
#
# The lent machine's image (Python 3.12, torch 2.11+cu130, cupy-cuda13x, pytest-benchmark) has no
# tensordict, pyvers or blake3 and cannot download: fill gpu-wheels/ here first with
# `bash bench/gpu_wheels.sh`, and carry gpu-wheels/ with the call (it is git-ignored).
#
# Usage (from anywhere):  bash bench/gpu_check.sh [OUT]
#   OUT                        results folder (default: $OUT, else ./gpu-results)
#   PYTHON=...                 the interpreter (default: python3)
#   WHEELS=...                 the carried wheels (default: gpu-wheels); SITE=... where they go (/tmp/cudarecv-site)
#   BUDGET=...                 seconds the whole check may take (default 470)
#   CPU_TESTS=...              the CPU tests of step 6 (default: the CUDA-aware ones, see above)
#   GPUS=N                     --gpus for pytest (default: 2 if torch sees 2 GPUs or more, else 1)
#   CUDARECV_NCCL_SHARED_GPU   1: NCCL tests and benches with both ranks on one GPU (needs NCCL >= 2.30);
#                              default: 1 on a one-GPU machine whose NCCL is >= 2.30, else 0
set -uo pipefail

cd "$(dirname "$0")/.." || exit 2
OUT="${1:-${OUT:-gpu-results}}"
mkdir -p "$OUT" || exit 2
OUT="$(cd "$OUT" && pwd)"
PY="${PYTHON:-python3}"
WHEELS="${WHEELS:-gpu-wheels}"
SITE="${SITE:-/tmp/cudarecv-site}"
BUDGET="${BUDGET:-470}"
CPU_TESTS="${CPU_TESTS:-tests/test_cuda_logic.py tests/test_nccl_rules.py tests/test_same_host_channels.py tests/test_interop.py tests/test_records_fuzz.py}"
export PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONSAFEPATH=1  # no `python -m`/`-c` puts the checkout first on sys.path: the installed copy is tested
export PYTHONUNBUFFERED=1
PYTEST=("$PY" -m pytest -p no:cacheprovider -p cudarecv.testing.pytest_plugin)  # cudarecv from $SITE first
exec > >(tee -a "$OUT/gpu-check.log") 2>&1

failed=()

# step NAME SECONDS COMMAND...: run COMMAND for at most SECONDS; record a failure, never stop.
step() {
    local name=$1 limit=$2 start=$SECONDS rc
    shift 2
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

step nvidia-smi 15 nvidia-smi

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
try:
    from cupy.cuda import nvrtc
    print("NVRTC", nvrtc.getVersion(), "| archs", nvrtc.getSupportedArchs())
except Exception as exc:
    print("NVRTC: unusable", repr(exc))
for name in ("tensordict", "pyvers", "numpy", "blake3", "pytest", "pytest-benchmark", "pytest-timeout",
             "pytest-xdist", "matplotlib"):
    try:
        print(name, md.version(name))
    except md.PackageNotFoundError:
        print(name, "NOT INSTALLED")
import os, cudarecv
print("cudarecv", cudarecv.__version__, "from", cudarecv.__file__)
if not cudarecv.__file__.startswith(os.environ["PYTHONPATH"].split(":")[0]):
    raise SystemExit("cudarecv is not the copy installed in $SITE: the tests would not test it")
from cudarecv.core import host_copy as _host_copy
print("host copies:", "native" if _host_copy.NATIVE else _host_copy.WHY_NOT_NATIVE)
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

step gpu-tests 200 "${PYTEST[@]}" --gpus "$GPUS" -q -rA --timeout 60 --durations 15 \
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
step gpu-benches 110 "${PYTEST[@]}" --gpus "$GPUS" -q --timeout 100 \
    bench/bench_gpu.py ${BENCH_ARGS[@]+"${BENCH_ARGS[@]}"}

# vLLM's own GPU weight-transfer backends (ipc, nccl) against cudarecv's, updating a running engine (bf16, 200M):
# only where vLLM is installed (the lent image has none, and a CUDA build of vLLM is far beyond what a call
# carries); its time comes on top of the fixed limits above
if timeout 60 "$PY" -c "import vllm" 2>/dev/null; then
    step vllm-bench 300 "${PYTEST[@]}" --gpus "$GPUS" -q --timeout 280 \
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

left=$((BUDGET - SECONDS))
if [ "$left" -ge 30 ]; then
    XDIST=()
    if timeout 10 "$PY" -c "import xdist" 2>/dev/null; then
        XDIST=(-n 4)
    fi
    step cpu-tests "$left" "${PYTEST[@]}" -q ${XDIST[@]+"${XDIST[@]}"} \
        --junitxml "$OUT/cpu-tests.xml" $CPU_TESTS --ignore=tests/test_gpu.py
else
    echo "=== cpu-tests: skipped, ${left} s left of the ${BUDGET} s budget" >&2
    failed+=("cpu-tests (no time left)")
fi

echo "results in $OUT: gpu-check.log, gpu-tests.xml, gpu-bench.json, gpu-report.txt, gpu-report.png, cpu-tests.xml"
if [ "${#failed[@]}" -gt 0 ]; then
    echo "FAILED steps: ${failed[*]}"
    exit 1
fi
echo "all steps passed"
