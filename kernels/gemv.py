"""y = act(x) W^T (+ b) for decode-sized batches (1 to MAX_ROWS rows), with the op
that produces the matmul's input fused into its load of x.

At batch 1 a decode step is a chain of small kernels: a Qwen3-0.6B layer is 2 norms,
4 GEMMs, the attention prologue, attention and SiLU, and each costs 3-12 us in a CUDA
graph while moving 1-3 us of bytes (bench/RESULTS.md). Here one program owns
BLOCK_N output columns for all rows and streams its [BLOCK_N, K] slice of W once, so
the weight is read once with no reduction pass, and the input is built on the fly:

    prologue "none"          x
    prologue "rms_norm"      rms_norm(x) * norm_weight                (the first layer)
    prologue "add_rms_norm"  rms_norm(x + residual) * norm_weight;    program 0 also
                             writes x + residual, the next residual
    prologue "silu_mul"      silu(x[:, :K]) * x[:, K:]                (the down projection)

so the separate norm and SiLU kernels of a decode layer disappear (on small weights;
see "fuse" below for large ones). Every program
computes the rows' RMS itself (a first pass over x: K elements per row, from L2).
Roundings are those of the unfused ops (kernels/rms_norm.py, kernels/activation.py):
the fused input is bit-identical to theirs, and the dot product differs from cuBLAS
only in summation order.

Tiles per weight shape: `tile_config`, from `python -m bench.tune_gemv` on an H200
(weights rotated through more than L2 holds, CUDA-graph replays); where cuBLAS after
the separate kernel measured faster, `gemv` runs those instead. On the H200, at one
row, it beats cuBLAS on every tuned shape: a Qwen3-0.6B layer's linears 35.8 -> 14.3
us, a Llama-3.1-8B layer's 123.9 -> 108.9 us (gate_up at 4.29 TB/s). On weights above
~25 MB the prologue runs as its own kernel first ("fuse": false), since there every
program's own pass over x costs more than that kernel. 2-8 rows keep cuBLAS.

From 9 to MAX_DECODE_ROWS rows, `gemv` runs the prologue's own kernel and then
kernels/skinny_gemm.py (tensor cores) where its tiles are tuned and faster than cuBLAS.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import NamedTuple

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from ipc import envs
from kernels.activation import silu_and_mul, silu_and_mul_ref
from kernels.jit import is_interpreted, pdl_args, pdl_wait, runs_triton
from kernels.rms_norm import fused_add_rms_norm, fused_add_rms_norm_ref, rms_norm, rms_norm_ref
from kernels.skinny_gemm import MAX_ROWS as MAX_DECODE_ROWS, skinny_gemm

MAX_ROWS = 8  # this module's kernel; up to MAX_DECODE_ROWS, kernels/skinny_gemm.py
PROLOGUES = ("none", "rms_norm", "add_rms_norm", "silu_mul")
_ADD_NORM, _SILU = PROLOGUES.index("add_rms_norm"), PROLOGUES.index("silu_mul")  # the kernel's PROLOGUE codes


_REF_OPS = (rms_norm_ref, fused_add_rms_norm_ref, silu_and_mul_ref)
_OPS = (rms_norm, fused_add_rms_norm, silu_and_mul)  # Triton where it runs, else the references


def _prologue(x, prologue, residual, norm_weight, eps, ops) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The matmul's input, and the new residual (add_rms_norm) or None, through `ops`."""
    norm, add_norm, silu_mul = ops
    if prologue == "rms_norm":
        return norm(x, norm_weight, eps), None
    if prologue == "add_rms_norm":
        return add_norm(x, residual, norm_weight, eps)
    return (silu_mul(x) if prologue == "silu_mul" else x), None


def gemv_ref(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, *,
             prologue: str = "none", residual: torch.Tensor | None = None,
             norm_weight: torch.Tensor | None = None, eps: float = 0.0):
    """The unfused ops in plain torch: (y, new residual or None)."""
    x, new_residual = _prologue(x, prologue, residual, norm_weight, eps, _REF_OPS)
    return F.linear(x, weight, bias), new_residual


@triton.jit
def _input_tile(x_rows, r_rows, nw_ptr, kk, mk, rstd, K, PROLOGUE: tl.constexpr):
    """[BLOCK_M, BLOCK_K] of the matmul's input at columns kk, in fp32, rounded as the unfused op."""
    dt = x_rows.dtype.element_ty
    if PROLOGUE == 3:  # silu(gate) * up
        g = tl.load(x_rows + kk[None, :], mask=mk, other=0.0).to(tl.float32)
        u = tl.load(x_rows + K + kk[None, :], mask=mk, other=0.0).to(tl.float32)
        silu = (g / (1.0 + tl.exp(-g))).to(dt).to(tl.float32)
        return (silu * u).to(dt).to(tl.float32)
    a = tl.load(x_rows + kk[None, :], mask=mk, other=0.0).to(tl.float32)
    if PROLOGUE == 2:
        a = (a + tl.load(r_rows + kk[None, :], mask=mk, other=0.0).to(tl.float32)).to(dt).to(tl.float32)
    if PROLOGUE == 1 or PROLOGUE == 2:
        nw = tl.load(nw_ptr + kk, mask=kk < K, other=0.0).to(tl.float32)
        a = (a * rstd[:, None]).to(dt).to(tl.float32)
        a = (a * nw[None, :]).to(dt).to(tl.float32)
    return a


@triton.jit
def _gemv_kernel(
    x_ptr, r_ptr, nw_ptr, w_ptr, b_ptr, y_ptr, r_out_ptr, s_ptr,
    M, N, K, stride_x, stride_r, stride_w, stride_y, eps,
    lxa_ptr, lb_ptr, ls_ptr, stride_lxm, stride_lxs, stride_lbs, L_R, L_S1, L_S2,
    ws_ptr, stride_ws, xo_ptr, stride_xo, K_CHUNK, stride_ys,
    PROLOGUE: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_SCALE: tl.constexpr, EVEN: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PDL: tl.constexpr,
    LORA_SLICES: tl.constexpr, L_SPLITS: tl.constexpr, L_BLOCK_R: tl.constexpr,
    W_SLOT: tl.constexpr, WRITE_X: tl.constexpr, K_SPLIT: tl.constexpr,
):
    pid = tl.program_id(0)
    if K_SPLIT:   # (the one-row LoRA shrink) grid axis 1 splits K into chunks, each stored as a partial
        pid_k = tl.program_id(1)
        k_lo = pid_k * K_CHUNK
        k_hi = tl.minimum(k_lo + K_CHUNK, K)
        y_ptr += pid_k * stride_ys
    else:
        pid_k = 0
        k_lo = 0
        k_hi = K
    offs_m = tl.arange(0, BLOCK_M)
    m_ok = offs_m < M
    offs_n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < N
    offs_k = tl.arange(0, BLOCK_K)
    x_rows = x_ptr + offs_m[:, None] * stride_x
    r_rows = r_ptr + offs_m[:, None] * stride_r

    if W_SLOT:   # the weight is row 0's adapter in a stack [slots, N, K] (none: slot -1, nothing loaded
        # or stored; the slot is the step's input, written before the kernel before this one ran)
        ws = tl.load(ws_ptr)
        w_ptr += tl.maximum(ws, 0).to(tl.int64) * stride_ws
        n_ok = offs_n < tl.where(ws >= 0, N, 0)
    # the first weight tile is constant: under PDL it loads while the kernel producing x finishes
    w_rows = w_ptr + offs_n.to(tl.int64)[:, None] * stride_w
    w_first = _weight_tile(w_rows, k_lo + offs_k, n_ok, k_hi, EVEN)
    if LORA_SLICES > 0:   # so are the rows' slots (the step's input) and their B rows: the epilogue's
        # loads that do not wait for the kernel before (the shrink's xa does)
        l_slots, l_b = _lora_b(lb_ptr, ls_ptr, offs_m, m_ok, offs_n, n_ok, stride_lbs, L_R, L_BLOCK_R)
    pdl_wait(PDL)
    if LORA_SLICES > 0:   # each row's adapter delta (kernels/lora.py's expand), added to the product below:
        # computed before the main loop, so that the shrink's xa loads wait under the first weight tile's
        l_delta = _lora_delta(lxa_ptr, l_slots, l_b, offs_m, offs_n, stride_lxm, stride_lxs, L_R, L_S1, L_S2,
                              LORA_SLICES, L_SPLITS, L_BLOCK_R, BLOCK_M, BLOCK_N)

    rstd = tl.zeros([BLOCK_M], dtype=tl.float32)
    if PROLOGUE == 1 or PROLOGUE == 2:
        write_ok = offs_m < tl.where(pid + pid_k == 0, M, 0)  # the residual's rows, in program 0 only
        # the rows' RMS, over the whole (added) rows; program 0 writes the new residual
        sq = tl.zeros([BLOCK_M], dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            kk = k0 + offs_k
            mk = m_ok[:, None] & (kk < K)[None, :]
            a = tl.load(x_rows + kk[None, :], mask=mk, other=0.0).to(tl.float32)
            if PROLOGUE == 2:
                a = (a + tl.load(r_rows + kk[None, :], mask=mk, other=0.0).to(tl.float32)).to(
                    r_out_ptr.dtype.element_ty)
                tl.store(r_out_ptr + offs_m[:, None] * K + kk[None, :], a, mask=write_ok[:, None] & (kk < K)[None, :])
                a = a.to(tl.float32)
            sq += tl.sum(a * a, 1)
        rstd = 1.0 / tl.sqrt(sq / K + eps)

    # the products accumulate per k lane and are summed over k once, after the loop (a sum per
    # tile made every iteration wait on a cross-warp reduction)
    # WRITE_X: the programs of column block 0 write the input they build (the norm's or SiLU's output)
    x_out = offs_m < tl.where(pid == 0, M, 0)
    kk = k_lo + offs_k
    a = _input_tile(x_rows, r_rows, nw_ptr, kk, m_ok[:, None] & (kk < k_hi)[None, :], rstd, K, PROLOGUE)
    if WRITE_X:
        tl.store(xo_ptr + offs_m[:, None] * stride_xo + kk[None, :], a, mask=x_out[:, None] & (kk < k_hi)[None, :])
    acc = _products(a, w_first, BLOCK_M)
    for k0 in range(k_lo + BLOCK_K, k_hi, BLOCK_K):
        kk = k0 + offs_k
        w = _weight_tile(w_rows, kk, n_ok, k_hi, EVEN)
        a = _input_tile(x_rows, r_rows, nw_ptr, kk, m_ok[:, None] & (kk < k_hi)[None, :], rstd, K, PROLOGUE)
        if WRITE_X:
            tl.store(xo_ptr + offs_m[:, None] * stride_xo + kk[None, :], a, mask=x_out[:, None] & (kk < k_hi)[None, :])
        acc += _products(a, w, BLOCK_M)
    y = _sum_over_k(acc, BLOCK_M)
    if HAS_SCALE:   # fp8 weights: the output channel's scale, once per column
        y = y * tl.load(s_ptr + offs_n, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    if HAS_BIAS:
        y += tl.load(b_ptr + offs_n, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    if LORA_SLICES > 0:   # (before the one rounding)
        y += l_delta
    tl.store(y_ptr + offs_m[:, None] * stride_y + offs_n[None, :], y.to(y_ptr.dtype.element_ty),
             mask=m_ok[:, None] & n_ok[None, :])


@triton.jit
def _lora_b(b_ptr, slots_ptr, offs_m, m_ok, offs_n, n_ok, stride_bs, R, BLOCK_R: tl.constexpr):
    """The rows' slots and [BLOCK_M, BLOCK_N, BLOCK_R] of B[slot[m], n, :] (0 for rows of slot -1; in B's
    dtype: it stays in registers through the main loop); B [slots, N, R] contiguous."""
    sl = tl.load(slots_ptr + offs_m, mask=m_ok, other=-1)
    rs = tl.arange(0, BLOCK_R)
    b_rows = b_ptr + tl.maximum(sl, 0).to(tl.int64)[:, None, None] * stride_bs + offs_n[None, :, None] * R
    bm = (sl >= 0)[:, None, None] & n_ok[None, :, None] & (rs < R)[None, None, :]
    return sl, tl.load(b_rows + rs[None, None, :], mask=bm, other=0.0)


@triton.jit
def _lora_delta(xa_ptr, sl, bv, offs_m, offs_n, stride_xm, stride_xs, R, S1, S2, NUM_SLICES: tl.constexpr,
                SPLITS: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """[BLOCK_M, BLOCK_N] of sum_r B[slot[m], n, r] * xa[m, slice(n) * R + r] (0 for rows of slot -1),
    from _lora_b's slots and B: xa the shrink's output, or the sum of its SPLITS partials."""
    rs = tl.arange(0, BLOCK_R)
    xm = (sl >= 0)[:, None] & (rs < R)[None, :]
    col_slice = (offs_n >= S1).to(tl.int32) + (offs_n >= S2).to(tl.int32)
    delta = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for j in tl.static_range(NUM_SLICES):
        xp = xa_ptr + offs_m[:, None] * stride_xm + j * R + rs[None, :]
        xv = tl.load(xp, mask=xm, other=0.0).to(tl.float32)
        for sp in tl.static_range(1, SPLITS):
            xv += tl.load(xp + sp * stride_xs, mask=xm, other=0.0).to(tl.float32)
        bj = tl.where((col_slice == j)[None, :, None], bv.to(tl.float32), 0.0)
        delta += tl.sum(bj * xv[:, None, :], 2)
    return delta


@triton.jit
def _products(a, w, BLOCK_M: tl.constexpr):
    """a [BLOCK_M, BLOCK_K] times w [BLOCK_N, BLOCK_K], per (row, column, k lane). One row (the
    batch-1 decode) stays 2D, [BLOCK_N, BLOCK_K], so that only the input vector changes layout to
    broadcast, not the weight tile (Llama-3.1-8B's gate_up 58.5 -> 53.0 us)."""
    w = w.to(tl.float32)
    if BLOCK_M == 1:
        out = w * tl.reshape(a, [a.shape[1]])[None, :]
    else:
        out = a[:, None, :] * w[None, :, :]
    return out


@triton.jit
def _sum_over_k(acc, BLOCK_M: tl.constexpr):
    """_products' sums -> [BLOCK_M, BLOCK_N]."""
    if BLOCK_M == 1:
        out = tl.sum(acc, 1)[None, :]
    else:
        out = tl.sum(acc, 2)
    return out


@triton.jit
def _weight_tile(w_rows, kk, n_ok, K, EVEN: tl.constexpr):
    """[BLOCK_N, BLOCK_K] of the weight at columns kk; EVEN: the tiles divide the weight (no masks)."""
    if EVEN:
        return tl.load(w_rows + kk[None, :])
    return tl.load(w_rows + kk[None, :], mask=n_ok[:, None] & (kk < K)[None, :], other=0.0)


# Tiles per weight shape and batch rows, measured by `python -m bench.tune_gemv --write` on an
# H200: {"ROWS:NxK:PROLOGUE" (or "ROWS:NxK", any prologue): tiles, or null where cuBLAS after
# the separate kernel was faster}, ROWS the row bucket (row_bucket: 1; MAX_ROWS for 2..MAX_ROWS,
# where more rows need smaller tiles for the registers; then 16, 32 and 64, skinny_gemm's
# tiles, with "split_k" and "swap"). Tiles with "fuse": false run the prologue's own
# kernel and then the GEMV without it: on large weights (Llama-3.1-8B's gate_up and down) the
# GEMV streams faster than cuBLAS, but thousands of programs each computing the norm cost more
# than the one norm kernel, whose run the GEMV's first weight loads overlap under PDL. Under
# tensor parallelism with the fused all-reduce + RMSNorm, qkv and gate_up take normed input
# (prologue "none").
TILES_FILE = Path(__file__).with_name("gemv_tiles.json")
_TUNED: dict[str, dict | None] = json.loads(TILES_FILE.read_text()) if TILES_FILE.exists() else {}


def row_bucket(m: int) -> int:
    """The rows that tiles are tuned at for a batch of m (1 <= m <= MAX_DECODE_ROWS)."""
    return m if m == 1 else max(MAX_ROWS, triton.next_power_of_2(m))


def tile_config(n: int, k: int, m: int = 1, prologue: str = "none") -> dict | None:
    """The tiles for a [n, k] weight at m rows; None: the unfused ops are faster there."""
    key = f"{row_bucket(m)}:{n}x{k}"
    if f"{key}:{prologue}" in _TUNED:
        return _TUNED[f"{key}:{prologue}"]
    if prologue == "none":   # a plain input where the shape was tuned with a prologue's own kernel first
        split = _split_tiles(key)
        if split is not None:
            return split
    return _TUNED[key] if key in _TUNED else _untuned(n, k, m)


def _split_tiles(key: str) -> dict | None:
    """The tiles of a "fuse": false entry of this shape (the prologue's own kernel, then the GEMV on
    its output), without that flag: that entry measured the plain GEMV faster than cuBLAS after the
    same kernel, so it is on a plain input too. (LoRA's linears take plain input: the shrink needs
    the normed x. Llama-3.1-8B at one row, qkv / gate_up / down: 13.1 / 53.0 / 27.8 us in
    bench.tune_gemv's plain sweep, against cuBLAS's 16.0 / 55.1 / 31.3 in session 36's profile.)"""
    for prologue in PROLOGUES[1:]:
        t = _TUNED.get(f"{key}:{prologue}")
        if t is not None and not t.get("fuse", True):
            return {name: v for name, v in t.items() if name != "fuse"}
    return None


def _untuned(n: int, k: int, m: int) -> dict | None:
    # an untuned shape: the GEMV at one row for weights up to 16 MiB, where cuBLAS's launch-bound
    # kernels lose (Qwen3-0.6B's, all of them); cuBLAS above, and for several rows
    if m == 1 and n * k <= 8 << 20:
        return dict(block_n=4 if n <= 2048 else 8, block_k=1024, num_warps=4, num_stages=3)
    return None


def fp8_tile_config(n: int, k: int, m: int = 1, prologue: str = "none") -> dict:
    """Tiles for an fp8 [n, k] weight (never None: cuBLAS cannot take fp8 at these rows): the fp8
    sweep's (bench/tune_gemv.py --fp8, keys "fp8:ROWS:NxK:PROLOGUE"), else the bf16 weight's tuned
    tiles (or the large-weight ones); LOOM_FP8_GEMV=wide doubles their BLOCK_K (the same bytes
    per tile as bf16's; more registers)."""
    key = f"fp8:{row_bucket(m)}:{n}x{k}:{prologue}"
    if key in _TUNED and _TUNED[key] is not None:
        return _TUNED[key]
    t = tile_config(n, k, m, prologue) if m == 1 else None
    if t is None:
        t = (dict(block_n=4, block_k=2048, num_warps=8, num_stages=3, fuse=n * k < (16 << 20)) if m == 1
             else dict(block_n=4, block_k=256, num_warps=8, num_stages=3, fuse=False))
    if envs.LOOM_FP8_GEMV == "wide":
        t = dict(t, block_k=min(2 * t["block_k"], triton.next_power_of_2(k)))
    return t


def _interpreter_tiles(n: int, k: int) -> dict:
    """On CPU the interpreter runs each program in Python, so the fewer the better: wide tiles
    (the GPU's narrow ones made a tiny model's decode step 4x slower there)."""
    return dict(block_n=min(512, triton.next_power_of_2(n)), block_k=min(256, triton.next_power_of_2(k)),
                num_warps=4, num_stages=1)


def _fuses_lora(x, weight, prologue, tiles, scale) -> bool:
    """Whether gemv's own kernel runs these arguments, its fused prologue included (where it
    does not, the LoRA delta is kernels/lora.py's expand after the product)."""
    if not envs.LOOM_LORA_FUSED_EXPAND or x.shape[0] > MAX_ROWS or not runs_triton(_gemv_kernel, x):
        return False
    n, k = weight.shape
    t = tiles or (tile_config(n, k, x.shape[0], prologue) if scale is None
                  else fp8_tile_config(n, k, x.shape[0], prologue))
    if t is not None and tiles is None and is_interpreted(_gemv_kernel):   # (as gemv picks them)
        t = _interpreter_tiles(n, k)
    return t is not None and (prologue == "none" or t.get("fuse", True))


def _lora_args(lora: LoRAEpilogue | None, y: torch.Tensor) -> tuple[tuple, dict]:
    """The kernel's LoRA arguments (positional pointers/strides/ints, constexprs)."""
    if lora is None:
        return (y, y, y, 0, 0, 0, 0, 0, 0), dict(LORA_SLICES=0, L_SPLITS=1, L_BLOCK_R=16)
    xa, b = lora.xa, lora.b
    splits = xa.shape[0] if xa.dim() == 3 else 1
    rank = b.shape[2]
    n_out = y.shape[1]
    starts = list(lora.slice_starts[1:]) + [n_out] * (3 - len(lora.slice_starts))
    assert xa.stride(-1) == 1 and b.is_contiguous() and len(lora.slice_starts) <= 3
    return ((xa, b, lora.slots, xa.stride(-2), xa.stride(0) if splits > 1 else 0, b.stride(0), rank, starts[0],
             starts[1]),
            dict(LORA_SLICES=len(lora.slice_starts), L_SPLITS=splits,
                 L_BLOCK_R=max(16, triton.next_power_of_2(rank))))


def _unfused(x, weight, bias, prologue, residual, norm_weight, eps, out):
    """The separate ops the GEMV replaces: for shapes where they are faster, and where Triton
    does not run (each op falls back to its torch reference there)."""
    x, new_residual = _prologue(x, prologue, residual, norm_weight, eps, _OPS)
    if out is None:
        return F.linear(x, weight, bias), new_residual
    if bias is None:
        return torch.mm(x, weight.t(), out=out), new_residual
    return torch.addmm(bias, x, weight.t(), out=out), new_residual


class LoRAEpilogue(NamedTuple):
    """Each row's adapter delta, added to the GEMV's output before it is rounded: kernels/lora.py's
    expand of `xa` (lora_shrink's [T, n_slices * R] or its split partials [splits, T, ...]) by `b`
    [slots, N, R] for the rows' `slots`, slices starting at `slice_starts`."""
    xa: torch.Tensor
    b: torch.Tensor
    slots: torch.Tensor
    slice_starts: tuple[int, ...]


def gemv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, *,
         prologue: str = "none", residual: torch.Tensor | None = None,
         norm_weight: torch.Tensor | None = None, eps: float = 0.0,
         out: torch.Tensor | None = None, tiles: dict | None = None, scale: torch.Tensor | None = None,
         lora: LoRAEpilogue | None = None):
    """x [M <= MAX_DECODE_ROWS, K] ([M, 2K] for silu_mul; last dim contiguous), weight [N, K]
    contiguous -> (y [M, N] in x.dtype, written into `out` when given; the new residual
    for add_rms_norm, else None). `tiles` overrides tile_config (tuning). `scale`: float32
    [N], the weight is float8_e4m3fn scaled per output channel (upcast in registers; up to
    MAX_ROWS rows, fp8_tile_config's tiles). `lora`: the adapters' delta, in the kernel's epilogue
    (where another path runs, by kernels/lora.py's expand after it)."""
    if lora is not None and not _fuses_lora(x, weight, prologue, tiles, scale):
        from kernels.lora import lora_expand
        y, new_residual = gemv(x, weight, bias, prologue=prologue, residual=residual, norm_weight=norm_weight,
                               eps=eps, out=out, tiles=tiles, scale=scale)
        return lora_expand(y, lora.xa, lora.b, lora.slots, lora.slice_starts, sorted_rows=None), new_residual
    code = PROLOGUES.index(prologue)
    m = x.shape[0]
    n, k = weight.shape
    assert m <= MAX_DECODE_ROWS and weight.is_contiguous() and x.stride(-1) == 1
    assert x.shape[1] == (2 * k if code == _SILU else k)
    assert scale is None or m <= MAX_ROWS
    if not runs_triton(_gemv_kernel, x):
        t = None
    else:
        t = tiles or (tile_config(n, k, m, prologue) if scale is None else fp8_tile_config(n, k, m, prologue))
    if t is not None and tiles is None and is_interpreted(_gemv_kernel) and m <= MAX_ROWS:
        t = _interpreter_tiles(n, k)
    if t is None:
        if scale is not None:   # (CPU without the interpreter) the dequantized weight
            weight = (weight.float() * scale.float()[:, None]).to(x.dtype)
        return _unfused(x, weight, bias, prologue, residual, norm_weight, eps, out)
    if code and (m > MAX_ROWS or not t.get("fuse", True)):  # the prologue's own kernel first
        x, new_residual = _prologue(x, prologue, residual, norm_weight, eps, _OPS)
        return gemv(x, weight, bias, out=out, tiles=t, scale=scale)[0], new_residual
    if m > MAX_ROWS:
        return skinny_gemm(x, weight, bias, t, out=out), None
    y = out if out is not None else torch.empty((m, n), dtype=x.dtype, device=x.device)
    new_residual = torch.empty_like(x) if code == _ADD_NORM else None
    if code == _ADD_NORM:
        assert residual.shape == x.shape and residual.stride(-1) == 1
    if m == 0:
        return y, new_residual
    _launch(x, weight, bias, y, code, t, residual=residual, new_residual=new_residual, norm_weight=norm_weight,
            eps=eps, scale=scale, lora=lora)
    return y, new_residual


def _launch(x, weight, bias, y, code, t, *, residual=None, new_residual=None, norm_weight=None, eps=0.0, scale=None,
            lora=None, weight_slot=None, x_out=None, k_chunk=None):
    """_gemv_kernel over a [N, K] weight (weight_slot: row 0's slot picks it in a stack [S, N, K];
    x_out: where program 0 writes the input it builds; k_chunk: K split into chunks of that many
    columns, y [splits, M, N] their partials)."""
    m = x.shape[0]
    n, k = weight.shape[-2:]
    lx = _lora_args(lora, y)
    splits = triton.cdiv(k, k_chunk) if k_chunk is not None else 1
    assert splits == 1 or (lora is None and bias is None and scale is None and y.dim() == 3)
    _gemv_kernel[(triton.cdiv(n, t["block_n"]), splits)](
        x, residual if residual is not None else x, norm_weight if norm_weight is not None else weight,
        weight, bias if bias is not None else weight, y, new_residual if new_residual is not None else y,
        scale if scale is not None else y,
        m, n, k, x.stride(0), residual.stride(0) if residual is not None else 0, weight.stride(-2), y.stride(-2),
        float(eps), *lx[0], weight_slot if weight_slot is not None else y,
        weight.stride(0) if weight_slot is not None else 0, x_out if x_out is not None else y,
        x_out.stride(0) if x_out is not None else 0, k_chunk or k, y.stride(0) if splits > 1 else 0,
        PROLOGUE=code, HAS_BIAS=bias is not None, HAS_SCALE=scale is not None,
        EVEN=n % t["block_n"] == 0 and k % t["block_k"] == 0 and weight_slot is None,
        BLOCK_M=max(1, triton.next_power_of_2(m)), BLOCK_N=t["block_n"], BLOCK_K=t["block_k"],
        num_warps=t["num_warps"], num_stages=t["num_stages"], W_SLOT=weight_slot is not None,
        WRITE_X=x_out is not None, K_SPLIT=splits > 1, **lx[1], **pdl_args(x))


# The batch-1 shrink's tiles, one K block per program: 8 rows of A x 1,024 columns, prefetched before
# the PDL wait (q/k/v's 48 rows of A over K = 4,096: 24 programs; down's 16 over 14,336: 28), their
# partials summed by the GEMV's epilogue. Not tuned on the GPU yet.
SHRINK_TILES = dict(block_n=8, block_k=1024, num_warps=8, num_stages=1)


def lora_shrink_prologue(x: torch.Tensor, a: torch.Tensor, slots: torch.Tensor, prologue: str, *,
                         residual: torch.Tensor | None = None, norm_weight: torch.Tensor | None = None,
                         eps: float = 0.0, k_chunk: int | None = None
                         ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """A one-row LoRA shrink with the op that builds the linear's input fused in, in one kernel:
    (xa = input @ a[slots[0]]^T in float32, [1, N], or its partials over K [splits, 1, N] (which the
    GEMV's LoRAEpilogue sums); the input itself (the norm's or SiLU's output, in x.dtype); the new
    residual for add_rms_norm). a [S, N, K] contiguous; slot -1: xa is not written (the expand reads
    no xa for base rows). k_chunk: K columns per program (None: one K block). At batch 1 it
    replaces the norm's (or SiLU's) own kernel and the shrink's, so the linear with its adapter
    runs the two kernels that the base linear runs (this one, then the GEMV with the expand in its
    epilogue)."""
    if not runs_triton(_gemv_kernel, x):   # the references: the prologue's op, then the shrink's
        from kernels.lora import lora_shrink_ref
        x_in, new_residual = _prologue(x, prologue, residual, norm_weight, eps, _OPS)
        return lora_shrink_ref(x_in, a, slots), x_in, new_residual
    code = PROLOGUES.index(prologue)
    n, k = a.shape[1:]
    assert x.shape[0] == 1 and a.is_contiguous() and x.stride(-1) == 1
    assert x.shape[1] == (2 * k if code == _SILU else k)
    t = _interpreter_tiles(n, k) if is_interpreted(_gemv_kernel) else SHRINK_TILES
    t = dict(t, block_k=min(t["block_k"], triton.next_power_of_2(k), k_chunk or t["block_k"]))
    k_chunk = triton.cdiv(k_chunk or t["block_k"], t["block_k"]) * t["block_k"]
    splits = triton.cdiv(k, k_chunk)
    xa = torch.empty((splits, 1, n) if splits > 1 else (1, n), dtype=torch.float32, device=x.device)
    x_in = torch.empty((1, k), dtype=x.dtype, device=x.device)
    new_residual = torch.empty_like(x) if code == _ADD_NORM else None
    _launch(x, a, None, xa, code, t, residual=residual, new_residual=new_residual, norm_weight=norm_weight, eps=eps,
            weight_slot=slots, x_out=x_in, k_chunk=k_chunk if splits > 1 else None)
    return xa, x_in, new_residual
