"""The fused MoE's small-batch paths on the GPU, side by side (issue 45's decode row):

    export PYTHONPATH=$PWD; python3 -m bench.moe_decode [--model-shape qwen3-30b-a3b] [--tokens 1 2 4 8]
        [--variants 4,2048,4,1024,8 8,2048,8,1024,8 ...] [--output-json F]

For each token count: the grouped GEMMs (alignment, two grouped GEMMs, top-k sum: the path
before the GEMV one, with the tuned or default tiles it picks), then the GEMV path with each
--variants tile set (UP_BLOCK_N,UP_BLOCK_K,DOWN_BLOCK_N,DOWN_BLOCK_K,num_warps; set the winner
with LOOM_MOE_GEMV_TILES), and what fused_moe itself runs at that count (LOOM_MOE_GEMV_MAX_TOKENS
decides). Each time is one call's share of a CUDA graph over 16 different routings (so a call
reads other experts than the last one's, not L2), as bench/tune_moe.py times; the rate is the
distinct chosen experts' weight bytes over it, against 4.3 TB/s (target >= 75%). Every
variant's output is checked against the grouped path's.
"""
from __future__ import annotations

import argparse
import json

import torch

from bench.tune_moe import HBM_BYTES_PER_S, MODEL_SHAPES, MoeCase, rel_error
from kernels import fused_moe as fm

# the default first; none spills at Qwen3-30B-A3B's shape (ptxas sm_90a): 127/86 registers (up/down)
# for the default (2 CTAs of 8 warps per SM, 32 KB of loads each), 58-106 for the narrower ones
# (more CTAs per SM: fewer bubbles between a CTA's loads and its reduction), 126/165 for 16-wide
VARIANTS = ["2,2048,2,256,4", "4,2048,4,256,8", "8,1024,8,128,8", "2,2048,4,128,8", "4,1024,2,256,4",
            "2,1024,2,128,4", "16,512,16,128,8"]
TARGET = 0.75


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model-shape", default="qwen3-30b-a3b", choices=list(MODEL_SHAPES))
    ap.add_argument("--tokens", type=int, nargs="+", default=[1, 2, 4, 8])
    ap.add_argument("--variants", nargs="+", default=VARIANTS, help="GEMV tile sets to time")
    ap.add_argument("--output-json", default=None)
    args = ap.parse_args()
    shape = MODEL_SHAPES[args.model_shape]
    variants = [fm.MoeGemvConfig.parse(v) for v in args.variants]
    dev = torch.device("cuda")
    print(f"{args.model_shape} layer (E={shape.num_experts}, H={shape.hidden}, I={shape.intermediate}, "
          f"top-{shape.top_k}); GEMV path up to {fm.gemv_max_tokens()} tokens", flush=True)
    rows = []
    for m in args.tokens:
        case = MoeCase(shape, shape.intermediate, m, 16, seed=m)
        grouped = fm.get_config(m, shape.num_experts, shape.intermediate, shape.top_k, torch.bfloat16, dev)
        want = case.run(grouped)
        row = {"tokens": m, "weight_bytes": case.weight_bytes, "grouped_us": case.per_call_us(grouped),
               "auto_us": case.per_call_us(None), "gemv_us": {}, "gemv_err": {}}
        for name, v in zip(args.variants, variants):
            try:
                row["gemv_err"][name] = rel_error(case.run(None, gemv=v), want)
                row["gemv_us"][name] = case.per_call_us(None, gemv=v)
            except Exception as e:  # noqa: BLE001 (a variant that does not compile is reported, not fatal)
                print(f"  {m} tok, {name}: {type(e).__name__}: {str(e)[:120]}", flush=True)
        rows.append(row)
        print(f"{m} tok: grouped {row['grouped_us']:.1f} us, auto {row['auto_us']:.1f} us, gemv "
              + ", ".join(f"{n} {u:.1f}" for n, u in row["gemv_us"].items()), flush=True)
        del case

    def frac(row, us):
        return row["weight_bytes"] / (us * 1e-6) / HBM_BYTES_PER_S

    print(f"\nfused MoE decode, us (% of {HBM_BYTES_PER_S / 1e12:.1f} TB/s on the chosen experts' weights)")
    head = ["tokens", "grouped", "auto"] + args.variants
    print("  ".join(f"{h:>17s}" for h in head))
    for row in rows:
        cells = [str(row["tokens"])] + [f"{row[k]:.1f} ({100 * frac(row, row[k]):.0f}%)" for k in ("grouped_us", "auto_us")]
        for name in args.variants:
            us, err = row["gemv_us"].get(name), row["gemv_err"].get(name, 0.0)
            cells.append("-" if us is None else f"{us:.1f} ({100 * frac(row, us):.0f}%)" + ("!" if err > 2e-2 else ""))
        print("  ".join(f"{c:>17s}" for c in cells))
    print("(! = output differs from the grouped path's by more than 2e-2)")
    out_rows = []
    for row in rows:
        best = min(row["gemv_us"], key=row["gemv_us"].get) if row["gemv_us"] else None
        out_rows.append(dict(name=f"decode {row['tokens']} tok grouped", us=row["grouped_us"],
                             measured=frac(row, row["grouped_us"]), target=TARGET))
        if best:
            out_rows.append(dict(name=f"decode {row['tokens']} tok gemv {best}", us=row["gemv_us"][best],
                                 measured=frac(row, row["gemv_us"][best]), target=TARGET))
        out_rows.append(dict(name=f"decode {row['tokens']} tok as dispatched", us=row["auto_us"],
                             measured=frac(row, row["auto_us"]), target=TARGET))
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump({"model_shape": args.model_shape, "rows": out_rows, "detail": rows}, f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
