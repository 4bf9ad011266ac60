#!/bin/bash
# A local P/D cluster from plain `hybridpd serve` / `hybridpd proxy` lines (what `hybridpd up` does for you).
#
#   MODEL=/path/to/checkpoint NUM_PREFILL_INSTANCES=2 deploy/run_local.sh
#
# Env vars (defaults in brackets):
#   MODEL                  checkpoint directory [empty: the built-in default model]
#   NUM_PREFILL_INSTANCES  [1]      NUM_DECODE_INSTANCES  [1]
#   PREFILL_PORT           first prefill node's HTTP port [8100]; node i uses PREFILL_PORT + i
#   DECODE_PORT            first decode node's HTTP port [8200]; node i uses DECODE_PORT + i
#   KV_PORT_OFFSET         side-channel (gRPC) port = HTTP port + this [1000]
#   PROXY_PORT             [8000]   HOST  bind address [127.0.0.1]
#   THREADS                torch threads per node [1]
#   CLUSTER_TOKEN_FILE     shared secret for KV requests and the side channel [unset: no token]
#   LOG_DIR                [./hybridpd-logs]
#   PYTHON                 [python3]; HYBRIDPD defaults to "$PYTHON -m hybridpd"
#   SERVE_ARGS             extra flags for every node, e.g. "--block-size 32"
# Ctrl-C (or the end of the script) stops every process it started.
set -euo pipefail

MODEL=${MODEL:-}
NUM_PREFILL_INSTANCES=${NUM_PREFILL_INSTANCES:-1}
NUM_DECODE_INSTANCES=${NUM_DECODE_INSTANCES:-1}
PREFILL_PORT=${PREFILL_PORT:-8100}
DECODE_PORT=${DECODE_PORT:-8200}
KV_PORT_OFFSET=${KV_PORT_OFFSET:-1000}
PROXY_PORT=${PROXY_PORT:-8000}
HOST=${HOST:-127.0.0.1}
THREADS=${THREADS:-1}
CLUSTER_TOKEN_FILE=${CLUSTER_TOKEN_FILE:-}
LOG_DIR=${LOG_DIR:-./hybridpd-logs}
PYTHON=${PYTHON:-python3}
HYBRIDPD=${HYBRIDPD:-"$PYTHON -m hybridpd"}
SERVE_ARGS=${SERVE_ARGS:-}
STARTUP_TIMEOUT=${STARTUP_TIMEOUT:-600}

mkdir -p "$LOG_DIR"
PIDS=()

cleanup() {
  echo "Stopping ${#PIDS[@]} processes ..."
  for pid in "${PIDS[@]}"; do kill -TERM "$pid" 2>/dev/null || true; done
  for pid in "${PIDS[@]}"; do
    for _ in $(seq 1 20); do kill -0 "$pid" 2>/dev/null || break; sleep 0.5; done
    kill -KILL "$pid" 2>/dev/null || true
  done
}
trap cleanup EXIT
trap 'exit 130' INT TERM

# Waits until GET /health answers 200 (or the process died, or the timeout passed).
wait_for_server() {
  local port=$1 pid=$2
  local deadline=$((SECONDS + STARTUP_TIMEOUT))
  until curl -sf "http://${HOST}:${port}/health" > /dev/null; do
    if ! kill -0 "$pid" 2>/dev/null; then echo "process on port $port died; see $LOG_DIR"; return 1; fi
    if (( SECONDS > deadline )); then echo "port $port not healthy after ${STARTUP_TIMEOUT}s"; return 1; fi
    sleep 1
  done
}

TOKEN_ARGS=()
if [[ -n "$CLUSTER_TOKEN_FILE" ]]; then TOKEN_ARGS=(--cluster-token-file "$CLUSTER_TOKEN_FILE"); fi

# Every node is kv_both; the proxy decides which one prefills and which one decodes.
start_node() {
  local name=$1 port=$2
  # shellcheck disable=SC2086  # SERVE_ARGS is split on purpose
  $HYBRIDPD serve $MODEL --host "$HOST" --port "$port" --kv-port $((port + KV_PORT_OFFSET)) \
    --threads "$THREADS" "${TOKEN_ARGS[@]}" $SERVE_ARGS > "$LOG_DIR/$name.log" 2>&1 &
  PIDS+=($!)
  echo "Started $name: http://$HOST:$port (side channel :$((port + KV_PORT_OFFSET)), log $LOG_DIR/$name.log)"
}

PREFILL_HOSTS=(); PREFILL_PORTS=(); DECODE_HOSTS=(); DECODE_PORTS=()
for i in $(seq 0 $((NUM_PREFILL_INSTANCES - 1))); do
  start_node "prefill-$i" $((PREFILL_PORT + i))
  PREFILL_HOSTS+=("$HOST"); PREFILL_PORTS+=($((PREFILL_PORT + i)))
done
for i in $(seq 0 $((NUM_DECODE_INSTANCES - 1))); do
  start_node "decode-$i" $((DECODE_PORT + i))
  DECODE_HOSTS+=("$HOST"); DECODE_PORTS+=($((DECODE_PORT + i)))
done

index=0
for port in "${PREFILL_PORTS[@]}" "${DECODE_PORTS[@]}"; do
  echo "Waiting for the node on port $port ..."
  wait_for_server "$port" "${PIDS[$index]}"
  index=$((index + 1))
done

$HYBRIDPD proxy --host "$HOST" --port "$PROXY_PORT" \
  --prefiller-hosts "${PREFILL_HOSTS[@]}" --prefiller-ports "${PREFILL_PORTS[@]}" \
  --decoder-hosts "${DECODE_HOSTS[@]}" --decoder-ports "${DECODE_PORTS[@]}" \
  "${TOKEN_ARGS[@]}" > "$LOG_DIR/proxy.log" 2>&1 &
PIDS+=($!)
wait_for_server "$PROXY_PORT" "${PIDS[-1]}"

echo "Proxy ready: http://$HOST:$PROXY_PORT/v1/completions  (health: /health, metrics: /metrics)"
echo "Try: curl -s http://$HOST:$PROXY_PORT/v1/completions -H 'Content-Type: application/json' \\"
echo "       -d '{\"prompt\": \"Hello\", \"max_tokens\": 16, \"temperature\": 0}'"
echo "Press Ctrl-C to stop."
wait -n "${PIDS[@]}" || true
echo "A process exited; stopping the rest (logs in $LOG_DIR)."
exit 1
