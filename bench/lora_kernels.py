"""The LoRA routes of one decoder layer's linears at Llama-3.1-8B shapes, on the GPU (issue 51):
us per layer in CUDA graphs, each route against the base linears alone, and each route's output
against the torch references. `bench/gpu_suite.sh lora-kernels`.

    export PYTHONPATH=$PWD; python3 -m bench.lora_kernels [--rows 1 256] [--adapters 8]

8 rank-16 adapters in the slots, row t on adapter t % 8, as `loom bench profile-step
--lora-adapters 8`. As bench.tune_gemv times, each call's weights and adapters are one of enough
copies to exceed L2 (as a model's 32 layers do), so they come from HBM.

Batch 1 (the linears' ops as the model runs them, the norm or SiLU included):
  base      the base model: the norm or SiLU kernel where the tiles say so, then the GEMV
  old       session 35's: the norm or SiLU, the shrink, cuBLAS (qkv / gate_up / down) or the GEMV
            with the expand in its epilogue (o), the expand's own kernel
  nofuse    the norm or SiLU, the shrink, the GEMV with the expand in its epilogue
            (LOOM_LORA_FUSED_SHRINK=0)
  new       the defaults: the shrink fused with the norm or SiLU (o: its own shrink), the GEMV with
            the expand in its epilogue
Batch 16-256 (the products only: cuBLAS, then the shrink and expand):
  base      cuBLAS
  rowwise   one program per row (LOOM_LORA_SORTED_ROWS=0)
  sorted    the rows in adapter order, tile products (the default from 16 rows)
"""
from __future__ import annotations

import argparse
import functools

import torch
import torch.nn.functional as F

from bench.tune_gemv import per_call_us
from kernels import gemv as gv
from kernels import lora as lk
from kernels.activation import silu_and_mul
from kernels.rms_norm import fused_add_rms_norm

# (name, N, K, prologue, slice widths) of a Llama-3.1-8B layer's linears
LINEARS = [("qkv", 6144, 4096, "add_rms_norm", (4096, 1024, 1024)), ("o", 4096, 4096, "none", (4096,)),
           ("gate_up", 28672, 4096, "add_rms_norm", (14336, 14336)), ("down", 4096, 14336, "silu_mul", (4096,))]
RANK = 16


class Layer:
    """One linear's weight, adapters and inputs at `rows` rows, in `copies` copies."""

    def __init__(self, n, k, prologue, slices, rows, adapters, gen):
        self.n, self.k, self.prologue, self.rows = n, k, prologue, rows
        self.starts = tuple(sum(slices[:j]) for j in range(len(slices)))
        self.copies = max(4, min(48, -(-(320 << 20) // (n * k * 2))))
        rnd = lambda *shape, s=0.02: torch.randn(*shape, device="cuda", generator=gen).mul_(s).bfloat16()   # noqa: E731
        self.w = [rnd(n, k) for _ in range(self.copies)]
        self.a = [rnd(adapters, len(slices) * RANK, k, s=0.05) for _ in range(self.copies)]
        self.b = [rnd(adapters, n, RANK, s=0.05) for _ in range(self.copies)]
        self.x = rnd(rows, 2 * k if prologue == "silu_mul" else k, s=1.0)
        self.r = rnd(rows, k, s=1.0)
        self.nw = (torch.rand(k, device="cuda", generator=gen) + 0.5).bfloat16()
        self.slots = (torch.arange(rows, device="cuda", dtype=torch.int32) % adapters)

    def norm_kw(self):
        if self.prologue == "add_rms_norm":
            return dict(residual=self.r, norm_weight=self.nw, eps=1e-6)
        return {}

    def input(self):
        """The linear's input as the model builds it (the prologue's own kernel)."""
        if self.prologue == "add_rms_norm":
            return fused_add_rms_norm(self.x, self.r, self.nw, 1e-6)[0]
        return silu_and_mul(self.x) if self.prologue == "silu_mul" else self.x

    # batch 1 --------------------------------------------------------------------------------
    def base1(self, i):
        return gv.gemv(self.x, self.w[i], prologue=self.prologue, **self.norm_kw())[0]

    def old1(self, i):
        x = self.input()
        xa = lk.lora_shrink(x, self.a[i], self.slots, splits=None)
        epi = gv.LoRAEpilogue(xa, self.b[i], self.slots, self.starts)
        if self.prologue == "none":
            return gv.gemv(x, self.w[i], lora=epi)[0]
        return lk.lora_expand(F.linear(x, self.w[i]), xa, self.b[i], self.slots, self.starts)

    def nofuse1(self, i):
        x = self.input()
        xa = lk.lora_shrink(x, self.a[i], self.slots, splits=None)
        return gv.gemv(x, self.w[i], lora=gv.LoRAEpilogue(xa, self.b[i], self.slots, self.starts))[0]

    def new1(self, i):
        if self.prologue == "none":
            x, epi = self.x, gv.LoRAEpilogue(lk.lora_shrink(self.x, self.a[i], self.slots, splits=None), self.b[i],
                                             self.slots, self.starts)
        else:
            xa, x, _ = gv.lora_shrink_prologue(self.x, self.a[i], self.slots, self.prologue, **self.norm_kw())
            epi = gv.LoRAEpilogue(xa, self.b[i], self.slots, self.starts)
        return gv.gemv(x, self.w[i], lora=epi)[0]

    # 16-256 rows ----------------------------------------------------------------------------
    def base_many(self, i, x):
        return F.linear(x, self.w[i])

    def routed(self, i, x, sorted_rows: bool):
        y = F.linear(x, self.w[i])
        xa = lk.lora_shrink(x, self.a[i], self.slots, splits=None, sorted_rows=sorted_rows)
        return lk.lora_expand(y, xa, self.b[i], self.slots, self.starts, sorted_rows=sorted_rows)

    def reference(self, i, x):
        xa = lk.lora_shrink_ref(x, self.a[i], self.slots)
        return lk.lora_expand_ref(F.linear(x.float(), self.w[i].float()), xa, self.b[i], self.slots, self.starts)


def _check(name: str, got: torch.Tensor, want: torch.Tensor, failures: list[str]) -> None:
    """got within 2% of want's largest value (the adapters' delta is ~half the product's size: a
    route that dropped it would be off by far more)."""
    err = ((got.float() - want.float()).abs().max() / want.float().abs().max()).item()
    if err > 2e-2:
        failures.append(f"{name}: relative error {err:.2e}")


def run(rows_list: list[int], adapters: int) -> int:
    gen = torch.Generator(device="cuda").manual_seed(0)
    failures: list[str] = []
    print(torch.cuda.get_device_name(), flush=True)
    for rows in rows_list:
        routes = ("base", "old", "nofuse", "new") if rows == 1 else ("base", "rowwise", "sorted")
        totals = dict.fromkeys(routes, 0.0)
        print(f"\n== {rows} row(s), {adapters} adapters of rank {RANK}, row t on adapter t % {adapters}: us per call",
              flush=True)
        print(f"{'linear':10s}" + "".join(f"{r:>10s}" for r in routes), flush=True)
        for name, n, k, prologue, slices in LINEARS:
            layer = Layer(n, k, prologue, slices, rows, adapters, gen)
            if rows == 1:
                fns = dict(base=layer.base1, old=layer.old1, nofuse=layer.nofuse1, new=layer.new1)
                want = layer.reference(0, layer.input())
            else:
                x = layer.input()
                fns = dict(base=functools.partial(layer.base_many, x=x),
                           rowwise=functools.partial(layer.routed, x=x, sorted_rows=False),
                           sorted=functools.partial(layer.routed, x=x, sorted_rows=True))
                want = layer.reference(0, x)
            for route in routes[1:]:
                _check(f"{rows} rows {name} {route}", fns[route](0), want, failures)
            us = {r: per_call_us(fns[r], layer.copies) for r in routes}
            for r in routes:
                totals[r] += us[r]
            print(f"{name:10s}" + "".join(f"{us[r]:10.1f}" for r in routes), flush=True)
            del layer
            torch.cuda.empty_cache()
        print(f"{'layer':10s}" + "".join(f"{totals[r]:10.1f}" for r in routes), flush=True)
        print("per step (32 layers) over base: " + ", ".join(
            f"{r} +{32 * (totals[r] - totals['base']) / 1e3:.2f} ms" for r in routes[1:]), flush=True)
    for f in failures:
        print(f"FAIL {f}", flush=True)
    return 1 if failures else 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", nargs="+", type=int, default=[1, 16, 64, 256], help="batch rows (1: the batch-1 routes)")
    ap.add_argument("--adapters", type=int, default=8, help="adapters in the slots (row t on t %% adapters)")
    args = ap.parse_args()
    return run(args.rows, args.adapters)


if __name__ == "__main__":
    raise SystemExit(main())
