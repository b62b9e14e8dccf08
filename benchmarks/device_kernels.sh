#!/usr/bin/env bash
# The GPU checks of csrc/, in one run on a machine with an NVIDIA GPU, nvcc and a CUDA build of
# PyTorch (no project install needed: only torch, pytest and hypothesis):
#   1. build the kernels (C++ and CUDA) with that PyTorch;
#   2. the kernel tests, every one that takes a device on the CPU and on the GPU;
#   3. compute-sanitizer's memcheck over the GPU tests of odd alignments, chunks and bad input;
#   4. benchmarks/kernels.py --device cuda (GB/s against copy_ and the catalogued bandwidth).
# Logs and the benchmark's JSON go to $OUT (default /tmp/nereus-device); the library to
# $NEREUS_KERNELS_DIR (default build/kernels-device, so that the project's own build stays).
# Where nvcc and a CUDA build of PyTorch exist but no GPU does, it stops after step 2: the build
# and the CPU tests of a library with CUDA kernels in it, and tests/runtime/kernels/test_nvcc.py.
#
#     bash benchmarks/device_kernels.sh
#     PYTHON=/path/to/cuda-torch/bin/python CUDA_HOME=/usr/local/cuda bash benchmarks/device_kernels.sh
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/nereus-device}
PYTHON=${PYTHON:-python3}
mkdir -p "$OUT"
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
export MAX_JOBS=${MAX_JOBS:-$(nproc)} TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST:-9.0}
export NEREUS_KERNELS_DIR=${NEREUS_KERNELS_DIR:-$PWD/build/kernels-device}
status=0

echo "== environment" | tee "$OUT/summary.txt"
"$PYTHON" -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, \
'device', torch.cuda.get_device_name() if torch.cuda.is_available() else None)" 2>&1 \
  | tee -a "$OUT/summary.txt"
nvcc --version 2>&1 | tail -1 | tee -a "$OUT/summary.txt"

echo "== build" | tee -a "$OUT/summary.txt"
if ! "$PYTHON" -m runtime.kernels.build --verbose >"$OUT/build.log" 2>&1; then
  tail -40 "$OUT/build.log"
  exit 1
fi
tail -1 "$OUT/build.log" | tee -a "$OUT/summary.txt"
# A CUDA build of PyTorch must have loaded the library with its CUDA kernels in it.
"$PYTHON" -c "
import sys, torch
from runtime import kernels
registered = kernels.has_kernels_for('cuda')
print('CUDA kernels registered:', registered)
sys.exit(bool(torch.version.cuda) and not registered)" 2>&1 | tee -a "$OUT/summary.txt" || status=1

# What the build's device code is (the tests' test_nvcc.py reads PTX; this reads the SASS the GPU
# runs): registers and spills per kernel, and the 16-byte loads and stores of the copy.
if command -v cuobjdump >/dev/null; then
  LIB="$NEREUS_KERNELS_DIR/nereus_kernels.so"
  cuobjdump --dump-resource-usage "$LIB" >"$OUT/resource_usage.txt" 2>&1 || true
  cuobjdump --dump-sass "$LIB" >"$OUT/sass.txt" 2>&1 || true
  echo "SASS: $(grep -c 'LDG.E.128' "$OUT/sass.txt") LDG.E.128, $(grep -c 'STG.E.128' "$OUT/sass.txt") STG.E.128," \
    "$(grep -c 'STL' "$OUT/sass.txt") local stores (spills)" | tee -a "$OUT/summary.txt"
fi

# The project's pytest configuration names plugins (Django, asyncio) this machine may lack, and
# the kernel tests need none of them or of the shared conftest.
PYTEST=("$PYTHON" -m pytest -q -c /dev/null --rootdir . --noconftest -p no:cacheprovider)

echo "== tests" | tee -a "$OUT/summary.txt"
"${PYTEST[@]}" -rs tests/runtime/kernels >"$OUT/tests.log" 2>&1 || status=1
tail -3 "$OUT/tests.log" | tee -a "$OUT/summary.txt"

if ! "$PYTHON" -c "import torch, sys; sys.exit(not torch.cuda.is_available())"; then
  echo "no GPU: the memcheck and the benchmark need one" | tee -a "$OUT/summary.txt"
  exit $status
fi

echo "== memcheck" | tee -a "$OUT/summary.txt"
if command -v compute-sanitizer >/dev/null; then
  timeout 300 compute-sanitizer --tool memcheck --error-exitcode 9 "${PYTEST[@]}" \
    tests/runtime/kernels -k "(cuda and (chunk or oddly or bad_input or opcheck)) or another_device" \
    >"$OUT/memcheck.log" 2>&1 || status=1
  grep -E "ERROR SUMMARY|passed|failed" "$OUT/memcheck.log" | tail -2 | tee -a "$OUT/summary.txt"
else
  echo "compute-sanitizer: not found" | tee -a "$OUT/summary.txt"
fi

echo "== benchmark" | tee -a "$OUT/summary.txt"
"$PYTHON" benchmarks/kernels.py --device cuda 2>&1 | tee "$OUT/bench.log" | tee -a "$OUT/summary.txt" \
  || status=1
cp benchmarks/results/kernels_cuda.json "$OUT/" 2>/dev/null || true
exit $status
