#!/usr/bin/env bash
# Throughput-vs-latency sweep of `deepinfer serve`: one JSON row per point, Pareto fronts as a PNG.
#
#   examples/sweep/run_sweep.sh                 # the embedded model on the CPU, a few minutes
#   MODEL=/path/to/ckpt SERVE_ARGS="--dtype bfloat16" CONCURRENCY="1 8 32 64 128 256" MAX_NUM_SEQS="64 256" \
#     PREFILL_INPUT_LEN=4096 DECODE_INPUT_LEN=1024 DECODE_OUTPUT_LEN=1024 examples/sweep/run_sweep.sh
#
# For each DSpark setting (DSPARK="off", "on" or "off on") and server batch size (MAX_NUM_SEQS, one server
# each), at each client concurrency (CONCURRENCY) it runs two points with `deepinfer bench serve`:
#   prefill: PREFILL_INPUT_LEN-token prompts, 1 output token   -> input tokens/s per device vs TTFT
#   decode:  DECODE_INPUT_LEN-token prompts, DECODE_OUTPUT_LEN -> output tokens/s per device vs tokens/s per user
# Rows go to $OUT/sweep.jsonl (throughputs, per-user tokens/s, TTFT / TPOT / ITL / e2e percentiles, settings);
# examples/sweep/plot_pareto.py draws $OUT/pareto.png. DSPARK=on starts the server with DSpark drafting
# (DEEPINFER_USE_NEXTN_DECODE=$DSPARK_K, default 4, at most the drafter's block size) and confidence-scheduled
# verification (DEEPINFER_ENABLE_MTP_VARLEN=1); DSPARK=off with DEEPINFER_USE_NEXTN_DECODE=0.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
PYTHON="${PYTHON:-python}"
OUT="${OUT:-sweep_out}"
MODEL="${MODEL:-}"
SERVE_ARGS="${SERVE_ARGS:---dtype float32}"
CONCURRENCY="${CONCURRENCY:-1 2 4 8 16}"
MAX_NUM_SEQS="${MAX_NUM_SEQS:-16}"
DSPARK="${DSPARK:-off}"
NUM_DEVICES="${NUM_DEVICES:-1}"
PREFILL_INPUT_LEN="${PREFILL_INPUT_LEN:-256}"
DECODE_INPUT_LEN="${DECODE_INPUT_LEN:-32}"
DECODE_OUTPUT_LEN="${DECODE_OUTPUT_LEN:-48}"
ROUNDS="${ROUNDS:-4}"            # prompts per point = ROUNDS * concurrency (at least 4)
PORT="${PORT:-8123}"
mkdir -p "$OUT"
rows="$OUT/sweep.jsonl"
: > "$rows"

server_pid=""
stop_server() {
  if [ -n "$server_pid" ]; then kill "$server_pid" 2>/dev/null || true; wait "$server_pid" 2>/dev/null || true; fi
  server_pid=""
}
trap stop_server EXIT

start_server() {  # $1 = max_num_seqs, $2 = dspark on|off
  local mtp=0 k=0; [ "$2" = on ] && mtp=1 && k="${DSPARK_K:-4}"
  # shellcheck disable=SC2086  # SERVE_ARGS is a list of flags
  DEEPINFER_ENABLE_MTP_VARLEN=$mtp DEEPINFER_USE_NEXTN_DECODE=$k "$PYTHON" -m deepinfer serve $MODEL $SERVE_ARGS --max-num-seqs "$1" \
    --port "$PORT" > "$OUT/server_$1_$2.log" 2>&1 &
  server_pid=$!
  for _ in $(seq 600); do
    if "$PYTHON" -c "import httpx,sys; sys.exit(httpx.get('http://127.0.0.1:$PORT/health').status_code != 200)" \
        2>/dev/null; then return 0; fi
    kill -0 "$server_pid" 2>/dev/null || { echo "server failed; see $OUT/server_$1_$2.log" >&2; exit 1; }
    sleep 0.5
  done
  echo "server did not come up; see $OUT/server_$1_$2.log" >&2; exit 1
}

point() {  # $1 phase, $2 concurrency, $3 input len, $4 output len, $5 extra json
  local n=$(( ROUNDS * $2 )); [ "$n" -lt 4 ] && n=4
  "$PYTHON" -m deepinfer bench serve --base-url "http://127.0.0.1:$PORT" --label "$1" --max-concurrency "$2" \
    --num-prompts "$n" --input-len "$3" --output-len "$4" --num-devices "$NUM_DEVICES" --extra "$5" \
    --result-json "$rows" --append > /dev/null
}

for dspark in $DSPARK; do
  for seqs in $MAX_NUM_SEQS; do
    start_server "$seqs" "$dspark"
    for c in $CONCURRENCY; do
      extra="{\"max_num_seqs\": $seqs, \"dspark\": \"$dspark\"}"
      point prefill "$c" "$PREFILL_INPUT_LEN" 1 "$extra"
      point decode "$c" "$DECODE_INPUT_LEN" "$DECODE_OUTPUT_LEN" "$extra"
      echo "dspark=$dspark max_num_seqs=$seqs concurrency=$c: done"
    done
    stop_server
  done
done
"$PYTHON" "$here/plot_pareto.py" "$rows" "$OUT/pareto.png"
echo "rows: $rows  plot: $OUT/pareto.png"
