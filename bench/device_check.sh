#!/usr/bin/env bash
# The standard checks on a lent GPU machine, in one call: the carried wheels installed, every gpu-marked test,
# then the kernel benchmark's quick table and the engine's step legs. Everything lands in $OUT.
#
#   bench/wheels.sh                                   # here, once: the wheels the device image lacks, into .whl/
#   bash bench/device_check.sh                        # on the device (run with carry [".whl"])
#   STEPS=tests bash bench/device_check.sh            # only the tests; STEPS=tests,kernels,engine is the default
#
# The tests' summary is the last line of $OUT/gpu-tests.txt; the exit status is the tests' (benchmarks that fail
# are reported in their own files and do not change it).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/device-check}
STEPS=${STEPS:-tests,kernels,engine}
mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD/src
{
  date -u +%FT%TZ
  git rev-parse --short HEAD 2>/dev/null || true
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
  python3 -c 'import torch, triton; print("torch", torch.__version__, "triton", triton.__version__)'
} > "$OUT/device.txt" 2>&1
rc=0
if [[ ,$STEPS, == *,tests,* ]]; then
  # the files that hold gpu-marked tests (the rest would only be collected and deselected)
  mapfile -t files < <(grep -l 'mark\.gpu' tests/test_*.py)
  python3 -m pytest -q -m gpu -p no:cacheprovider "${files[@]}" > "$OUT/gpu-tests.txt" 2>&1
  rc=$?
  tail -n 1 "$OUT/gpu-tests.txt"
fi
if [[ ,$STEPS, == *,kernels,* ]]; then
  python3 bench/bench_kernels.py --quick --out "$OUT/kernels" > "$OUT/kernels.log" 2>&1 || echo "bench_kernels failed"
fi
if [[ ,$STEPS, == *,engine,* ]]; then
  python3 bench/bench_engine.py --only step-mixed,step-verify-64x4,step-decode-64,decode-256-batch --rounds 60 \
    --out "$OUT/engine.json" > "$OUT/engine.log" 2>&1 || echo "bench_engine failed"
fi
exit $rc
