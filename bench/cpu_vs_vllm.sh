#!/usr/bin/env bash
# Loom against vLLM's CPU build on one CPU-only box (issue 14's CPU target): the same model under
# the same name, the same --max-model-len, dtype and port, one server at a time, both driven by the
# same load generator (`loom bench serve`, greedy like `vllm bench serve`), alternated for N pairs
# (ABBA order, so neither always runs second). Prints, per run, output tok/s, TTFT and ITL p50,
# the server's CPU seconds (every process of it: API server, engine core, workers) per output
# token and the 1-minute load average before / after; then Loom / vLLM per pair.
#   VLLM=/opt/vllm-cpu/bin/vllm bench/cpu_vs_vllm.sh MODEL_DIR [PAIRS] [loom bench serve options...]
# Default load: 256 prompts x 64 in / 128 out at concurrency 32. Install vLLM's CPU build first:
# docs/performance.md ("The CPU path, and vLLM's CPU build beside Loom"). Threads: each server
# keeps its own default (Loom's CPU worker: one torch thread per core less one; vLLM:
# VLLM_CPU_OMP_THREADS_BIND=auto); both logs' thread lines are printed. Run from the repo root.
set -eu
MODEL=$1; PAIRS=${2:-3}; shift; [ $# -gt 0 ] && shift
ARGS=("$@"); [ ${#ARGS[@]} -eq 0 ] && ARGS=(--random-input-len 64 --random-output-len 128 --num-prompts 256
                                            --max-concurrency 32)
PY=${PYTHON:-python3}
VLLM=${VLLM:-/opt/vllm-cpu/bin/vllm}
NAME=${SERVED_NAME:-demo}; MAXLEN=${MAX_MODEL_LEN:-512}; DTYPE=${DTYPE:-float32}
PORT=$($PY -c "import socket; s=socket.socket(); s.bind(('127.0.0.1', 0)); print(s.getsockname()[1])")
LOGS=${LOGS:-$(mktemp -d)}
mkdir -p "$LOGS"; ROWS=$LOGS/rows.tsv; : > "$ROWS"
HZ=$(getconf CLK_TCK)
SERVER=

start_loom() {
    setsid $PY -m frontend.entrypoints.cli serve "$MODEL" --served-model-name "$NAME" --max-model-len "$MAXLEN" \
        --dtype "$DTYPE" --port "$PORT" ${LOOM_ARGS:-} > "$1" 2>&1 & SERVER=$!
}
start_vllm() {
    VLLM_TARGET_DEVICE=cpu VLLM_CPU_KVCACHE_SPACE=${VLLM_CPU_KVCACHE_SPACE:-1} setsid "$VLLM" serve "$MODEL" \
        --served-model-name "$NAME" --max-model-len "$MAXLEN" --dtype "$DTYPE" --port "$PORT" \
        ${VLLM_ARGS:-} > "$1" 2>&1 & SERVER=$!
}
stop() {  # the server's whole process group (setsid made it its own), SIGINT then SIGKILL
    [ -n "$SERVER" ] || return 0
    kill -INT -- -"$SERVER" 2>/dev/null || true
    for _ in $(seq 60); do kill -0 "$SERVER" 2>/dev/null || break; sleep 0.5; done
    kill -KILL -- -"$SERVER" 2>/dev/null || true
    wait "$SERVER" 2>/dev/null || true
    SERVER=
    for _ in $(seq 60); do ss -ltnH "sport = :$PORT" | grep -q . || break; sleep 0.5; done
}
trap stop EXIT

ticks() { awk '{print $14 + $15}' "/proc/$1/stat" 2>/dev/null || echo 0; }   # utime + stime, in clock ticks
tree() { echo "$1"; for c in $(ps -o pid= --ppid "$1"); do tree "$c"; done; }
server_ticks() { local t=0; for p in $(tree "$SERVER"); do t=$((t + $(ticks "$p"))); done; echo $t; }
load1() { cut -d' ' -f1 /proc/loadavg; }

run() {  # SERVER_KIND PAIR
    local log=$LOGS/$1-$2.log res=$LOGS/$1-$2.json
    "start_$1" "$log"
    for _ in $(seq 1200); do curl -sf "localhost:$PORT/health" > /dev/null && break
        kill -0 "$SERVER" 2>/dev/null || { tail -20 "$log"; exit 1; }; sleep 0.5; done
    # one short request first (`loom bench serve`'s own test request), so neither pays a first-call cost
    local l0 t0 t1 l1
    l0=$(load1); t0=$(server_ticks)
    $PY -m frontend.entrypoints.cli bench serve --base-url "http://127.0.0.1:$PORT" --model "$NAME" --disable-tqdm \
        --temperature 0 --result-file "$res" "${ARGS[@]}" > "$log.bench" 2>&1 \
        || [ -s "$res" ] || { cat "$log.bench"; exit 1; }   # failed requests: kept, and marked in the table
    t1=$(server_ticks); l1=$(load1)
    stop
    printf '%s\t%s\t%s\t%s\t%s\t%s\n' "$2" "$1" "$res" "$(( t1 - t0 ))" "$l0" "$l1" >> "$ROWS"
    tail -1 "$ROWS"
}

echo "logs: $LOGS; port $PORT; model $MODEL as '$NAME', --max-model-len $MAXLEN, --dtype $DTYPE; load: ${ARGS[*]}"
for p in $(seq "$PAIRS"); do
    if [ $((p % 2)) -eq 1 ]; then run loom "$p"; run vllm "$p"; else run vllm "$p"; run loom "$p"; fi
done
echo "threads (pair 1's logs):"
grep -h -E "torch threads|Torch threads|core ids=|reserved_cpus=" "$LOGS"/loom-1.log "$LOGS"/vllm-1.log | cut -c1-160 || true
$PY - "$ROWS" "$HZ" <<'EOF'
import json, sys
rows, hz = [l.rstrip("\n").split("\t") for l in open(sys.argv[1])], int(sys.argv[2])
by = {}
print(f"{'pair':>4} {'server':>6} {'out tok/s':>10} {'TTFT p50':>10} {'ITL p50':>9} {'CPU s':>7} "
      f"{'CPU ms/tok':>10} {'load1 before/after':>19}")
for pair, kind, res, ticks, l0, l1 in rows:
    m = json.load(open(res))
    cpu = int(ticks) / hz
    by.setdefault(pair, {})[kind] = m["output_throughput"]
    print(f"{pair:>4} {kind:>6} {m['output_throughput']:>10.1f} {m['median_ttft_ms']:>8.0f}ms "
          f"{m['median_itl_ms']:>7.1f}ms {cpu:>7.2f} {1000 * cpu / max(m['total_output_tokens'], 1):>10.3f} "
          f"{l0:>9}/{l1:<9}" + (f" FAILED {m['failed']}" if m["failed"] else ""))
ratios = [v["loom"] / v["vllm"] for v in by.values() if v.get("vllm")]
print("Loom / vLLM output tok/s, per pair: " + ", ".join(f"{r:.2f}x" for r in ratios))
EOF
