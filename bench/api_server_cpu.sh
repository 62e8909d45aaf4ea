#!/usr/bin/env bash
# CPU seconds that one API-server process spends streaming a `loom bench serve` run: the cost of
# the serving path per token, measured on any machine (a CPU box with a tiny model will do); and
# the CPU seconds of the whole server (API server, engine core, workers) per output token.
#   bench/api_server_cpu.sh MODEL_DIR [loom bench serve options...]
# Default load: 256 requests x 16/128 tokens at concurrency 128 (32,768 streamed tokens).
# Run from the repository root; compare two commits by running it in both trees, alternately.
set -eu
MODEL=$1; shift
ARGS=("$@"); [ ${#ARGS[@]} -eq 0 ] && ARGS=(--random-input-len 16 --random-output-len 128 --num-prompts 256
                                            --max-concurrency 128)
PY=${PYTHON:-python3}
PORT=$($PY -c "import socket; s=socket.socket(); s.bind(('127.0.0.1', 0)); print(s.getsockname()[1])")
LOG=$(mktemp)
$PY -m frontend.entrypoints.cli serve "$MODEL" --port "$PORT" --max-model-len 512 ${SERVE_ARGS:-} > "$LOG" 2>&1 & SERVER=$!
trap 'kill -INT $SERVER 2>/dev/null; wait $SERVER; rm -f "$LOG"' EXIT
for _ in $(seq 300); do curl -sf "localhost:$PORT/health" > /dev/null && break; sleep 0.5; done
API=$(ss -ltnpH "sport = :$PORT" | grep -o 'pid=[0-9]*' | head -1 | cut -d= -f2)
ticks() { awk '{print $14 + $15}' "/proc/$1/stat" 2>/dev/null || echo 0; }   # utime + stime, in clock ticks
tree() { echo "$1"; for c in $(ps -o pid= --ppid "$1"); do tree "$c"; done; }
server_ticks() { local t=0; for p in $(tree $SERVER); do t=$((t + $(ticks "$p"))); done; echo $t; }
before=$(ticks $API); all_before=$(server_ticks)
OUT=$($PY -m frontend.entrypoints.cli bench serve --base-url "http://127.0.0.1:$PORT" --disable-tqdm "${ARGS[@]}")
after=$(ticks $API); all_after=$(server_ticks)
echo "$OUT" | grep -E "Output token throughput|Median ITL|Median TTFT"
TOKENS=$(echo "$OUT" | awk -F: '/Total generated tokens/ {print $2 + 0}')
HZ=$(getconf CLK_TCK)
echo "API server CPU: $(awk -v t=$((after - before)) -v hz="$HZ" 'BEGIN{printf "%.2f", t / hz}') s"
awk -v t=$((all_after - all_before)) -v hz="$HZ" -v n="$TOKENS" \
    'BEGIN{printf "Server CPU (all processes): %.2f s, %.1f ms per output token\n", t / hz, 1000 * t / hz / n}'
