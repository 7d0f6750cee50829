#!/usr/bin/env bash
# Download the wheels the H200 image lacks for `convserve serve` (and bench/bench_service.py) into .whl/.
#
# The device image has torch, triton, numpy, msgpack, httpx, rich, uvloop, anyio, h11, click and safetensors.
# It lacks the web stack: fastapi and starlette, uvicorn (+ httptools), pydantic (+ core, settings, dotenv,
# annotated-types, typing-inspection), websockets, opentelemetry-api (a fastapi requirement), pyzmq (the engine process) and ml-dtypes (the
# client's bfloat16 numpy arrays); typing-extensions,
# annotated-doc and prometheus-client are carried too because pydantic 2.14 / fastapi need
# newer ones than the image may hold. Pinned to the versions the CPU venv is tested with; CPython 3.12, x86-64.
#
#   bench/wheels.sh            # from the repo root; then carry .whl on the device and run:
#   python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
#   export PYTHONPATH=/tmp/site
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
WHEELS=(
  fastapi==0.165.0
  starlette==1.10.0
  uvicorn==0.54.0
  httptools==0.9.0
  pydantic==2.14.4
  pydantic-core==2.50.5
  pydantic-settings==2.16.3
  python-dotenv==1.2.4
  annotated-types==0.8.0
  annotated-doc==0.0.7
  typing-inspection==0.4.5
  typing-extensions==4.16.0
  prometheus-client==0.26.0
  websockets==17.4
  opentelemetry-api==1.45.2
  ml-dtypes==0.6.0
  pyzmq==27.3.0
)
mkdir -p .whl
for w in "${WHEELS[@]}"; do
  "$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 --platform manylinux1_x86_64 --platform manylinux_2_5_x86_64 \
    -d .whl "$w"
done
du -sh .whl
ls .whl
