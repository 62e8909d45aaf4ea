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
              --sampling plain topp-only topp-penalties topp penalties logprobs n4seed --output-json "$OUT/sampling.json" ;;
  top-p) # issue 49 item 1: the sampler's device time per mode vs plain (kernels: graphed old / new route,
         # eager), then top-p alone, with penalties, with top-k, against plain in one engine; one table last
         TAIL=60 run top-p-kernels 100 python3 -m bench.kernels_gpu --parts top_p \
           --output-json "$OUT/top-p-kernels.json"
         LOOM_PENALTY_HEAD_GRAPHS=1 LOOM_TOP_P_RACE_CHUNKS=16 TAIL=10 run qwen3-top-p 170 $LOOM bench throughput \
           --preset qwen3-0.6b --sampling plain topp-only topp-penalties topp --output-json "$OUT/top-p.json"
         LOOM_PENALTY_HEAD_GRAPHS=0 TAIL=4 run qwen3-top-p-eager-penalties 110 $LOOM bench throughput \
           --preset qwen3-0.6b --sampling plain topp-penalties --output-json "$OUT/top-p-eager-penalties.json"
         python3 -m bench.top_p "$OUT" ;;
  top-p-tests) # issue 49 item 1's GPU tests: the penalty head and the second race's split against the eager sampler
    run top-p-tests 240 python3 -m pytest -q -p no:cacheprovider tests/test_gpu_sampling.py ;;
  startup) # issue 49 item 4: loom serve to healthy (dummy), Qwen3-0.6B and Llama-3.1-8B: an empty cache
           # (kernels compiled ahead in parallel), a second start, then an empty cache with
           # LOOM_COMPILE_THREADS=0 (compiled one by one: the A/B); each start's breakdown
           # (--log-level debug), then one table last. First the GPU tests of the dry runs (an
           # engine started with them samples as one without). Starts stop at a 270 s budget.
           TAIL=4 run startup-gpu-tests 200 python3 -m pytest -q -p no:cacheprovider tests/test_gpu_startup.py
           # (--compile-bytecode: the image ships packages without .pyc files and sets PYTHONDONTWRITEBYTECODE;
           # an installed Loom has them, as pip writes them at install)
           TAIL=60 run startup 290 python3 -m bench.startup --out "$OUT" --budget 270 --compile-bytecode ;;
  targets) bash "$0" targets-a targets-b ;;   # every target, in two device calls: run the parts apart
  targets-a) # the offline targets (docs/performance.md, issue 49): standard workload, sampling ratios,
             # structured outputs, Llama-3.1-8B, batch-1; then the table of what $OUT holds
    TAIL=12 run targets-qwen3 240 $LOOM bench throughput --preset qwen3-0.6b \
      --sampling plain topp-only topp topp-penalties logprobs n4seed --output-json "$OUT/targets-qwen3.json"
    TAIL=6 run targets-structured 200 $LOOM bench throughput --preset qwen3-0.6b --structured-output json --skip-compile-stall \
      --output-json "$OUT/targets-structured.json"
    TAIL=4 run targets-llama8b 150 $LOOM bench throughput --preset llama-3.1-8b --output-json "$OUT/targets-llama8b.json"
    TAIL=4 run targets-latency-qwen3 60 $LOOM bench latency --preset qwen3-0.6b --iters 3 \
      --output-json "$OUT/targets-latency-qwen3.json"
    TAIL=4 run targets-latency-llama8b 90 $LOOM bench latency --preset llama-3.1-8b --iters 3 \
      --output-json "$OUT/targets-latency-llama8b.json"
    python3 -m bench.targets "$OUT" ;;
  targets-b) # serving c256 vs offline at the same shape, HF generate, start-up; then the table
    $LOOM bench preset qwen3-0.6b /tmp/q3 > /dev/null
    $LOOM serve /tmp/q3 --load-format dummy --max-model-len 4096 --port 8123 > "$OUT/targets-server.log" 2>&1 & pid=$!
    for _ in $(seq 120); do curl -sf localhost:8123/health > /dev/null && break; sleep 1; done
    TAIL=4 run targets-serve-c256 150 $LOOM bench serve --base-url http://127.0.0.1:8123 --random-input-len 512 \
      --random-output-len 256 --num-prompts 512 --max-concurrency 256 --result-file "$OUT/targets-serve-c256.json" --disable-tqdm
    kill -INT $pid; wait $pid
    TAIL=4 run targets-offline-c256 120 $LOOM bench throughput --preset qwen3-0.6b --num-prompts 512 --input-len 512 \
      --output-len 256 --output-json "$OUT/targets-offline-c256.json"
    TAIL=4 run targets-hf 200 $LOOM bench throughput --preset qwen3-0.6b --num-prompts 256 --input-len 512 \
      --output-len 256 --compare-hf --output-json "$OUT/targets-hf.json"
    TAIL=30 run startup 300 python3 -m bench.startup --out "$OUT" --no-serial --budget 280
    python3 -m bench.targets "$OUT" ;;
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
           # the same, the fused decoder layers off (workers/models/transformers_fused.py): their gain
           LOOM_GENERIC_FUSED_LAYERS=0 run llama8b-transformers-unfused-latency 300 $LOOM bench latency \
             --preset llama-3.1-8b --iters 3 --model-impl transformers --output-json "$OUT/generic-unfused-latency.json"
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
unfused = read("unfused-latency")
if lat["loom"] and unfused:
    n, u = lat["loom"]["runs"][0]["tpot_ms"], unfused["runs"][0]["tpot_ms"]
    print(f"generic (fused layers off)/native batch-1 TPOT: {u:.3f} / {n:.3f} ms = {u / n:.3f} (was 1.171)")
PY
           ;;
  quant-tests) run quant-kernel-tests 300 python3 -m pytest -q -p no:cacheprovider tests/test_gpu_quant.py
               bash "$0" quant-bench ;;
  quant-bench) # issue 46: every quantized-linear variant at Llama-3.1-8B's shapes, M = 1..2048, then
               # the choice table and the kernel targets (bench/quant_kernels.py; --sweep: W4A16 GEMV tiles)
               TAIL=60 run quant-kernel-bench 280 python3 -m bench.quant_kernels --sweep ${QUANT_BENCH_ARGS:-} ;;
  quant|quant-llama|quant-qwen3) # issue 46: weight quantization, dummy weights in each format's real layout;
         # throughput ratios against bf16 in this same call, batch-1 TPOT (128/128) per format
         if [ "$section" != quant-qwen3 ]; then
           for q in bf16 fp8 gptq awq; do
             flag=$([ $q = bf16 ] || echo "--quantization $q")
             run llama8b-$q-throughput 150 $LOOM bench throughput --preset llama-3.1-8b $flag \
               --output-json "$OUT/quant-llama8b-$q-throughput.json"
             [ $q = bf16 ] || run llama8b-$q-latency 100 $LOOM bench latency --preset llama-3.1-8b --iters 2 $flag \
               --output-json "$OUT/quant-llama8b-$q-latency.json"
           done
         fi
         if [ "$section" != quant-llama ]; then
           for p in qwen3-8b qwen3-8b-fp8; do   # the second: Qwen3-8B-FP8's block-wise quantization_config
             run $p-throughput 150 $LOOM bench throughput --preset $p --output-json "$OUT/quant-$p-throughput.json"
           done
         fi
         python3 - "$OUT" <<'PY'
import json, sys
out = sys.argv[1]
def read(name, key):
    try:
        with open(f"{out}/quant-{name}.json") as f:
            d = json.load(f)
    except OSError:
        return None
    return d["output_tok_per_s"] if key == "tput" else d["runs"][0]["tpot_ms"]
rows = []
bf16, q3 = read("llama8b-bf16-throughput", "tput"), read("qwen3-8b-throughput", "tput")
for q, tpot_target, ratio_target in (("fp8", 2.4, 1.3), ("gptq", 2.0, 0.85), ("awq", 2.0, 0.85)):
    t, lat = read(f"llama8b-{q}-throughput", "tput"), read(f"llama8b-{q}-latency", "tpot")
    if lat is not None:
        rows.append((f"Llama-3.1-8B {q} batch-1 TPOT", f"{lat:.3f} ms", f"<= {tpot_target} ms", lat <= tpot_target))
    if t is not None and bf16:
        rows.append((f"Llama-3.1-8B {q} offline / bf16", f"{t:.0f} / {bf16:.0f} = {t / bf16:.3f}", f">= {ratio_target}",
                     t / bf16 >= ratio_target))
fp8 = read("qwen3-8b-fp8-throughput", "tput")
if fp8 is not None and q3:
    rows.append(("Qwen3-8B block-FP8 offline / bf16", f"{fp8:.0f} / {q3:.0f} = {fp8 / q3:.3f}", ">= 1.2", fp8 / q3 >= 1.2))
print(f"{'workload':40} {'measured':28} {'target':12} met")
for name, got, target, ok in rows:
    print(f"{name:40} {got:28} {target:12} {'yes' if ok else 'NO'}")
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
              TAIL=2 run grammar-fill-cpu 120 python3 -m bench.grammar_fill   # the grammar work of a 256-row step
              TAIL=7 run grammar-stall-cpu 240 python3 -m bench.grammar_stall ;;  # the same question on this host's CPUs
  vl) # Qwen2.5-VL: bf16/fp32 parity on a tiny model, then Qwen2.5-VL-7B shapes (random weights) under
      # random-mm load; LOOM_STEP_STATS: the worker logs the encoder's and the eager steps' device time
      run vl-parity 200 python3 -m pytest -q -p no:cacheprovider tests/test_gpu_vl.py
      $LOOM bench preset qwen2.5-vl-7b /tmp/qvl7b > /dev/null
      LOOM_STEP_STATS=1 LOOM_LOG_LEVEL=INFO $LOOM serve /tmp/qvl7b --load-format dummy --max-model-len 8192 --port 8124 \
        --limit-mm-per-prompt.image 4 > "$OUT/vl-server.log" 2>&1 & pid=$!
      for _ in $(seq 240); do curl -sf localhost:8124/health > /dev/null && break; sleep 1; done
      # (--random-input-len 1491: the 2026-11-28 baseline's texts, when random-mm's 256 random ids decoded
      # to text of ~1,491 tokens on average; the texts now hold exactly the input length, as vLLM's)
      TAIL=30 run vl-serve 240 $LOOM bench serve --base-url http://127.0.0.1:8124 --dataset-name random-mm \
        --random-input-len 1491 --random-output-len 128 --num-prompts 200 --max-concurrency 32 \
        --random-mm-base-items-per-request 1 --random-mm-bucket-config "{(448, 448, 1): 0.5, (720, 1280, 1): 0.5}" \
        --result-file "$OUT/vl-serve.json" --disable-tqdm
      kill -INT $pid; wait $pid
      grep -E "step stats|captured|KV cache" "$OUT/vl-server.log" | tail -n 6
      # issue 49 item 6: req/s vs 1.5x 7.99, GPU idle before encoder steps vs 5% of the run
      python3 -m bench.vl_targets --serve-json "$OUT/vl-serve.json" --server-log "$OUT/vl-server.log" ;;
  moe|moe-kernel|moe-qwen3|moe-mixtral|moe-std) # issue 45: the fused-MoE kernel alone (decode vs its HBM
      # floor, prefill vs the bf16 matmul peak, tuned vs default at 512 tokens), then Qwen3-30B-A3B offline
      # (random 1024 in / 128 out x 1000: total tok/s) and batch-1 TPOT, Mixtral-8x7B batch-1 TPOT;
      # moe-std alone: Qwen3-30B-A3B on the standard offline workload against its HBM floor
      case $section in moe|moe-kernel)
        TAIL=16 run moe-kernel 240 python3 -m bench.moe_kernel --model-shape qwen3-30b-a3b --output-json "$OUT/moe-kernel.json" ;; esac
      case $section in moe|moe-qwen3)
        TAIL=10 run moe-qwen3-throughput 240 $LOOM bench throughput --preset qwen3-30b-a3b --num-prompts 1000 \
          --input-len 1024 --output-len 128 --output-json "$OUT/moe-qwen3-throughput.json"
        TAIL=4 run moe-qwen3-latency 150 $LOOM bench latency --preset qwen3-30b-a3b --iters 3 \
          --output-json "$OUT/moe-qwen3-latency.json" ;; esac
      case $section in moe|moe-mixtral)
        TAIL=4 run moe-mixtral-latency 180 $LOOM bench latency --preset mixtral-8x7b --iters 3 \
          --output-json "$OUT/moe-mixtral-latency.json" ;; esac
      case $section in moe-std)
        TAIL=10 run moe-qwen3-std 300 $LOOM bench throughput --preset qwen3-30b-a3b \
          --output-json "$OUT/moe-qwen3-std.json" ;; esac
      python3 - "$OUT" <<'PY'
import json, sys
out = sys.argv[1]
def read(name):
    try:
        with open(f"{out}/{name}.json") as f:
            return json.load(f)
    except (OSError, ValueError):
        return None
rows = []
k = read("moe-kernel")
for r in (k or {}).get("rows", []):
    ratio = r["name"].endswith("tuned")
    fmt = (lambda x: f"{x:.2f}x") if ratio else (lambda x: f"{100 * x:.0f}%")
    rows.append((f"kernel {r['name']} ({r['us']:.1f} us)", fmt(r["measured"]), ">=" + fmt(r["target"]),
                 r["measured"] >= r["target"]))
t = read("moe-qwen3-throughput")
if t:
    rows.append(("Qwen3-30B-A3B 1024/128 x1000 total tok/s", f"{t['total_tok_per_s']:.0f}", ">=32000",
                 t["total_tok_per_s"] >= 32000))
    rows.append(("  its HBM floor / elapsed (no target)", f"{100 * t['hbm_floor_fraction']:.0f}%", "-", True))
std = read("moe-qwen3-std")
if std:
    rows.append(("Qwen3-30B-A3B standard workload: HBM floor / elapsed", f"{100 * std['hbm_floor_fraction']:.0f}%",
                 ">=70%", std["hbm_floor_fraction"] >= 0.70))
for name, label, target in (("moe-qwen3-latency", "Qwen3-30B-A3B batch-1 TPOT ms", 2.2),
                            ("moe-mixtral-latency", "Mixtral-8x7B batch-1 TPOT ms", 7.0)):
    lat = read(name)
    if lat:
        tpot = lat["runs"][0]["tpot_ms"]
        rows.append((label, f"{tpot:.3f}", f"<={target}", tpot <= target))
print(f"\n{'MoE (issue 45)':54s} {'measured':>10s} {'target':>8s}")
for name, got, want, ok in rows:
    print(f"{name:54s} {got:>10s} {want:>8s} {'ok' if ok else 'MISS'}")
PY
      ;;
  moe-tune) # issue 45: write the H200 tile configs (kernels/fused_moe_configs/), ~2-4 min per shape
      for shape in ${MOE_SHAPES:-qwen3-30b-a3b mixtral-8x7b}; do
        TAIL=20 run moe-tune-$shape 420 python3 -m bench.tune_moe --model-shape $shape --out-dir "$OUT/fused_moe_configs"
      done
      cp "$OUT"/fused_moe_configs/*.json kernels/fused_moe_configs/ 2>/dev/null; ls kernels/fused_moe_configs ;;
  kv-fp8) # issue 46: --kv-cache-dtype fp8 vs auto (bf16) on Qwen3-0.6B, 16 requests x 16,384 prompt tokens, 256 out,
          # each once with the profiled cache (as much KV as memory allows) and once with the same KV bytes as
          # 9,000 bf16 blocks (8.6 of the requests: fp8 holds all 16 at once); then 32k-key attention accuracy
          KV_ARGS="--preset qwen3-0.6b --num-prompts 16 --input-len 16384 --output-len 256 --max-model-len 16640"
          for kv in auto fp8; do
            TAIL=3 run kv-$kv 200 $LOOM bench throughput $KV_ARGS --kv-cache-dtype $kv --output-json "$OUT/kv-$kv.json"
          done
          TAIL=3 run kv-auto-9000 150 $LOOM bench throughput $KV_ARGS --num-gpu-blocks-override 9000 \
            --output-json "$OUT/kv-auto-9000.json"
          TAIL=3 run kv-fp8-18000 150 $LOOM bench throughput $KV_ARGS --kv-cache-dtype fp8 --num-gpu-blocks-override 18000 \
            --output-json "$OUT/kv-fp8-18000.json"
          TAIL=15 run kv-needle 150 python3 -m bench.needle --time --output-json "$OUT/kv-needle.json"
          python3 - "$OUT" <<'PY'
import json, sys
out = sys.argv[1]
def read(name):
    try:
        with open(f"{out}/{name}.json") as f:
            return json.load(f)
    except OSError:
        return None
print(f"{'FP8 KV, Qwen3-0.6B, 16 x 16,384 in / 256 out':48s} {'auto (bf16)':>14s} {'fp8':>14s} {'ratio':>7s}  target")
for label, a, b in (("profiled memory", "kv-auto", "kv-fp8"), ("same KV bytes (9,000 bf16 blocks)", "kv-auto-9000",
                                                                 "kv-fp8-18000")):
    ra, rb = read(a), read(b)
    if not (ra and rb):
        print(f"{label}: a run failed (see {out}/{a}.log, {out}/{b}.log)")
        continue
    ta, tb = ra["total_tok_per_s"], rb["total_tok_per_s"]
    print(f"{label + ', total tok/s':48s} {ta:14.0f} {tb:14.0f} {tb / ta:7.2f}  >= 1.4")
    print(f"{label + ', output tok/s':48s} {ra['output_tok_per_s']:14.0f} {rb['output_tok_per_s']:14.0f} "
          f"{rb['output_tok_per_s'] / ra['output_tok_per_s']:7.2f}")
    print(f"{label + ', KV blocks':48s} {ra['num_gpu_blocks']:14d} {rb['num_gpu_blocks']:14d} "
          f"{rb['num_gpu_blocks'] / ra['num_gpu_blocks']:7.2f}  2.00")
n = read("kv-needle")
if n:
    print(f"needle retrieval at {n['context']} keys: " + ", ".join(f"{k} {v:.1f}%" for k, v in n["needle"].items())
          + f"; fp8 - bf16 = {n['needle']['fp8'] - n['needle']['bf16']:+.1f} points (target within 2)")
    t = n.get("decode_times") or {}
    if t:
        print(f"decode attention 16 x 16,384 keys: fp8 {t['fp8 us']:.0f} us / bf16 {t['bf16 us']:.0f} us = "
              f"{t['fp8 us'] / t['bf16 us']:.2f} (vLLM measured 0.54 of the per-token decode slope)")
PY
          ;;
  tune-attention) TAIL=${TAIL:-200} run tune-attention 420 python3 -m bench.tune_attention ;;
  gpt-oss-tests) # issue 45: the sink attention kernel in bf16 at gpt-oss-20b's shapes; the tiny gpt-oss (sliding
                 # layers, sinks, biased experts) through Triton and CUDA graphs vs HF
                 run gpt-oss-gpu-tests 300 python3 -m pytest -q -p no:cacheprovider tests/test_gpu_gpt_oss.py ;;
  gpt-oss) # issue 45: gpt-oss-20b shapes (bf16 experts, dummy weights): 200 random 1,024/128 prompts, batch-1 TPOT
           run gpt-oss-20b-throughput 220 $LOOM bench throughput --preset gpt-oss-20b --num-prompts 200 \
             --input-len 1024 --output-len 128 --output-json "$OUT/gpt-oss-throughput.json"
           run gpt-oss-20b-latency 170 $LOOM bench latency --preset gpt-oss-20b --iters 3 \
             --output-json "$OUT/gpt-oss-latency.json"
           python3 - "$OUT" <<'PY'
import json, sys
from bench.presets import PRESETS
out, cfg = sys.argv[1], PRESETS["gpt-oss-20b"]
h, i, e, k, n = (cfg[x] for x in ("hidden_size", "intermediate_size", "num_local_experts", "num_experts_per_tok",
                                  "num_hidden_layers"))
q, kv = cfg["num_attention_heads"] * cfg["head_dim"], cfg["num_key_value_heads"] * cfg["head_dim"]
# what one decode token reads (bf16): attention, the router, k experts per layer, the lm_head
active = n * (h * (q + 2 * kv) + q * h + h * e + k * 3 * h * i) + cfg["vocab_size"] * h
floor_ms = 2 * active / 4.8e12 * 1e3   # H200 HBM3e 4.8 TB/s
def read(name):
    try:
        with open(f"{out}/gpt-oss-{name}.json") as f:
            return json.load(f)
    except OSError:
        return None
tp, lat = read("throughput"), read("latency")
print(f"{'gpt-oss-20b (dummy, bf16)':<40} {'measured':>12} {'reference':>22}")
if tp:
    print(f"{'offline 200 x 1,024/128 total tok/s':<40} {tp['total_tok_per_s']:>12.0f} {'(no target yet)':>22}")
    print(f"{'offline 200 x 1,024/128 output tok/s':<40} {tp['output_tok_per_s']:>12.0f} {'':>22}")
if lat:
    tpot = lat["runs"][0]["tpot_ms"]
    print(f"{'batch-1 TPOT ms':<40} {tpot:>12.3f} {f'HBM floor {floor_ms:.2f} ms':>22}")
PY
           ;;
  audio) # issue 52: tiny Qwen2-Audio fp32 parity with HF on CUDA, then the Qwen2-Audio-7B encoder vs HF's
         run audio-parity 200 python3 -m pytest -q -p no:cacheprovider tests/test_gpu_audio.py
         TAIL=5 run audio-encoder 150 python3 -m bench.audio_encoder --batch 16 ;;
  kv-offload) # issue 50: the CPU KV tier on Llama-3.1-8B shapes: TTFT of a 32k prompt re-hit from the tier vs
              # recompute, multi-turn p50 TTFT (working set 4x the GPU cache) tier vs GPU-only, and 0%-hit
              # throughput with the tier on vs off (table at the end)
              TAIL=10 run kv-offload 300 python3 -m bench.kv_offload --preset llama-3.1-8b --prompt-len 32768 \
                --offload-gb 64 --num-prompts 256 --output-json "$OUT/kv-offload.json" ;;
  lora-tests) # issue 51: LoRA kernels under CUDA graphs vs merged weights (fp32) and vs eager (bf16)
      run lora-gpu-tests 420 python3 -m pytest -q -p no:cacheprovider tests/test_gpu_lora.py tests/test_lora_kernels.py ;;
  lora) # issue 51: Llama-3.1-8B shapes, 8 random rank-16 adapters on all 7 projections: offline throughput
        # over 8 adapters vs base (one engine), base on a LoRA engine vs without, batch-1 TPOT, load under load;
        # kernel variants side by side: new (the defaults: base-only graphs, PDL, the expand in the GEMV's
        # epilogue, rows sorted by adapter from 16 rows), rowwise (new with one program per row at 16-256 rows,
        # the default before session 36), old (session 31's); sep: new with the expand not in the epilogue (TPOT
        # rows only); the table is printed after each engine (a cut run keeps those done);
        # `--variants new,rowwise,old,sep,k1` adds k1 (one K block per batch-1 shrink program, ~60 s more)
      TAIL=12 run lora 360 python3 -m bench.lora --variants new,rowwise,old --tpot-len 128 --output-json "$OUT/lora.json" ;;
  eagle) # issue 47: an EAGLE-3-shaped head (one layer, three-layer fusion) on Llama-3.1-8B shapes, batch 1:
         # cost per draft token vs a target decode step (<= 6%), graphed and eager, one table (last);
         # first the GPU tests (fp32 greedy identical, drafts = the reference's under graphs and eager)
         TAIL=40 run eagle-gpu-tests 200 python3 -m pytest -q -p no:cacheprovider --tb=short tests/test_gpu_eagle.py
         TAIL=4 run eagle-head 200 python3 -m bench.eagle_head --output-json "$OUT/eagle_head.json" ;;
  whisper) # issue 52: tiny Whisper fp32 parity with HF on CUDA (graphs, Triton), then Whisper-large-v3 shapes
           # (random weights): RTFx at concurrency 64 on 10-30 s clips via /v1/audio/transcriptions vs HF's batched
           # generate (batch 64), and the encoder's share; the table last
           # (then the encoder eager, LOOM_ENCODER_GRAPHS=0, as the A/B of its CUDA graphs)
           run whisper-parity 150 python3 -m pytest -q -p no:cacheprovider tests/test_gpu_whisper.py
           TAIL=30 run whisper-asr 200 python3 -m bench.whisper_asr --num-prompts ${WH_PROMPTS:-256} \
             --concurrency 64 --output-len 64
           LOOM_ENCODER_GRAPHS=0 TAIL=30 run whisper-asr-eager-encoder 150 python3 -m bench.whisper_asr --num-prompts ${WH_PROMPTS:-256} \
             --concurrency 64 --output-len 64 --skip-hf ;;
  moe-decode|moe-decode-std) # issue 45 decode: the fused MoE at 1/2/4/8 tokens, grouped GEMMs vs the GEMV path's
      # tile variants (bench/moe_decode.py), Qwen3-30B-A3B and Mixtral-8x7B batch-1 TPOT (GEMV path, graphs up to
      # 4 seqs; MOE_DECODE_AB=1 adds Qwen3's TPOT on the grouped path, MOE_DECODE_PROFILE=1 its step by kernel),
      # ~250 s; moe-decode-std: Qwen3-30B-A3B's
      # standard offline workload against its HBM floor (~150-250 s). The table covers whatever $OUT holds.
      case $section in moe-decode)
        TAIL=14 run moe-decode-kernel 150 python3 -m bench.moe_decode --model-shape qwen3-30b-a3b \
          --output-json "$OUT/moe-decode-kernel.json"
        TAIL=4 run moe-decode-qwen3-tpot 130 $LOOM bench latency --preset qwen3-30b-a3b --iters 3 --max-num-seqs 4 \
          --output-json "$OUT/moe-decode-qwen3-tpot.json"
        [ "${MOE_DECODE_AB:-0}" = 1 ] && LOOM_MOE_GEMV_MAX_TOKENS=0 TAIL=4 run moe-decode-qwen3-tpot-grouped 130 \
          $LOOM bench latency --preset qwen3-30b-a3b --iters 3 --max-num-seqs 4 --output-json "$OUT/moe-decode-qwen3-tpot-grouped.json"
        TAIL=4 run moe-decode-mixtral-tpot 160 $LOOM bench latency --preset mixtral-8x7b --iters 3 --max-num-seqs 4 \
          --output-json "$OUT/moe-decode-mixtral-tpot.json"
        # MOE_DECODE_PROFILE=1: Qwen3-30B-A3B's batch-1 step by kernel (launches per step; ~90 s more)
        [ "${MOE_DECODE_PROFILE:-0}" = 1 ] && TAIL=24 run moe-decode-profile 150 $LOOM bench profile-step \
          --preset qwen3-30b-a3b --batch 1 --context 256 --top 20 ;;
      moe-decode-std)
        TAIL=10 run moe-decode-std 280 $LOOM bench throughput --preset qwen3-30b-a3b \
          --output-json "$OUT/moe-decode-std.json" ;; esac
      python3 - "$OUT" <<'PY'
import json, sys
out = sys.argv[1]
def read(name):
    try:
        with open(f"{out}/{name}.json") as f:
            return json.load(f)
    except (OSError, ValueError):
        return None
rows = []
for r in (read("moe-decode-kernel") or {}).get("rows", []):
    rows.append((f"kernel {r['name']} ({r['us']:.1f} us)", f"{100 * r['measured']:.0f}% HBM",
                 f">={100 * r['target']:.0f}%", r["measured"] >= r["target"]))
for name, label, target in (("moe-decode-qwen3-tpot", "Qwen3-30B-A3B batch-1 TPOT ms", 2.2),
                            ("moe-decode-qwen3-tpot-grouped", "  same, grouped path (no target)", 2.2),
                            ("moe-decode-mixtral-tpot", "Mixtral-8x7B batch-1 TPOT ms", 7.0)):
    lat = read(name)
    if lat:
        tpot = lat["runs"][0]["tpot_ms"]
        rows.append((label, f"{tpot:.3f}", f"<={target}", tpot <= target))
std = read("moe-decode-std")
if std:
    rows.append(("Qwen3-30B-A3B standard workload total tok/s", f"{std['total_tok_per_s']:.0f}", "-", True))
    rows.append((f"  its HBM floor {std['hbm_floor_s']:.2f} s / elapsed {std['elapsed_s']:.2f} s",
                 f"{100 * std['hbm_floor_fraction']:.0f}%", ">=70%", std["hbm_floor_fraction"] >= 0.70))
print(f"\n{'MoE decode (issue 45)':58s} {'measured':>10s} {'target':>8s}")
for name, got, want, ok in rows:
    print(f"{name:58s} {got:>10s} {want:>8s} {'ok' if ok else 'MISS'}")
PY
      ;;
  serve-400) # issue 49 item 7: one API server (Qwen3-0.6B dummy) at c512, 256 in / 128 out: req/s, output tok/s
             # and its CPU per request; then the serve section's pair (c256 512/256 vs offline); one table
    $LOOM bench preset qwen3-0.6b /tmp/q3 > /dev/null
    $LOOM serve /tmp/q3 --load-format dummy --max-model-len 4096 --port 8125 ${SERVE_ARGS:-} > "$OUT/serve400-server.log" 2>&1 & pid=$!
    for _ in $(seq 120); do curl -sf localhost:8125/health > /dev/null && break; sleep 1; done
    TAIL=22 run serve400-c512 100 $LOOM bench serve --base-url http://127.0.0.1:8125 --random-input-len 256 \
      --random-output-len 128 --num-prompts ${S400_PROMPTS:-4096} --max-concurrency 512 --num-processes 4 \
      --result-file "$OUT/serve400-c512.json" --disable-tqdm
    TAIL=4 run serve400-c256 100 $LOOM bench serve --base-url http://127.0.0.1:8125 --random-input-len 512 \
      --random-output-len 256 --num-prompts 512 --max-concurrency 256 --result-file "$OUT/serve400-c256.json" --disable-tqdm
    kill -INT $pid; wait $pid   # the GPU is free again for the offline run at the same shape
    if [ "${S400_INTERVAL:-1}" = 1 ]; then   # the c512 load again, one chunk per 4 tokens (--stream-interval 4)
      $LOOM serve /tmp/q3 --load-format dummy --max-model-len 4096 --port 8125 --stream-interval 4 ${SERVE_ARGS:-} \
        > "$OUT/serve400-si4-server.log" 2>&1 & pid=$!
      for _ in $(seq 120); do curl -sf localhost:8125/health > /dev/null && break; sleep 1; done
      TAIL=4 run serve400-c512-si4 100 $LOOM bench serve --base-url http://127.0.0.1:8125 --random-input-len 256 \
        --random-output-len 128 --num-prompts ${S400_PROMPTS:-4096} --max-concurrency 512 --num-processes 4 \
        --result-file "$OUT/serve400-c512-si4.json" --disable-tqdm
      kill -INT $pid; wait $pid
    fi
    TAIL=3 run serve400-offline 150 $LOOM bench throughput --preset qwen3-0.6b --num-prompts 512 --input-len 512 \
      --output-len 256 --output-json "$OUT/serve400-offline.json"
    python3 -m bench.serve_targets --c512 "$OUT/serve400-c512.json" --c256 "$OUT/serve400-c256.json" \
      --offline "$OUT/serve400-offline.json" --c512-interval "$OUT/serve400-c512-si4.json" ;;
  cascade) # issue 49 item 2: 512 x (2,048 shared + 64 own) in, 128 out, prefix caching on, cascade attention
           # off vs on (two engines, one call); one layer's decode attention plain vs cascade with its floors;
           # the standard workload and batch 1 with cascade on (the heuristic must run none of their steps)
           TAIL=24 run cascade 290 python3 -m bench.cascade --output-json "$OUT/cascade.json" ;;
  cascade-tests) run cascade-tests 300 python3 -m pytest -q -p no:cacheprovider tests/test_gpu_cascade.py \
                   tests/test_cascade_attention.py ;;
  long-context) # issue 49 item 3: paged attention at 16k keys per kernel against its floor, default and variants
                # side by side (bench/long_context.py), then 16 x 16,384 in / 256 out end to end: the default,
                # the tiles of before (LOOM_LONG_PREFILL_TILES=off) and a 16,384-token step budget; target <= 3.7 s
      TAIL=4 run long-gpu-tests 150 python3 -m pytest -q -p no:cacheprovider tests/test_gpu_long_context.py \
        tests/test_kernels.py -k "long_prefill or causal_split"
      TAIL=40 run long-kernels 200 python3 -m bench.long_context --output-json "$OUT/long-kernels.json"
      LONG_ARGS="--preset qwen3-0.6b --num-prompts 16 --input-len 16384 --output-len 256 --max-model-len 16640"
      TAIL=3 run long-e2e 150 $LOOM bench throughput $LONG_ARGS --output-json "$OUT/long-e2e.json"
      LOOM_LONG_PREFILL_TILES=off TAIL=3 run long-e2e-short 150 $LOOM bench throughput $LONG_ARGS \
        --output-json "$OUT/long-e2e-short.json"
      TAIL=3 run long-e2e-mnbt16k 150 $LOOM bench throughput $LONG_ARGS --max-num-batched-tokens 16384 \
        --output-json "$OUT/long-e2e-mnbt16k.json"
      python3 -m bench.long_context --summary "$OUT" ;;
  dp) OUT=$OUT/dp bash bench/gpu_dp.sh ;;  # 2 GPUs: data parallelism, DP=2 vs DP=1 offline and serving
  spec) # issue 47: speculative decoding vs its targets (Llama-3.1-8B and Qwen3-0.6B shapes, dummy weights), the
        # oracle rows with verify steps in the decode graphs (LOOM_SPEC_FULL_GRAPH=1) and in the piecewise graphs (0)
        # side by side; last row: tests/test_gpu_spec.py (graphs and eager equal with speculation on). One table.
        TAIL=16 run spec-decode 540 python3 -m bench.spec_decode --full-graph 1 0 --eagle --equality --step-stats \
          --output-json "$OUT/spec_decode.json" ;;
  spec-quick) # the same, decode-graph verify only, no tests; the oracle and n-gram rows with one step in flight
              # while drafts wait and with the next step scheduled during the verify step (LOOM_SPEC_ASYNC=0 / 1);
              # the EAGLE-3 head's cost per draft token
        TAIL=20 run spec-decode 560 python3 -m bench.spec_decode --spec-async 0 1 --eagle --step-stats \
          --output-json "$OUT/spec_decode.json" ;;
  spec-overlap) # issue 47's Qwen3-0.6B batch-8 oracle row (target >= 1.8x) with one step in flight while drafts wait and
                # with the next step scheduled during the verify step (LOOM_SPEC_ASYNC=0 / 1), each with the default
                # waits and with the worker and engine core busy-polling 3 ms for each other's message (--spin-ms);
                # step stats per verify step: host prepare / finish, device, idle before
        TAIL=12 run spec-overlap 590 python3 -m bench.spec_decode --rows qwen --spec-async 0 1 --spin-ms - 3 \
          --step-stats --output-json "$OUT/spec_overlap.json" ;;
  spec-async-tests) # tests/test_gpu_spec.py with LOOM_SPEC_ASYNC=1 (7 engines in its first test: ~6 s each on the CPU,
                    # more with graph capture; session 35's 120 s bound cut it before any test finished)
        LOOM_SPEC_ASYNC=1 TAIL=6 run spec-async-tests 500 python3 -m pytest -q -p no:cacheprovider tests/test_gpu_spec.py ;;
  spec-profile) # issue 47: where a Qwen3-0.6B batch-8 verify step's device time goes (8 x 5 tokens: 1.98 ms in
                # session 35, against 1.29 ms for a plain batch-8 step): per kernel, eager, then CUDA-graph replays
      TAIL=60 run spec-profile-kernels 150 $LOOM bench profile-step --preset qwen3-0.6b --batch 8 --context 512 \
        --query-len 1 5 --top 20
      TAIL=12 run spec-profile-graph 150 $LOOM bench profile-step --preset qwen3-0.6b --batch 8 --context 512 \
        --query-len 1 5 --graph ;;
  lora-kernels) # issue 51: one decoder layer's LoRA routes at Llama-3.1-8B shapes, us per layer in CUDA graphs
                # (bench/lora_kernels.py): batch 1 base / old (session 35's) / new, 16-256 rows base / rowwise /
                # sorted (8 rank-16 adapters, row t on t % 8); each route's output checked against the references
      TAIL=45 run lora-kernels 180 python3 -m bench.lora_kernels ;;
  lora-decide) # issue 51 in one call (~5 min): lora-kernels at 1 and 256 rows, then bench.lora's rows with the
               # defaults (new) and the engine without LoRA; the old routes' rows are session 31/34's (0.658,
               # 1.28-1.52); the table is printed after each engine (a cut run keeps those done)
      TAIL=30 run lora-kernels 120 python3 -m bench.lora_kernels --rows 1 256
      TAIL=12 run lora 270 python3 -m bench.lora --variants new --tpot-len 128 --output-json "$OUT/lora.json" ;;
  lora-profile) # issue 51: the LoRA kernels' cost per step by kernel, Llama-3.1-8B shapes, 8 rank-16 adapters
                # (token t on adapter t % 8) vs none, batch 1 and 256: eager per kernel, then graph replays
      TAIL=40 run lora-profile-base 120 $LOOM bench profile-step --preset llama-3.1-8b --batch 1 256 --context 512 --top 12
      TAIL=60 run lora-profile-kernels 150 $LOOM bench profile-step --preset llama-3.1-8b --batch 1 256 --context 512 \
        --lora-adapters 8 --top 20
      TAIL=12 run lora-profile-graph 150 $LOOM bench profile-step --preset llama-3.1-8b --batch 1 256 --context 512 \
        --lora-adapters 8 --graph ;;
  *) echo "unknown section $section"; exit 2 ;;
esac; done
