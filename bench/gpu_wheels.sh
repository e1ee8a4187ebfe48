#!/usr/bin/env bash
# Fill gpu-wheels/ with what bench/gpu_check.sh needs on a GPU machine that cannot download: the
# dependencies of cudarecv that the lent machine's image lacks (tensordict and what it needs beyond torch and
# numpy: pyvers, cloudpickle; blake3), as wheels for its Python: its torch, numpy, cupy, pytest and
# pytest-benchmark are there. A stand-in of that image with only these wheels ran gpu_check.sh here.
# Run here (where pip reaches PyPI), then carry gpu-wheels/ with the call (about 1.3 MB).
#
# Usage:  bash bench/gpu_wheels.sh [PYTHON_VERSION]     (default 3.12: the lent image's Python)
set -euo pipefail
cd "$(dirname "$0")/.."
version="${1:-3.12}"
mkdir -p gpu-wheels
# pure-Python wheels and blake3's manylinux wheel; --no-deps: the image has the rest
python3 -m pip download -q --no-deps --only-binary=:all: --python-version "$version" --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    -d gpu-wheels "tensordict==0.15.3" "pyvers==0.2.3" "cloudpickle==3.1.3" "blake3==1.0.11"
ls -l gpu-wheels
