#!/usr/bin/env bash
# The GPU benchmark runs recorded in bench/RESULTS.md, as run through the device tool:
#   bench/gpu_suite.sh SECTION...   (sections below; logs go to $OUT or /tmp/loom-bench)
# On the device image first: pip install the .whl/ wheels (pyzmq, msgspec) into .site.
set -u
OUT=${OUT:-/tmp/loom-bench}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 LOOM_LOG_LEVEL=${LOOM_LOG_LEVEL:-WARNING}
LOOM="python3 -m frontend.entrypoints.cli"
run() {  # run NAME TIMEOUT CMD...: full log to $OUT/NAME.log, the last lines to stdout
  local name=$1 t=$2; shift 2
  echo "=== $name: $*"
  timeout "$t" "$@" > "$OUT/$name.log" 2>&1; echo "(exit $?)"
  grep -v -P "^\s*$|it/s\]|WARNING (?!step stats|Triton)" "$OUT/$name.log" | tail -n "${TAIL:-8}"
}
for section in "$@"; do case $section in
  gpu-tests) run gpu-tests 420 python3 -m pytest -q -p no:cacheprovider tests/test_gpu.py ;;
  rl-gpu) run rl-gpu 300 python3 -m pytest -q -p no:cacheprovider tests/test_weight_update_gpu.py ;;
  kernels) run kernels 200 python3 -m bench.kernels_gpu ;;
  qwen3) run qwen3-throughput 200 $LOOM bench throughput --preset qwen3-0.6b ;;
  qwen3-stats) LOOM_STEP_STATS=1 TAIL=40 run qwen3-throughput-stats 200 $LOOM bench throughput --preset qwen3-0.6b ;;
  qwen3-latency-stats) LOOM_STEP_STATS=1 TAIL=20 run qwen3-latency-stats 200 $LOOM bench latency --preset qwen3-0.6b --iters 3 ;;
  llama8b-stats) LOOM_STEP_STATS=1 TAIL=30 run llama8b-throughput-stats 300 $LOOM bench throughput --preset llama-3.1-8b ;;
  sampling) LOOM_STEP_STATS=1 TAIL=40 run qwen3-sampling 500 $LOOM bench throughput --preset qwen3-0.6b \
              --sampling plain topp penalties logprobs n4seed --output-json "$OUT/sampling.json" ;;
  logprobs) # issue 14's logprobs=5 target alone: host CPU per token of each stage, the sampler's device
            # time with and without logprobs (kernels), then the offline ratio to plain in one engine
            TAIL=4 run logprobs-host 300 python3 -m bench.logprobs_host --steps 500
            TAIL=8 run logprobs-sampler 200 python3 -m bench.kernels_gpu --parts logprobs
            LOOM_STEP_STATS=1 TAIL=12 run qwen3-logprobs 300 $LOOM bench throughput --preset qwen3-0.6b \
              --sampling plain logprobs --output-json "$OUT/logprobs.json" ;;
  qwen3-sync) run qwen3-throughput-sync 200 $LOOM bench throughput --preset qwen3-0.6b --no-async-scheduling ;;
  qwen3-latency) run qwen3-latency 200 $LOOM bench latency --preset qwen3-0.6b --input-len 128 1024 --output-len 128 1024 --iters 3 ;;
  qwen3-profile) LOOM_PROFILE_DIR=$OUT/prof run qwen3-latency-profiled 200 $LOOM bench latency --preset qwen3-0.6b --iters 2
                 python3 -m ipc.profiling "$OUT/prof" 18 | cut -c1-150 > "$OUT/profile.txt"; head -c 6000 "$OUT/profile.txt" ;;
  qwen3-hf) run qwen3-vs-hf 300 $LOOM bench throughput --preset qwen3-0.6b --num-prompts 256 --input-len 512 --output-len 256 --compare-hf ;;
  llama8b) run llama8b-throughput 300 $LOOM bench throughput --preset llama-3.1-8b ;;
  models) # issue 44: Mistral-7B and Gemma-2-9B shapes against Llama-3.1-8B scaled by parameter bytes
          for p in llama-3.1-8b mistral-7b gemma-2-9b; do
            run tput-$p 400 $LOOM bench throughput --preset $p --output-json "$OUT/tput-$p.json"; done
          python3 -m bench.model_ratios "$OUT" ;;
  llama8b-latency) run llama8b-latency 200 $LOOM bench latency --preset llama-3.1-8b --iters 3 ;;
  generic) # issue 44: the generic transformers path vs the native one on Llama-3.1-8B shapes (dummy weights):
           # offline throughput (the standard workload) and batch-1 TPOT, each pair in this one call
           for impl in loom transformers; do
             run llama8b-$impl-throughput 400 $LOOM bench throughput --preset llama-3.1-8b --model-impl $impl \
               --output-json "$OUT/generic-$impl-throughput.json"
             run llama8b-$impl-latency 300 $LOOM bench latency --preset llama-3.1-8b --iters 3 --model-impl $impl \
               --output-json "$OUT/generic-$impl-latency.json"
           done
           python3 - "$OUT" <<'PY'
import json, sys
out = sys.argv[1]
def read(name):
    try:
        with open(f"{out}/generic-{name}.json") as f:
            return json.load(f)
    except OSError:
        return None
tp = {i: read(f"{i}-throughput") for i in ("loom", "transformers")}
lat = {i: read(f"{i}-latency") for i in ("loom", "transformers")}
if all(tp.values()):
    n, g = tp["loom"]["output_tok_per_s"], tp["transformers"]["output_tok_per_s"]
    print(f"generic/native output tok/s: {g:.0f} / {n:.0f} = {g / n:.3f} (target >= 0.90)")
if all(lat.values()):
    n, g = lat["loom"]["runs"][0]["tpot_ms"], lat["transformers"]["runs"][0]["tpot_ms"]
    print(f"generic/native batch-1 TPOT: {g:.3f} / {n:.3f} ms = {g / n:.3f} (target <= 1.15)")
PY
           ;;
  serve) $LOOM bench preset qwen3-0.6b /tmp/q3 > /dev/null
         $LOOM serve /tmp/q3 --load-format dummy --max-model-len 4096 --port 8123 ${SERVE_ARGS:-} > "$OUT/server.log" 2>&1 & pid=$!
         for _ in $(seq 120); do curl -sf localhost:8123/health > /dev/null && break; sleep 1; done
         TAIL=30 run serve-c256 200 $LOOM bench serve --base-url http://127.0.0.1:8123 --random-input-len 512 --random-output-len 256 --num-prompts 512 --max-concurrency 256 --result-file "$OUT/serve.json" --disable-tqdm
         kill -INT $pid; wait $pid  # the GPU is free again for the offline run at the same shape
         run offline-same-shape 200 $LOOM bench throughput --preset qwen3-0.6b --num-prompts 512 --input-len 512 --output-len 256 ;;
  pooling) # issue 48: Qwen3-Embedding-0.6B shape (Qwen3-0.6B, dummy weights), 512-token inputs through
           # /v1/embeddings at concurrency 64; target >= 250,000 prompt tokens/s (bench/embed.py prints the table)
           $LOOM bench preset qwen3-0.6b /tmp/q3e > /dev/null
           $LOOM serve /tmp/q3e --load-format dummy --runner pooling --max-model-len 1024 --port 8124 \
             --max-num-batched-tokens ${POOL_MNBT:-16384} ${SERVE_ARGS:-} > "$OUT/pooling-server.log" 2>&1 & pid=$!
           for _ in $(seq 150); do curl -sf localhost:8124/health > /dev/null && break; sleep 1; done
           TAIL=8 run pooling-embed-c64 150 $LOOM bench embed --base-url http://127.0.0.1:8124 --input-len 512 \
             --num-prompts ${POOL_PROMPTS:-4096} --concurrency 64 --result-file "$OUT/pooling.json"
           kill -INT $pid; wait $pid ;;
  qwen3-mnbt) for t in 8192 16384 8192 16384; do  # fewer, larger eager prefill steps: host-bound ones
                 run qwen3-mnbt-$t 200 $LOOM bench throughput --preset qwen3-0.6b --max-num-batched-tokens $t; done ;;
  profile) TAIL=40 run profile-qwen3 150 $LOOM bench profile-step --preset qwen3-0.6b --batch 1 256 --context 1024 --top 16
           TAIL=40 run profile-llama8b 150 $LOOM bench profile-step --preset llama-3.1-8b --batch 1 128 --context 1024 --top 12 ;;
  host) TAIL=60 run host-prefill-qwen3 150 $LOOM bench profile-step --preset qwen3-0.6b --prefill --batch 1 --context 128 --top 12 --host 30 ;;
  profile-prefill) TAIL=40 run profile-prefill-qwen3 150 $LOOM bench profile-step --preset qwen3-0.6b --prefill --batch 8 --context 1024 --top 16 ;;
  structured) TAIL=12 run structured-json 330 $LOOM bench throughput --preset qwen3-0.6b --structured-output json
              TAIL=7 run grammar-stall-cpu 240 python3 -m bench.grammar_stall ;;  # the same question on this host's CPUs
  vl) # Qwen2.5-VL: bf16/fp32 parity on a tiny model, then Qwen2.5-VL-7B shapes (random weights) under
      # random-mm load; LOOM_STEP_STATS: the worker logs the encoder's and the eager steps' device time
      run vl-parity 200 python3 -m pytest -q -p no:cacheprovider tests/test_gpu_vl.py
      $LOOM bench preset qwen2.5-vl-7b /tmp/qvl7b > /dev/null
      LOOM_STEP_STATS=1 LOOM_LOG_LEVEL=INFO $LOOM serve /tmp/qvl7b --load-format dummy --max-model-len 8192 --port 8124 \
        --limit-mm-per-prompt.image 4 > "$OUT/vl-server.log" 2>&1 & pid=$!
      for _ in $(seq 240); do curl -sf localhost:8124/health > /dev/null && break; sleep 1; done
      TAIL=30 run vl-serve 240 $LOOM bench serve --base-url http://127.0.0.1:8124 --dataset-name random-mm \
        --random-input-len 256 --random-output-len 128 --num-prompts 200 --max-concurrency 32 \
        --random-mm-base-items-per-request 1 --random-mm-bucket-config "{(448, 448, 1): 0.5, (720, 1280, 1): 0.5}" \
        --result-file "$OUT/vl-serve.json" --disable-tqdm
      kill -INT $pid; wait $pid
      grep -E "step stats|captured|KV cache" "$OUT/vl-server.log" | tail -n 6 ;;
  tune-attention) TAIL=${TAIL:-200} run tune-attention 420 python3 -m bench.tune_attention ;;
  dp) OUT=$OUT/dp bash bench/gpu_dp.sh ;;  # 2 GPUs: data parallelism, DP=2 vs DP=1 offline and serving
  *) echo "unknown section $section"; exit 2 ;;
esac; done
