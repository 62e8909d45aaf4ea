"""Sweep kernels/linear.py's tiles on the GPU against cuBLAS (F.linear) at the
decode shapes of Qwen3-0.6B and Llama-3.1-8B; print each shape's fastest
configs. The numbers behind kernels/linear.py's tile_config.

    export PYTHONPATH=$PWD; python3 -m bench.tune_linear

Times are CUDA-graph replays (do_bench_cudagraph), as decode runs.
"""
from __future__ import annotations

import argparse
import itertools

import torch
import torch.nn.functional as F
import triton

from kernels.linear import skinny_linear, tile_config

SHAPES = {  # name: (N, K) of the weight
    "qwen3 qkv": (4096, 1024), "qwen3 o": (1024, 2048), "qwen3 gate_up": (6144, 1024), "qwen3 down": (1024, 3072),
    "llama8b qkv": (6144, 4096), "llama8b o": (4096, 4096), "llama8b gate_up": (28672, 4096),
    "llama8b down": (4096, 14336),
}


def _time(fn) -> float:
    try:
        return triton.testing.do_bench_cudagraph(fn, rep=20)
    except Exception:
        return triton.testing.do_bench(fn, warmup=5, rep=20)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 16])
    ap.add_argument("--top", type=int, default=4)
    args = ap.parse_args()
    print(torch.cuda.get_device_name(), "triton", triton.__version__, flush=True)
    grid = [dict(block_n=bn, block_k=bk, num_warps=w, num_stages=s)
            for bn, bk, w, s in itertools.product([16, 32, 64], [128, 256, 512], [4, 8], [3, 5])]
    gen = torch.Generator(device="cuda").manual_seed(0)
    total = {"cublas": 0.0, "default": 0.0, "best": 0.0}
    for name, (n, k) in SHAPES.items():
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16, generator=gen) * 0.02
        for m in args.rows:
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16, generator=gen)
            want = F.linear(x.float(), w.float())
            rows = []
            for t in grid:
                try:
                    err = (skinny_linear(x, w, None, t).float() - want).abs().max().item()
                    rows.append((_time(lambda: skinny_linear(x, w, None, t)), t, err))
                except Exception as exc:
                    print(f"  {name} m={m} {t}: {type(exc).__name__}", flush=True)
            rows.sort(key=lambda r: r[0])
            cublas = _time(lambda: F.linear(x, w))
            default = _time(lambda: skinny_linear(x, w))
            floor = n * k * 2 / 4.3e12 * 1e3
            total["cublas"] += cublas
            total["default"] += default
            total["best"] += rows[0][0]
            print(f"\n== {name} [{n}x{k}] m={m}: cuBLAS {cublas * 1e3:.1f} us, default {tile_config(n, k)} "
                  f"{default * 1e3:.1f} us, floor {floor * 1e3:.1f} us", flush=True)
            for ms, t, err in rows[:args.top]:
                print(f"  {ms * 1e3:7.1f} us  {t}  err {err:.3g}  ({n * k * 2 / ms / 1e9:.0f} GB/s)", flush=True)
    print("\nsum over shapes (us): " + ", ".join(f"{k} {v * 1e3:.1f}" for k, v in total.items()))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
