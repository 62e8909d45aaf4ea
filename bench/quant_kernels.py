"""Micro-benchmark of every quantized-linear kernel variant at Llama-3.1-8B's linear shapes (H200),
beside bf16 (cuBLAS, and at decode rows kernels/gemv.py's GEMV), then a choice table:

    export PYTHONPATH=$PWD; python3 -m bench.quant_kernels [--rows 1 2 4 8 16 64 256 2048]
        [--shapes qkv o gate_up down] [--only w4] [--sweep]

Each time is one call's share of a CUDA graph that runs the op once per copy of its weights,
over copies that together exceed L2 (bench/tune_gemv.per_call_us), so every call reads its
weights from HBM as a model's layers do. Per (N x K, rows, variant): microseconds, the weight
bytes read per second (GB/s; the bound at decode rows, H200 HBM ~4.8 TB/s) and TFLOP/s.

Variants (`default` is what the model runs, the others are the alternatives it could run):
  bf16     cublas (F.linear), gemv (kernels/gemv.py, <= 8 rows)
  fp8      default (fp8_gemv / _scaled_mm), gemv-wide (BLOCK_K doubled: LOOM_FP8_GEMV=wide),
           legacy (session 30's GEMV: LOOM_FP8_GEMV=legacy), scaled_mm (at every row count)
  fp8blk   default (block GEMV <= 8 rows, block-scaled Triton GEMM above)
  w4a16    default (kernels/w4a16.w4a16_linear_nk), gemm (the fused GEMM at every row count),
           dense (dequantize whole + cuBLAS), actorder (default with the per-call x permutation),
           legacy (with --legacy: session 30's [K/8, N] kernels), and with --sweep at one row the GEMV tiles
           BLOCK_N,BLOCK_KW,WARPS,STAGES (LOOM_W4A16_GEMV_TILES takes the winner)
The choice table sums the four linears (one decoder layer) per family and row count: the
default's time, the fastest variant's, bf16's best and the speedup (bf16 best / default); then
the kernel-level targets derived from issue 46's (measured vs target). A timeout (SIGTERM) still prints the tables of what ran.
"""
from __future__ import annotations

import argparse
import math
import signal
import sys
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from bench.tune_gemv import per_call_us
from kernels import fp8_linear as f8
from kernels import gemv as gv
from kernels import w4a16 as w4

SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)}
ROWS = [1, 2, 4, 8, 16, 64, 256, 2048]
GROUP = 128
DEVICE = "cuda"   # (tests/test_bench.py smoke-runs the tables on CPU, interpreted)
HBM_GBS = 4800.0
L2_BYTES = 60 << 20   # H200: 50 MiB (rounded up): copies of each weight cover twice this
W4_GEMV_SWEEP = [(4, 256, 4, 3), (8, 128, 4, 3), (8, 256, 4, 3), (16, 128, 4, 3), (4, 512, 8, 3), (8, 256, 8, 4),
                 (16, 64, 4, 4), (2, 512, 4, 3), (16, 16, 4, 3), (32, 16, 4, 3)]   # the last two: a scale per row


@dataclass
class Timing:
    shape: str
    rows: int
    family: str
    variant: str
    us: float


def copies_for(nbytes: int) -> int:
    return max(1, min(64, math.ceil(2 * L2_BYTES / nbytes)))


class Weights:
    """One shape's weights in every format, `copies` of each (each format its own count)."""

    def __init__(self, n: int, k: int, legacy: bool):
        dev, bf16 = DEVICE, torch.bfloat16
        self.n, self.k = n, k
        dense = torch.randn(n, k, device=dev) * 0.02
        cb = copies_for(n * k * 2)
        self.bf16 = [dense.to(bf16) for _ in range(cb)]
        q, s = f8.quantize_rows(dense)
        self.fp8 = [(q.clone(), s.clone()) for _ in range(copies_for(n * k))]
        q, s = f8.quantize_blocks(dense)
        self.blk = [(q.clone(), s.clone()) for _ in range(copies_for(n * k))]
        del dense
        qweight = w4.pack_k(torch.randint(0, 16, (k, n), device=dev, dtype=torch.int32))
        scales = (torch.rand(k // GROUP, n, device=dev) * 0.002).to(bf16)
        zeros = torch.randint(0, 16, (k // GROUP, n), device=dev).to(bf16)
        g_idx = (torch.randperm(k, device=dev) // GROUP).to(torch.int32)
        c4 = copies_for(n * k // 2)
        nk = w4.repack_nk(qweight, scales, zeros, None, GROUP)
        self.w4 = [tuple(t.clone() if t is not None else None for t in nk) for _ in range(c4)]
        nk = w4.repack_nk(qweight, scales, zeros, g_idx, GROUP)
        self.w4_act = [tuple(t.clone() if t is not None else None for t in nk) for _ in range(c4)]
        self.w4_kn = [(qweight.clone(), scales.clone(), zeros.clone()) for _ in range(c4)] if legacy else []


def variants(w: Weights, x: torch.Tensor, sweep: bool) -> dict[tuple[str, str], tuple]:
    """(family, variant) -> (fn(i), copies)."""
    m = x.shape[0]
    decode = m <= f8.MAX_GEMV_ROWS
    out: dict[tuple[str, str], tuple] = {}
    out["bf16", "cublas"] = (lambda i: F.linear(x, w.bf16[i]), len(w.bf16))
    if decode:
        out["bf16", "gemv"] = (lambda i: gv.gemv(x, w.bf16[i])[0], len(w.bf16))
    # fp8 per channel
    out["fp8", "default"] = ((lambda i: f8.fp8_gemv(x, *w.fp8[i])) if decode else
                             (lambda i: f8.scaled_mm_per_channel(x, *w.fp8[i])), len(w.fp8))
    if decode:
        t = gv.fp8_tile_config(w.n, w.k, m)
        wide = dict(t, block_k=min(2 * t["block_k"], 1 << (w.k.bit_length() - 1)))
        out["fp8", "gemv-wide"] = (lambda i: gv.gemv(x, w.fp8[i][0], tiles=wide, scale=w.fp8[i][1])[0], len(w.fp8))
        out["fp8", "legacy"] = (lambda i: f8.fp8_gemv_legacy(x, *w.fp8[i]), len(w.fp8))
        out["fp8", "scaled_mm"] = (lambda i: f8.scaled_mm_per_channel(x, *w.fp8[i]), len(w.fp8))
    # fp8 block-wise
    out["fp8blk", "default"] = ((lambda i: f8.fp8_gemv(x, *w.blk[i], None, 128)) if decode else
                                (lambda i: f8.block_fp8_gemm(x, *w.blk[i], None, 128)), len(w.blk))
    # w4a16
    out["w4a16", "default"] = (lambda i: w4.w4a16_linear_nk(x, *w.w4[i], GROUP), len(w.w4))
    out["w4a16", "actorder"] = (lambda i: w4.w4a16_linear_nk(x, *w.w4_act[i], GROUP), len(w.w4))
    out["w4a16", "gemm"] = (lambda i: w4.w4a16_gemm_nk(x, *w.w4[i], GROUP), len(w.w4))
    if m >= 16:
        out["w4a16", "dense"] = (lambda i: F.linear(x, w4.dequantize_nk_to(*w.w4[i][:3], GROUP, x.dtype)), len(w.w4))
    if w.w4_kn:
        if decode:
            out["w4a16", "legacy"] = (lambda i: w4.w4a16_gemv(x, *w.w4_kn[i], None, GROUP), len(w.w4_kn))
        elif m < w4.DEQUANTIZE_ROWS:
            out["w4a16", "legacy"] = (lambda i: w4.w4a16_gemm(x, *w.w4_kn[i], None, GROUP), len(w.w4_kn))
    if sweep and m == 1:
        for tiles in W4_GEMV_SWEEP:
            out["w4a16", "gemv " + ",".join(map(str, tiles))] = (
                lambda i, t=tiles: w4.w4a16_gemv_nk(x, *w.w4[i], GROUP, tiles=t), len(w.w4))
    return out


def weight_bytes(family: str, n: int, k: int) -> float:
    return n * k * {"bf16": 2, "fp8": 1, "fp8blk": 1, "w4a16": 0.5}[family]


def print_tables(timings: list[Timing], shapes: list[str]) -> None:
    by = {(t.shape, t.rows, t.family, t.variant): t.us for t in timings}
    rows_seen = sorted({t.rows for t in timings})
    print("\n=== choice table: one Llama-3.1-8B layer's linears (sum over " + "+".join(shapes) + "), us")
    print(f"{'family':7} {'rows':>5} {'default':>9} {'best variant':>22} {'best':>9} {'bf16 best':>9} {'speedup':>7}")
    layer: dict[tuple[str, int, str], float] = {}
    for t in timings:
        layer[t.family, t.rows, t.variant] = layer.get((t.family, t.rows, t.variant), 0.0) + t.us
    complete = {key for key in layer if all((s, key[1], key[0], key[2]) in by for s in shapes)}
    for family in ("fp8", "fp8blk", "w4a16"):
        for rows in rows_seen:
            cands = {v: us for (f, r, v), us in layer.items() if f == family and r == rows and (f, r, v) in complete}
            bf = [us for (f, r, v), us in layer.items() if f == "bf16" and r == rows and (f, r, v) in complete]
            if not cands or not bf:
                continue
            best = min(cands, key=cands.get)
            d = cands.get("default", float("nan"))
            print(f"{family:7} {rows:5d} {d:9.1f} {best:>22} {cands[best]:9.1f} {min(bf):9.1f} {min(bf) / d:7.2f}x")

    def layer_us(family, rows, variant="default"):
        return layer.get((family, rows, variant)) if (family, rows, variant) in complete else None

    def bf16_best(rows):
        v = [layer_us("bf16", rows, x) for x in ("cublas", "gemv")]
        v = [x for x in v if x is not None]
        return min(v) if v else None

    def hbm(family, rows):
        us = layer_us(family, rows)
        total = sum(weight_bytes(family, *SHAPES[s]) for s in shapes)
        return None if us is None else total / us / 1e3 / HBM_GBS

    print("\n=== kernel targets (derived from issue 46's; HBM 4.8 TB/s)")
    print(f"{'measure':52} {'measured':>10} {'target':>10} met")
    checks = []
    for family, frac in (("fp8", 0.80), ("fp8blk", 0.70), ("w4a16", 0.70)):
        f = hbm(family, 1)
        if f is not None:
            checks.append((f"{family} default, 1 row: share of HBM bandwidth", f, frac, f >= frac))
    f = hbm("w4a16", 8)
    if f is not None:
        checks.append(("w4a16 default, 8 rows: share of HBM bandwidth", f, 0.6, f >= 0.6))
    for rows in (256, 2048):
        for family, ratio in (("fp8", 1.4), ("fp8blk", 1.3), ("w4a16", 0.9)):
            us, ref = layer_us(family, rows), layer_us("bf16", rows, "cublas")
            if us is not None and ref is not None:
                checks.append((f"{family} default, {rows} rows: bf16 cuBLAS time / its time", ref / us, ratio,
                               ref / us >= ratio))
    for name, got, target, ok in checks:
        print(f"{name:52} {got:10.3f} {'>= ' + str(target):>10} {'yes' if ok else 'NO'}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, nargs="+", default=ROWS)
    ap.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    ap.add_argument("--only", nargs="+", help="families or variants to time (substrings), bf16 always")
    ap.add_argument("--sweep", action="store_true", help="also sweep the W4A16 GEMV's tiles at one row")
    ap.add_argument("--legacy", action="store_true", help="also time session 30's W4A16 kernels ([K/8, N] layout)")
    args = ap.parse_args()
    timings: list[Timing] = []

    def stop(*_):
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, stop)
    print(f"{'shape':8} {'rows':>5} {'family':7} {'variant':22} {'us':>9} {'GB/s':>7} {'TFLOP/s':>8}", flush=True)
    # every shape's weights up front (~1 GB a shape), then row counts outermost: a run cut short
    # loses its largest row counts, not whole shapes (the choice table needs all four)
    weights = {name: Weights(*SHAPES[name], legacy=args.legacy) for name in args.shapes}
    try:
        for rows in args.rows:
            for name, w in weights.items():
                n, k = SHAPES[name]
                x = torch.randn(rows, k, device=DEVICE, dtype=torch.bfloat16)
                for (family, variant), (fn, copies) in variants(w, x, args.sweep).items():
                    if args.only and family != "bf16" and not any(o in f"{family} {variant}" for o in args.only):
                        continue
                    try:
                        us = per_call_us(fn, copies)
                    except Exception as e:   # a variant that cannot run here (e.g. a torch without rowwise _scaled_mm)
                        print(f"{name:8} {rows:5d} {family:7} {variant:22} failed: {type(e).__name__}: {e}"[:200])
                        continue
                    timings.append(Timing(name, rows, family, variant, us))
                    gbs = weight_bytes(family, n, k) / us / 1e3
                    print(f"{name:8} {rows:5d} {family:7} {variant:22} {us:9.1f} {gbs:7.0f} "
                          f"{2 * rows * n * k / us / 1e6:8.1f}", flush=True)
    except KeyboardInterrupt:
        print("(stopped: the tables cover what ran)", flush=True)
    print_tables(timings, args.shapes)
    return 0


if __name__ == "__main__":
    sys.exit(main())
