"""Sweep kernels/gemv.py's tiles on the GPU against what it replaces (cuBLAS, after the
separate norm or SiLU kernel) at the decode shapes of the benchmark models; print each
shape's fastest tiles. The numbers behind kernels/gemv.py's tile_config.

    export PYTHONPATH=$PWD; python3 -m bench.tune_gemv [--shapes qwen3 llama8b ...]

Each time is one call's share of a CUDA graph that runs the op once per copy of the
weight, over copies that together exceed L2 (as a model's layers do), so every call
reads its weight from HBM.
"""
from __future__ import annotations

import argparse
import itertools
import json

import torch
import torch.nn.functional as F

from kernels import gemv as gv
from kernels.activation import silu_and_mul
from kernels.rms_norm import fused_add_rms_norm

HBM_BYTES_PER_S = 4.3e12
# model: [(name, N, K, prologue)] of one layer's linears (per rank under TP)
SHAPES = {
    "qwen3": [("qkv", 4096, 1024, "add_rms_norm"), ("o", 1024, 2048, "none"),
              ("gate_up", 6144, 1024, "add_rms_norm"), ("down", 1024, 3072, "silu_mul")],
    "llama8b": [("qkv", 6144, 4096, "add_rms_norm"), ("o", 4096, 4096, "none"),
                ("gate_up", 28672, 4096, "add_rms_norm"), ("down", 4096, 14336, "silu_mul")],
    "llama8b-tp2": [("qkv", 3072, 4096, "add_rms_norm"), ("o", 4096, 2048, "none"),
                    ("gate_up", 14336, 4096, "add_rms_norm"), ("down", 4096, 7168, "silu_mul")],
    "llama70b-tp2": [("qkv", 5120, 8192, "add_rms_norm"), ("o", 8192, 4096, "none"),
                     ("gate_up", 28672, 8192, "add_rms_norm"), ("down", 8192, 14336, "silu_mul")],
    # with the fused all-reduce + RMSNorm (workers/distributed.py), qkv and gate_up read normed input
    "llama8b-tp2-fused": [("qkv", 3072, 4096, "none"), ("gate_up", 14336, 4096, "none")],
    "llama70b-tp2-fused": [("qkv", 5120, 8192, "none"), ("gate_up", 28672, 8192, "none")],
    "qwen3-8b-tp2-fused": [("qkv", 3072, 4096, "none"), ("gate_up", 12288, 4096, "none")],
    # Qwen3-30B-A3B's attention and router (the experts run kernels/fused_moe.py)
    "qwen3-30b-a3b": [("qkv", 5120, 2048, "add_rms_norm"), ("o", 2048, 4096, "none"), ("router", 128, 2048, "none")],
}
# the GEMV's, swept at 1 and MAX_ROWS rows; tiles whose [rows, BLOCK_N, BLOCK_K] product needs
# more than 128 fp32 registers per thread are skipped (they spill)
GRID = [dict(block_n=bn, block_k=bk, num_warps=w, num_stages=s)
        for bn, bk, w, s in itertools.product([2, 4, 8, 16, 32], [256, 512, 1024, 2048], [4, 8], [1, 3, 5])]
# kernels/skinny_gemm.py's, above MAX_ROWS rows; split_k > 1 is kept where the grid has 1/2 to
# 2 programs per SM (fewer leave SMs idle; more only add partial sums), split_k 1 from 1/2
MMA_GRID = [dict(block_n=bn, block_k=bk, split_k=sk, swap=sw, num_warps=w, num_stages=s)
            for bn, bk, sk, sw, w, s in itertools.product([32, 64, 128], [64, 128, 256], [1, 2, 4, 8], [False, True],
                                                          [4, 8], [3, 4, 5])]
ROW_BUCKETS = [1, gv.MAX_ROWS] + [b for b in (16, 32, 64) if b <= gv.MAX_DECODE_ROWS]


def fits(tiles: dict, rows: int, n: int, sms: int) -> bool:
    if rows <= gv.MAX_ROWS:
        return rows * tiles["block_n"] * tiles["block_k"] <= 128 * 32 * tiles["num_warps"]
    programs = -(-n // tiles["block_n"]) * tiles["split_k"]
    return sms // 2 <= programs and (tiles["split_k"] == 1 or programs <= 2 * sms)


def per_call_us(fn, copies: int, iters: int = 10) -> float:
    """Capture fn(i) for every copy i in one graph; us per call over `iters` replays."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for i in range(copies):  # warm-up (and compile) outside the capture
            fn(i)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(copies):
            fn(i)
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1e3 / iters / copies


class Case:
    """Weights (enough copies to exceed L2) and inputs of one shape at `m` rows."""

    def __init__(self, n: int, k: int, prologue: str, m: int, gen: torch.Generator, fp8: bool = False):
        self.prologue, self.m, self.fp8 = prologue, m, fp8
        elem = 1 if fp8 else 2
        self.copies = max(4, min(64, -(-(256 << 20) // (n * k * elem))))
        self.w = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16, generator=gen) * 0.02
                  for _ in range(self.copies)]
        self.scale = None
        if fp8:   # per output channel, as --quantization fp8 stores them (workers/quantization/fp8.py)
            self.scale = torch.stack([w.float().abs().amax(1) / 448.0 for w in self.w]).clamp_min(1e-12)
            self.w = [(w.float() / s[:, None]).to(torch.float8_e4m3fn) for w, s in zip(self.w, self.scale)]
        self.x = torch.randn(m, 2 * k if prologue == "silu_mul" else k, device="cuda", dtype=torch.bfloat16,
                             generator=gen)
        self.r = torch.randn(m, k, device="cuda", dtype=torch.bfloat16, generator=gen)
        self.nw = torch.rand(k, device="cuda", dtype=torch.bfloat16, generator=gen) + 0.5
        self.kw = dict(prologue=prologue, residual=self.r if prologue == "add_rms_norm" else None,
                       norm_weight=self.nw, eps=1e-6)
        self.bytes = n * k * elem

    def kwargs(self, i: int) -> dict:
        return self.kw if self.scale is None else dict(self.kw, scale=self.scale[i])

    def unfused(self, i: int):
        if self.fp8:   # what it replaces: the route fp8_tile_config picks without an fp8 entry
            return gv.gemv(self.x, self.w[i], **self.kwargs(i))
        x = self.x
        if self.prologue == "add_rms_norm":
            x, _ = fused_add_rms_norm(x, self.r, self.nw, 1e-6)
        elif self.prologue == "silu_mul":
            x = silu_and_mul(x)
        return F.linear(x, self.w[i])

    def fused(self, tiles):
        return lambda i: gv.gemv(self.x, self.w[i], tiles=tiles, **self.kwargs(i))

    def split(self, tiles):
        """The prologue's own kernel, then the GEMV without it."""
        return self.fused(dict(tiles, fuse=False))

    def error(self, tiles) -> float:
        """Largest error against the fp32 reference, relative to the largest output."""
        residual = self.r.float() if self.kw["residual"] is not None else None
        w = self.w[0].float() if self.scale is None else self.w[0].float() * self.scale[0][:, None]
        want, _ = gv.gemv_ref(self.x.float(), w, prologue=self.prologue, residual=residual,
                              norm_weight=self.nw.float(), eps=1e-6)
        got, _ = gv.gemv(self.x, self.w[0], tiles=tiles, **self.kwargs(0))
        return ((got.float() - want).abs().max() / want.abs().max().clamp_min(1e-6)).item()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES), help="models to sweep")
    ap.add_argument("--top", type=int, default=3, help="tiles per shape (of the plain sweep) to time with the prologue")
    ap.add_argument("--rows", nargs="+", type=int, default=[1, gv.MAX_ROWS], choices=ROW_BUCKETS,
                    help="row buckets to sweep (above MAX_ROWS: kernels/skinny_gemm.py's tiles)")
    ap.add_argument("--margin", type=float, default=0.03, help="the GEMV must beat the unfused ops by this much")
    ap.add_argument("--block-n", nargs="+", type=int, help="sweep only these BLOCK_N (default: all)")
    ap.add_argument("--block-k", nargs="+", type=int, help="sweep only these BLOCK_K (default: all)")
    ap.add_argument("--num-stages", nargs="+", type=int, help="sweep only these num_stages (default: all)")
    ap.add_argument("--num-warps", nargs="+", type=int, help="sweep only these num_warps (default: all)")
    ap.add_argument("--fp8", action="store_true",
                    help="float8_e4m3fn weights scaled per output channel (--quantization fp8's decode GEMV): "
                         "tiles against fp8_tile_config's untuned choice, written as fp8:ROWS:NxK:PROLOGUE")
    ap.add_argument("--write", metavar="PATH", help="write the chosen tiles as JSON (kernels/gemv_tiles.json)")
    args = ap.parse_args()
    def chosen_grid(grid):
        return [t for t in grid if (not args.block_n or t["block_n"] in args.block_n)
                and (not args.block_k or t["block_k"] in args.block_k)
                and (not args.num_stages or t["num_stages"] in args.num_stages)
                and (not args.num_warps or t["num_warps"] in args.num_warps)]
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    print(torch.cuda.get_device_name(), flush=True)
    gen = torch.Generator(device="cuda").manual_seed(0)
    chosen: dict[str, dict | None] = {}
    totals: dict[str, list[float]] = {}
    for model in args.shapes:
        for name, n, k, prologue in SHAPES[model]:
            floor = n * k * 2 / HBM_BYTES_PER_S * 1e6
            print(f"\n== {model} {name} [{n}x{k}] {prologue}: floor {floor:.1f} us", flush=True)
            for rows in args.rows:
                # the tiles swept without a prologue, then the best few with it, against the unfused ops
                base = Case(n, k, "none", rows, gen, args.fp8)
                swept = []
                grid = chosen_grid(GRID if rows <= gv.MAX_ROWS else MMA_GRID)
                if args.fp8:   # half the bytes per element: twice the K per tile is worth a try
                    grid += chosen_grid([dict(t, block_k=4096) for t in GRID if t["block_k"] == 2048])
                for t in (t for t in grid if fits(t, rows, n, sms)):
                    try:
                        swept.append((per_call_us(base.fused(t), base.copies), t))
                    except Exception as exc:  # out of resources for this tile
                        print(f"  {t}: {type(exc).__name__}", flush=True)
                swept.sort(key=lambda r: r[0])
                del base
                case = Case(n, k, prologue, rows, gen, args.fp8)
                unfused = per_call_us(case.unfused, case.copies)
                timed = [(per_call_us(case.fused(t), case.copies), i) for i, (_, t) in enumerate(swept[:args.top])]
                us, i = min(timed)
                best = swept[i][1]
                if prologue != "none" and rows <= gv.MAX_ROWS:  # or the prologue's own kernel first
                    split_us = per_call_us(case.split(swept[0][1]), case.copies)
                    print(f"  rows={rows}: prologue kernel + plain gemv {split_us:6.1f} us", flush=True)
                    if split_us < us:
                        us, best = split_us, dict(swept[0][1], fuse=False)
                wins = us < unfused * (1 - args.margin)
                chosen[f"{'fp8:' if args.fp8 else ''}{rows}:{n}x{k}:{prologue}"] = best if wins else None
                tot = totals.setdefault(f"{model} rows={rows}", [0.0, 0.0])
                tot[0] += unfused
                tot[1] += min(us, unfused) if wins else unfused
                print(f"  rows={rows}: unfused {unfused:6.1f} us | gemv {us:6.1f} us {best} "
                      f"({case.bytes / us / 1e3:.0f} GB/s, rel err {case.error(best):.1e}) -> "
                      f"{'gemv' if wins else 'unfused'}; plain sweep top: " +
                      ", ".join(f"{u:.1f}" for u, _ in swept[:args.top]), flush=True)
                del case
                torch.cuda.empty_cache()
    print("\nper layer (us), unfused -> chosen: " + "; ".join(
        f"{m} {a:.1f} -> {b:.1f}" for m, (a, b) in totals.items()))
    if args.write:  # merged into what the file holds: a sweep of some shapes keeps the others'
        try:
            with open(args.write) as f:
                chosen = {**json.load(f), **chosen}
        except FileNotFoundError:
            pass
        with open(args.write, "w") as f:
            json.dump(chosen, f, indent=1, sort_keys=True)
            f.write("\n")
        print(f"wrote {len(chosen)} entries to {args.write}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
