#!/usr/bin/env bash
# Issue 13's frontend scenario on a lent GPU machine, in one call: a server of 8 layers x dim 4096 (bf16) in the
# default layout on CPUs 0-7, `convserve-loadtest --scenario frontend` on CPUs 8-15, measured past the ramp
# (sessions that keep decoding), through the sealed arena at 1 and 256 sessions, through bodies at 256, and with
# speculative verifies of 4 tokens (and their accepts) through the sealed arena at 256.
#
#   bash bench/frontend_check.sh          # on the device (run with carry [".whl"]); results under $OUT/frontend-*
#
# SERVER_CPUS, CLIENT_CPUS (0-7, 8-15), LAYERS, DIM (8, 4096), DURATION (12 s), WARMUP (15 s) and PYTHON change
# the defaults; SERVER_ARGS adds flags to `convserve serve` (e.g. "--workers 0": the engine in the HTTP process);
# UDS=1 has the server listen on a Unix socket too and every leg's calls go through it; LEGS (sealed,bodies,
# sealed-spec4; also bodies-spec4 and ws-spec4: verify steps at 1 and 64 sessions, accepts POSTed or pipelined as
# WebSocket frames; ws-sealed and ws-sealed-spec4: the WebSocket's frames with x and y in the sealed arena) picks
# the legs. The warm-up covers the ramp: the sessions' prefills go in steps of up to max_batch_tokens tokens
# (67 MB a layer call at dim 4096 through bodies), and a step begun after the warm-up is measured as a decode step
# would be.
# Each leg's table is in $OUT/frontend-<leg>.txt and its JSON in $OUT/frontend-<leg>/loadtest.json.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/frontend-check}
DURATION=${DURATION:-12}
PY=${PYTHON:-python3}
mkdir -p "$OUT"
if ! "$PY" -c 'import fastapi' 2> /dev/null; then    # the device image: the carried wheels
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
  export PYTHONPATH=/tmp/site
fi
export PYTHONPATH=${PYTHONPATH:+$PYTHONPATH:}$PWD/src PYTHONUNBUFFERED=1
port=8471
uds=()
if [[ ${UDS:-0} == 1 ]]; then
  uds=(--uds "$OUT/convserve.sock")
fi
taskset -c "${SERVER_CPUS:-0-7}" "$PY" -m convserve.service serve --host 127.0.0.1 --port $port "${uds[@]}" \
  --layers "${LAYERS:-8}" --dim "${DIM:-4096}" --dtype bfloat16 --client-shm ${SERVER_ARGS:-} > "$OUT/server.log" 2>&1 &
server=$!
"$PY" - "$port" <<'PY'
import sys, time, urllib.request
for _ in range(480):
    try:
        urllib.request.urlopen(f"http://127.0.0.1:{sys.argv[1]}/readyz", timeout=2)
        break
    except OSError:
        time.sleep(0.5)
PY
leg() {  # name, then the load tester's extra flags
  local name=$1; shift
  [[ ,${LEGS:-sealed,bodies,sealed-spec4}, == *,$name,* ]] || return 0
  taskset -c "${CLIENT_CPUS:-8-15}" "$PY" -m convserve.clients.loadtest --url "http://127.0.0.1:$port" "${uds[@]}" \
    --scenario frontend \
    --prefill uniform:16:128 --decode const:4000 --warmup "${WARMUP:-15}" --duration "$DURATION" --no-progress \
    --out "$OUT/frontend-$name" "$@" > "$OUT/frontend-$name.txt" 2>&1
  echo "$name: exit $?"
  tail -n 25 "$OUT/frontend-$name.txt"
}
leg sealed --concurrency 1,256 --shm-mib 64 --shm-sealed
leg bodies --concurrency 256
leg sealed-spec4 --concurrency 256 --shm-mib 64 --shm-sealed --spec-k const:4
# verify steps with their accepts POSTed, against batch frames on a WebSocket with the accept a frame not waited for
leg bodies-spec4 --concurrency 1,64 --spec-k const:4
leg ws-spec4 --concurrency 1,64 --spec-k const:4 --transport ws
# the same frames naming blocks of the sealed arena: decode steps against the sealed leg, verify steps against ws-spec4
leg ws-sealed --concurrency 1,256 --shm-mib 64 --shm-sealed --transport ws
leg ws-sealed-spec4 --concurrency 1,64 --shm-mib 64 --shm-sealed --spec-k const:4 --transport ws
rm -f "$OUT"/frontend-*/loadtest.png "$OUT"/frontend-*/loadtest.html    # the tables and JSON are the record
kill -TERM $server
wait $server
echo "server exit $?"
