#!/usr/bin/env bash
# Issue 12 (tensor parallelism) on nvidia-h200-x2 (a section per device call: all three exceed 10 minutes):
#   bench/gpu_tp.sh            (logs in $OUT or /tmp/loom-bench; the targets table is printed last)
# 1. correctness: tests/test_gpu_tp.py (TP=2 fp32 == HF, TP=2 bf16 vs HF on the demo model and
#    vs TP=1, CUDA graphs == eager at TP=2, the one-shot all-reduce live and exact);
# 2. targets: python -m bench.tp_targets (Llama-3.1-8B TP=2 TPOT, Llama-3.1-70B TP=2 TPOT and
#    offline tok/s, Qwen3-8B offline TP=2 vs TP=1), dummy weights, bf16.
# 0. allreduce: python -m bench.allreduce_tp (NCCL eager/graphed vs the one-shot path, 8 KiB-4 MiB).
# moe-parallel (not in the default list): tests/test_gpu_moe_parallel.py, MoE at TP=2 and EP=2
#    (--enable-expert-parallel) fp32 == HF with CUDA graphs, EP=2 vs TP=2 in bf16 (~2-3 minutes).
# SECTIONS="allreduce", "tests" or "targets" runs one part; TARGETS="llama8b-tp2 ..." picks target rows.
# As with bench/gpu_suite.sh, install the .whl/ wheels (pyzmq, msgspec) into .site on the image first.
set -u
OUT=${OUT:-/tmp/loom-bench}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 LOOM_LOG_LEVEL=${LOOM_LOG_LEVEL:-WARNING}
nvidia-smi --query-gpu=index,name,memory.total --format=csv,noheader
echo "NCCL_NVLS_ENABLE=${NCCL_NVLS_ENABLE:-unset} TORCH_SYMM_MEM_DISABLE_MULTICAST=${TORCH_SYMM_MEM_DISABLE_MULTICAST:-unset}"
for section in ${SECTIONS:-allreduce tests targets}; do case $section in
  allreduce) echo "=== python -m bench.allreduce_tp"
             timeout 45 python3 -m bench.allreduce_tp > "$OUT/allreduce.log" 2>&1; echo "(exit $?)"
             grep -v -P "^\s*$" "$OUT/allreduce.log" | tail -n 12 ;;
  tests) echo "=== tests/test_gpu_tp.py (two runs: the four tests take ~4 minutes)"
         for k in "fp32 or one_shot" "demo_model or graphs_match_eager"; do
           timeout 250 python3 -m pytest -q -p no:cacheprovider -s tests/test_gpu_tp.py -k "$k" >> "$OUT/gpu-tp-tests.log" 2>&1
           echo "(exit $?)"; done
         grep -E "divergence|all-reduce:|passed|failed|Error|assert" "$OUT/gpu-tp-tests.log" | tail -20 ;;
  targets) echo "=== python -m bench.tp_targets ${TARGETS:-}"
           timeout 330 python3 -m bench.tp_targets ${TARGETS:+--only $TARGETS} --output-json "$OUT/tp-targets.json" \
             > "$OUT/tp-targets.log" 2>&1
           echo "(exit $?)"; grep -v -P "^\s*$|it/s\]" "$OUT/tp-targets.log" | tail -n 24 ;;
  moe-parallel) echo "=== tests/test_gpu_moe_parallel.py (MoE TP=2 and EP=2)"
                timeout 300 python3 -m pytest -q -p no:cacheprovider -s tests/test_gpu_moe_parallel.py \
                  > "$OUT/gpu-moe-parallel.log" 2>&1; echo "(exit $?)"
                grep -E "divergence|passed|failed|Error|assert" "$OUT/gpu-moe-parallel.log" | tail -20 ;;
  *) echo "unknown section $section"; exit 2 ;;
esac; done
