"""Micro-benchmark of the quantized-linear kernels at Llama-3.1-8B's linear shapes (H200), against
bf16 (cuBLAS, and at decode rows the bf16 GEMV of kernels/gemv.py):

    export PYTHONPATH=$PWD; python3 -m bench.quant_kernels [--rows 1 8 256 2048]

Per (kernel, N x K, rows): microseconds (triton.testing.do_bench) and the weight bytes it must
read per microsecond (GB/s), so that a decode-row kernel reads as a fraction of HBM bandwidth.
"""
from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F
import triton

from kernels import fp8_linear as f8
from kernels import w4a16 as w4

SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)}


def _us(fn) -> float:
    return 1000 * triton.testing.do_bench(fn, warmup=10, rep=50)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 8, 256, 2048])
    args = ap.parse_args()
    from kernels.gemv import gemv
    dev, bf16 = "cuda", torch.bfloat16
    print(f"{'shape':8} {'rows':>5} {'kernel':18} {'us':>9} {'GB/s':>7}")
    for name, (n, k) in SHAPES.items():
        dense = torch.randn(n, k, device=dev) * 0.02
        w_bf16 = dense.to(bf16)
        w_fp8, s_fp8 = f8.quantize_rows(dense)
        w_blk, s_blk = f8.quantize_blocks(dense)
        qweight = w4.pack_k(torch.randint(0, 16, (k, n), device=dev, dtype=torch.int32))
        scales = (torch.rand(k // 128, n, device=dev) * 0.002).to(bf16)
        zeros = torch.full((k // 128, n), 8.0, device=dev, dtype=bf16)
        for rows in args.rows:
            x = torch.randn(rows, k, device=dev, dtype=bf16)
            decode = rows <= f8.MAX_GEMV_ROWS
            cases = {"bf16 cuBLAS": (lambda: F.linear(x, w_bf16), 2)}
            if decode:
                cases["bf16 gemv"] = (lambda: gemv(x, w_bf16)[0], 2)
                cases["fp8 gemv"] = (lambda: f8.fp8_gemv(x, w_fp8, s_fp8), 1)
                cases["fp8 block gemv"] = (lambda: f8.fp8_gemv(x, w_blk, s_blk, None, 128), 1)
                cases["w4a16 gemv"] = (lambda: w4.w4a16_gemv(x, qweight, scales, zeros, None, 128), 0.5)
            else:
                cases["fp8 _scaled_mm"] = (lambda: f8.scaled_mm_per_channel(x, w_fp8, s_fp8), 1)
                cases["fp8 block gemm"] = (lambda: f8.block_fp8_gemm(x, w_blk, s_blk), 1)
                cases["w4a16 gemm"] = (lambda: w4.w4a16_gemm(x, qweight, scales, zeros, None, 128), 0.5)
            for kernel, (fn, bytes_per_weight) in cases.items():
                us = _us(fn)
                print(f"{name:8} {rows:5d} {kernel:18} {us:9.1f} {n * k * bytes_per_weight / us / 1e3:7.0f}", flush=True)


if __name__ == "__main__":
    main()
