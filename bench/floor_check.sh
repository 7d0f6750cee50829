#!/usr/bin/env bash
# Where a lone session's HTTP call stands against its floors, on a lent GPU machine in one call: bench_service.py's
# engine, unary and step legs beside both echoes (raw TCP, and a bare ASGI app under uvicorn: bench/http_echo.py)
# at 1 and 256 sessions, in the default layout and with the engine in the HTTP process (`--workers 0`), then the
# hop-by-hop trace of a lone call in both layouts (bench/lone_trace.py). 8 layers x dim 4096, bf16; the server on
# CPUs 0-7, the clients on 8-15. With the engine in the HTTP process one process holds every connection: the unary
# leg's 2,048 at 256 sessions (one per session and layer) need a cap above the default 1,024.
#
#   bash bench/floor_check.sh        # on the device (run with carry [".whl"]); results under $OUT
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/floor-check}
DURATION=${DURATION:-3}
mkdir -p "$OUT"
if ! python3 -c 'import fastapi' 2> /dev/null; then    # the device image: the carried wheels
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
  export PYTHONPATH=/tmp/site
fi
export PYTHONPATH=${PYTHONPATH:+$PYTHONPATH:}$PWD/src PYTHONUNBUFFERED=1
{
  date -u +%FT%TZ
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
  python3 -c 'import torch, triton; print("torch", torch.__version__, "triton", triton.__version__)'
} > "$OUT/device.txt" 2>&1
model=(--server-arg=--dim=4096 --server-arg=--layers=8)
pin=(--server-cpus 0,1,2,3,4,5,6,7 --client-cpus 8,9,10,11,12,13,14,15)
python3 bench/bench_service.py --legs inproc,unary,http-echo,step,step-http-echo,step-echo,step-shm-sealed \
  --concurrency 1,256 --duration "$DURATION" "${pin[@]}" "${model[@]}" --out "$OUT/service-default.json" \
  > "$OUT/service-default.txt" 2>&1 || echo "bench_service (default layout) failed"
python3 bench/bench_service.py --legs unary,step,step-shm-sealed --concurrency 1,256 --duration "$DURATION" \
  "${pin[@]}" "${model[@]}" --server-arg=--workers=0 --server-arg=--max-connections=4096 --out "$OUT/service-workers0.json" \
  > "$OUT/service-workers0.txt" 2>&1 || echo "bench_service (--workers 0) failed"
python3 bench/lone_trace.py --workers 1,0 --rounds 2 --seconds 3 --out "$OUT/lone-trace.json" \
  > "$OUT/lone-trace.txt" 2>&1 || echo "lone_trace failed"
