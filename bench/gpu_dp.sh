#!/usr/bin/env bash
# Data parallelism on 2 GPUs (issue 15's targets, nvidia-h200-x2), in one device call (~6 min):
#   1. Qwen3-0.6B standard offline workload: `loom bench throughput --data-parallel-size 2` vs 1;
#   2. `loom bench serve` at concurrency 512, 512 in / 256 out: DP=2 with 2 API servers vs DP=1.
# Prints both ratios (targets >= 1.8x), and where the time went: for offline, the client process's
# CPU and each engine's steps and ms per step; for serve, the CPU seconds of the API servers and of
# the load generator (LOADGEN_PROCS processes, default 4) against the run's duration.
# Logs and JSON results go to $OUT (or /tmp/loom-bench-dp).
set -u
OUT=${OUT:-/tmp/loom-bench-dp}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 LOOM_LOG_LEVEL=${LOOM_LOG_LEVEL:-WARNING}
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1   # NVLink multicast stays off on the lent machines
LOOM="python3 -m frontend.entrypoints.cli"
PORT=8123
NUM_PROMPTS=${NUM_PROMPTS:-4096}   # ~15-30 s per run: the ramp-up and the tail stay a small part
LOADGEN_PROCS=${LOADGEN_PROCS:-4}
HZ=$(getconf CLK_TCK)

offline() {  # offline DP: tok/s of the standard workload
  local dp=$1
  echo "--- offline DP=$dp"
  timeout 240 $LOOM bench throughput --preset qwen3-0.6b --data-parallel-size "$dp" \
    --output-json "$OUT/offline-dp$dp.json" > "$OUT/offline-dp$dp.log" 2>&1 || echo "(offline DP=$dp exit $?)"
  grep -E "Throughput|Tokens:|Standard|Client process CPU|^Engine [0-9]" "$OUT/offline-dp$dp.log"
}

ticks() { awk '{print $14 + $15}' "/proc/$1/stat" 2>/dev/null || echo 0; }   # utime + stime, clock ticks
api_pids() {  # the API servers: children of loom serve without children (engine cores have workers)
  for c in $(cat /proc/"$1"/task/*/children 2>/dev/null); do
    [ -z "$(cat /proc/"$c"/task/*/children 2>/dev/null)" ] && ! tr '\0' ' ' < "/proc/$c/cmdline" | grep -q resource_tracker \
      && echo "$c"
  done
}

serve() {  # serve DP API_SERVERS: bench serve at c512, 512 in / 256 out
  local dp=$1 api=$2
  echo "--- serve DP=$dp, $api API server(s)"
  $LOOM serve /tmp/q3 --load-format dummy --max-model-len 4096 --port $PORT --data-parallel-size "$dp" \
    --api-server-count "$api" --disable-log-stats > "$OUT/server-dp$dp-api$api.log" 2>&1 & local pid=$!
  for _ in $(seq 180); do curl -sf localhost:$PORT/health > /dev/null && break; sleep 1; done
  local apis; apis=$(api_pids $pid); local t0=0 t1=0 p
  for p in $apis; do t0=$((t0 + $(ticks "$p"))); done
  local TIMEFORMAT="load generator ($LOADGEN_PROCS processes) CPU: %U s user + %S s sys in %R s"
  time (timeout 200 $LOOM bench serve --base-url http://127.0.0.1:$PORT --random-input-len 512 --random-output-len 256 \
    --num-prompts "$NUM_PROMPTS" --max-concurrency 512 --result-file "$OUT/serve-dp$dp-api$api.json" --disable-tqdm \
    --num-processes "$LOADGEN_PROCS" > "$OUT/serve-dp$dp-api$api.log" 2>&1 || echo "(bench serve DP=$dp exit $?)")
  for p in $apis; do t1=$((t1 + $(ticks "$p"))); done
  grep -E "throughput|Successful|Failed|Benchmark duration" "$OUT/serve-dp$dp-api$api.log"
  echo "API servers ($(echo $apis | wc -w) processes) CPU: $(awk -v t=$((t1 - t0)) -v hz="$HZ" 'BEGIN{printf "%.1f", t / hz}') s"
  curl -s localhost:$PORT/metrics | per_engine
  kill -INT $pid; wait $pid
}

per_engine() {  # from /metrics: per engine, requests done, mean queue time and mean time per output token
  python3 -c '
import re, sys
v = {}
for line in sys.stdin:
    m = re.match(r"(vllm:\w+)\{(.*)\} (\S+)$", line.strip())
    e = m and re.search(r"engine=.(\d+).", m.group(2))
    if e:
        key = (m.group(1), e.group(1))
        v[key] = v.get(key, 0.0) + float(m.group(3))
def mean(name, e):
    n = v.get((name + "_count", e), 0.0)
    return 1e3 * v.get((name + "_sum", e), 0.0) / n if n else float("nan")
for e in sorted({e for _, e in v}):
    done = v.get(("vllm:request_success_total", e), 0.0)
    queue, tpot = mean("vllm:request_queue_time_seconds", e), mean("vllm:request_time_per_output_token_seconds", e)
    print("engine %s: %.0f requests, mean queue %.1f ms, mean TPOT %.2f ms" % (e, done, queue, tpot))
'
}

ratio() {  # ratio KEY A.json B.json
  python3 -c "import json,sys; k,a,b=sys.argv[1:]; va,vb=(json.load(open(f))[k] for f in (a,b)); print(f'{vb/va:.2f}x ({va:,.0f} -> {vb:,.0f})')" "$@" \
    2>/dev/null || echo "n/a (a run failed: see $OUT)"
}

PARTS=${PARTS:-offline serve serve4}   # a subset reruns one part
if [[ " $PARTS " == *" offline "* ]]; then
  echo "=== offline, standard workload, DP=1 then DP=2"
  # a machine's first run has prefill steps twice as slow (bench/RESULTS.md, session 4): not DP=1's
  timeout 120 $LOOM bench throughput --preset qwen3-0.6b --num-prompts 64 > "$OUT/warmup.log" 2>&1
  offline 1
  offline 2
fi
$LOOM bench preset qwen3-0.6b /tmp/q3 > /dev/null
if [[ " $PARTS " == *" serve "* ]]; then
  echo "=== serve c512 512/256 ($NUM_PROMPTS prompts), DP=1 (1 API server) then DP=2 (2 API servers)"
  serve 1 1
  serve 2 2
fi
if [[ " $PARTS " == *" serve4 "* ]]; then
  echo "=== serve DP=2 with 4 API servers (are 2 the limit?)"
  serve 2 4
fi
echo "offline DP=2 / DP=1 output tok/s: $(ratio output_tok_per_s "$OUT/offline-dp1.json" "$OUT/offline-dp2.json")   (target >= 1.8x)"
echo "serve   DP=2 / DP=1 output tok/s: $(ratio output_throughput "$OUT/serve-dp1-api1.json" "$OUT/serve-dp2-api2.json")   (target >= 1.8x)"
echo "serve   DP=2 4 API servers / 2:   $(ratio output_throughput "$OUT/serve-dp2-api2.json" "$OUT/serve-dp2-api4.json")   (diagnostic: > 1.05x means 2 API servers are the limit)"
