"""Compile Triton kernels for an H200 (sm_90) on a machine without a GPU, with the ptxas of the
Triton wheel, and print each variant's registers and spills (ptxas -v): compile errors the
interpreter does not raise (a loop-carried variable changing dtype) and spills show up before a
device call. The LoRA kernels' variants at Llama-3.1-8B tiles (issue 51).

    export PYTHONPATH=$PWD; python3 -m bench.ptxas_check

Exits non-zero if a variant fails to compile (spills are printed: a few bytes outside the main loop
cost nothing; hundreds, as the sorted shrink's 504 at 255 registers before session 36's fix, do).
"""
from __future__ import annotations

import os
import re
import subprocess
import sys
import tempfile

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from kernels import gemv as gv
from kernels import lora as lk

TARGET = GPUTarget("cuda", 90, 32)


def _ptxas() -> str:
    """The ptxas Triton itself runs for the target (newer Triton wheels bundle two)."""
    try:
        from triton.backends.nvidia.compiler import get_ptxas
        return get_ptxas(TARGET.arch).path
    except (ImportError, TypeError, AttributeError):
        return os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")


def compile_variant(fn, types: dict, consts: dict, num_warps: int) -> tuple[int, int]:
    """(registers, bytes of spill stores) of fn compiled with these pointer/scalar types and
    constexprs (arguments not named in either: i32), from `ptxas -v` on Triton's PTX."""
    sig = {a: "constexpr" if a in consts else types.get(a, "i32") for a in fn.arg_names}
    src = ASTSource(fn=fn, signature=sig, constexprs={(fn.arg_names.index(k),): v for k, v in consts.items()})
    compiled = triton.compile(src, target=TARGET, options=dict(num_warps=num_warps))
    with tempfile.NamedTemporaryFile(suffix=".ptx", mode="w") as f:
        f.write(compiled.asm["ptx"])
        f.flush()
        info = subprocess.run([_ptxas(), "-v", f"-arch=sm_{TARGET.arch}a", f.name, "-o", os.devnull],
                              capture_output=True, text=True).stderr
    reg, spill = re.search(r"Used (\d+) registers", info), re.search(r"(\d+) bytes spill stores", info)
    return int(reg.group(1)) if reg else -1, int(spill.group(1)) if spill else -1


def _ptrs(*names: str, dtype: str = "*bf16") -> dict:
    return dict.fromkeys(names, dtype)


def lora_variants():
    """(name, kernel, types, constexprs, num_warps) of the LoRA routes at Llama-3.1-8B tiles."""
    sorted_types = {**_ptrs("x_ptr", "a_ptr"), "slots_ptr": "*i32", "out_ptr": "*fp32"}
    expand_types = {**_ptrs("y_ptr", "b_ptr"), "xa_ptr": "*fp32", "slots_ptr": "*i32"}
    for rows, block_m, block_t in ((16, 16, 16), (256, 32, 64)):
        yield (f"shrink sorted, {rows} rows", lk._lora_shrink_sorted_kernel, sorted_types,
               dict(BLOCK_M=block_m, BLOCK_N=64, BLOCK_K=64, BLOCK_T=block_t, BLOCK_S=16, PRECISION="tf32",
                    UPCAST=False, PDL=True), 8)
        yield (f"expand sorted, {rows} rows", lk._lora_expand_sorted_kernel, expand_types,
               dict(NUM_SLICES=3, BLOCK_M=block_m, BLOCK_N=128, BLOCK_R=16, BLOCK_T=block_t, BLOCK_S=16, SPLITS=8,
                    PRECISION="tf32", UPCAST=False, PDL=True), 4)
    yield ("shrink per row", lk._lora_shrink_kernel, sorted_types,
           dict(BLOCK_M=1, BLOCK_N=64, BLOCK_K=128, PRECISION="tf32", UPCAST=False, PDL=True), 4)
    gemv_types = {**_ptrs("x_ptr", "r_ptr", "nw_ptr", "w_ptr", "b_ptr", "y_ptr", "r_out_ptr", "s_ptr", "lb_ptr",
                          "xo_ptr"), "lxa_ptr": "*fp32", "ls_ptr": "*i32", "ws_ptr": "*i32", "eps": "fp32"}
    base = dict(HAS_BIAS=False, HAS_SCALE=False, PDL=True, L_SPLITS=1, L_BLOCK_R=16, W_SLOT=False, WRITE_X=False,
                K_SPLIT=False, LORA_SLICES=0, PROLOGUE=0, EVEN=True, BLOCK_M=1)
    for name, block_n, block_k, slices, splits in (("gate_up", 4, 2048, 2, 4), ("o", 16, 1024, 1, 8)):
        yield (f"gemv {name}", gv._gemv_kernel, gemv_types, dict(base, BLOCK_N=block_n, BLOCK_K=block_k), 8)
        yield (f"gemv {name} + expand", gv._gemv_kernel, gemv_types,
               dict(base, BLOCK_N=block_n, BLOCK_K=block_k, LORA_SLICES=slices, L_SPLITS=splits), 8)
    tiles = gv.SHRINK_TILES
    for prologue in ("add_rms_norm", "silu_mul"):
        yield (f"shrink with {prologue}", gv._gemv_kernel, {**gemv_types, "y_ptr": "*fp32"},
               dict(base, PROLOGUE=gv.PROLOGUES.index(prologue), EVEN=False, BLOCK_N=tiles["block_n"],
                    BLOCK_K=tiles["block_k"], W_SLOT=True, WRITE_X=True, K_SPLIT=True), tiles["num_warps"])


def main() -> int:
    print(f"triton {triton.__version__}, target sm_{TARGET.arch}", flush=True)
    bad = 0
    for name, fn, types, consts, num_warps in lora_variants():
        try:
            reg, spill = compile_variant(fn, types, consts, num_warps)
        except Exception as exc:   # a compile error: the variant's message
            print(f"FAIL {name}: {type(exc).__name__}: {str(exc)[:1500]}", flush=True)
            bad += 1
            continue
        print(f"{'SPILL' if spill > 0 else 'ok':5s} {name}: {num_warps} warps, {reg} registers, spill stores {spill} B",
              flush=True)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
