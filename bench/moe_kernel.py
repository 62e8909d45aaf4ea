"""The fused-MoE kernel alone on the GPU against issue 45's targets, at one model's layer shape:

    export PYTHONPATH=$PWD; python3 -m bench.moe_kernel [--model-shape qwen3-30b-a3b] [--output-json F]

  decode, 1-64 tokens   the weight bytes the call must read (the distinct experts of its
                        routing) over its time, as a fraction of 4.3 TB/s    target >= 75%
  prefill, 8192 tokens  the routed FLOPs over its time, as a fraction of the bf16 matmul
                        peak measured here (cuBLAS, 8192^3)                  target >= 55%
  512 tokens            vLLM's untuned default config's time (get_default_config) over the
                        tuned one's                                           target >= 1.15x

Each call runs with the path and config the kernel picks itself (the GEMV path up to
LOOM_MOE_GEMV_MAX_TOKENS tokens; else the tuned file for this GPU if shipped, else the default), timed as in bench/tune_moe.py (CUDA graph over different routings).
"""
from __future__ import annotations

import argparse
import json

import torch

from bench.tune_moe import HBM_BYTES_PER_S, MODEL_SHAPES, MoeCase, reps_for
from kernels import fused_moe as fm

DECODE_TOKENS = [1, 2, 4, 8, 16, 32, 64]
PREFILL_TOKENS = 8192
TUNED_TOKENS = 512
PREFILL_CANDIDATES = [fm.MoeTileConfig(128, 128, 64, 8, 8, 3), fm.MoeTileConfig(128, 128, 64, 8, 8, 4),
                      fm.MoeTileConfig(128, 256, 64, 8, 8, 3), fm.MoeTileConfig(128, 256, 64, 16, 8, 3)]


def matmul_peak_flops(n: int = 8192, iters: int = 20) -> float:
    """bf16 FLOP/s of cuBLAS on an n x n x n matmul."""
    a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    for _ in range(3):
        a @ b
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        a @ b
    end.record()
    torch.cuda.synchronize()
    return 2 * n ** 3 * iters / (start.elapsed_time(end) / 1e3)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model-shape", default="qwen3-30b-a3b", choices=list(MODEL_SHAPES))
    ap.add_argument("--output-json", default=None)
    args = ap.parse_args()
    shape = MODEL_SHAPES[args.model_shape]
    device = fm.device_name(torch.device("cuda"))
    tuned_file = fm.config_file_name(shape.num_experts, shape.intermediate, torch.bfloat16, device)
    tuned = fm.load_configs(tuned_file)
    print(f"{args.model_shape} layer (E={shape.num_experts}, H={shape.hidden}, I={shape.intermediate}, "
          f"top-{shape.top_k}) on {device}; tuned configs: {tuned_file if tuned else 'none (defaults)'}", flush=True)
    rows = []   # (name, measured, unit, fraction, target)
    for m in DECODE_TOKENS:
        case = MoeCase(shape, shape.intermediate, m, reps_for(m), seed=m)
        us = case.per_call_us(None)
        bw = case.weight_bytes / (us * 1e-6)
        rows.append((f"decode {m} tok", us, f"{bw / 1e12:.2f} TB/s", bw / HBM_BYTES_PER_S, 0.75))
        del case
    peak = matmul_peak_flops()
    case = MoeCase(shape, shape.intermediate, PREFILL_TOKENS, reps_for(PREFILL_TOKENS), seed=1)
    us = case.per_call_us(None)
    flops = case.flops / (us * 1e-6)
    rows.append((f"prefill {PREFILL_TOKENS} tok", us, f"{flops / 1e12:.0f} TFLOP/s of {peak / 1e12:.0f}",
                 flops / peak, 0.55))
    # the 8-warp 128-row tiles the tuner now also searches (a shipped file tuned before them has
    # none): the best of them, so that one run shows whether re-tuning (moe-tune) pays
    times = {}
    for cfg in PREFILL_CANDIDATES:
        try:
            times[cfg] = case.per_call_us(cfg)
        except Exception as e:  # noqa: BLE001 (a tile that does not fit is reported, not fatal)
            print(f"  prefill {cfg}: {type(e).__name__}: {str(e)[:100]}", flush=True)
    if times:
        best = min(times, key=times.get)
        flops = case.flops / (times[best] * 1e-6)
        tile = f"{best.BLOCK_SIZE_M}x{best.BLOCK_SIZE_N}x{best.BLOCK_SIZE_K} g{best.GROUP_SIZE_M} s{best.num_stages}"
        rows.append((f"prefill {PREFILL_TOKENS} tok 8-warp", times[best], f"{flops / 1e12:.0f} TFLOP/s, {tile}",
                     flops / peak, 0.55))
    del case
    case = MoeCase(shape, shape.intermediate, TUNED_TOKENS, reps_for(TUNED_TOKENS), seed=2)
    # the baseline is vLLM's untuned heuristic (get_default_config), as in vLLM's own claim that
    # tuned configs are worth it; our own untuned default is shown beside it
    vllm_us = case.per_call_us(fm.vllm_default_config(TUNED_TOKENS, shape.num_experts))
    default_us = case.per_call_us(fm.default_config(TUNED_TOKENS, shape.num_experts, shape.top_k))
    tuned_us = case.per_call_us(fm.nearest_config(tuned, TUNED_TOKENS)) if tuned else float("nan")
    rows.append((f"{TUNED_TOKENS} tok tuned", tuned_us, f"vLLM default {vllm_us:.1f} (ours {default_us:.1f}) us",
                 vllm_us / tuned_us if tuned else float("nan"), 1.15))

    print(f"\n{'fused MoE kernel':24s} {'us':>9s}  {'rate':28s} {'measured':>9s} {'target':>7s}")
    for name, us, rate, frac, target in rows:
        ratio = name.endswith("tuned")
        shown = f"{frac:.2f}x" if ratio else f"{100 * frac:.0f}%"
        want = f">={target:.2f}x" if ratio else f">={100 * target:.0f}%"
        ok = "ok" if frac >= target else "MISS"
        print(f"{name:24s} {us:9.1f}  {rate:28s} {shown:>9s} {want:>7s} {ok}")
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump({"model_shape": args.model_shape, "device": device, "tuned_file": tuned_file if tuned else None,
                       "rows": [dict(name=n, us=u, rate=r, measured=fr, target=t) for n, u, r, fr, t in rows]},
                      f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
