"""RMSNorm, plain and fused with the residual add.

Numerics follow HF transformers (Llama/Qwen RMSNorm) and vLLM: statistics in
fp32, the normalised value rounded to x.dtype, then multiplied by the weight
and rounded to x.dtype. With the residual add, new_residual = x + residual is
computed in fp32, rounded to x.dtype (that rounded value is what gets
normalised, as when the model adds in bf16).

Works on any [..., H] input: Qwen3's per-head q/k norm is rms_norm on
[T, heads, head_dim] (= [T * heads, head_dim] rows).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.jit import pdl_args, pdl_wait, runs_triton, step_jit


def rms_norm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.float()
    var = xf.pow(2).mean(-1, keepdim=True)
    normed = (xf * torch.rsqrt(var + eps)).to(x.dtype)
    return (normed.float() * weight.float()).to(x.dtype)


def fused_add_rms_norm_ref(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                           eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    new_residual = (x.float() + residual.float()).to(x.dtype)
    return rms_norm_ref(new_residual, weight, eps), new_residual


@step_jit(ints=("n_rows",))
def _rms_norm_kernel(
    x_ptr, res_ptr, w_ptr, out_ptr, res_out_ptr,
    n_rows, n_inner, stride_x0, stride_x1, stride_r0, stride_r1, n_cols, eps,
    BLOCK: tl.constexpr, ROWS: tl.constexpr, HAS_RESIDUAL: tl.constexpr, PDL: tl.constexpr,
):
    """ROWS rows per program; row r of the input is at (r // n_inner) * stride0
    + (r % n_inner) * stride1 ([T, H, D] views need no copy). Outputs are
    contiguous."""
    rows = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    offs = tl.arange(0, BLOCK)
    w = tl.load(w_ptr + offs, mask=offs < n_cols, other=0.0).to(tl.float32)  # constant: before the wait
    pdl_wait(PDL)
    mask = (rows < n_rows)[:, None] & (offs < n_cols)[None, :]
    outer = rows // n_inner
    inner = rows % n_inner
    x = tl.load(x_ptr + (outer * stride_x0 + inner * stride_x1)[:, None] + offs[None, :],
                mask=mask, other=0.0).to(tl.float32)
    out_off = rows[:, None] * n_cols + offs[None, :]
    if HAS_RESIDUAL:
        r = tl.load(res_ptr + (outer * stride_r0 + inner * stride_r1)[:, None] + offs[None, :],
                    mask=mask, other=0.0).to(tl.float32)
        xr = (x + r).to(res_out_ptr.dtype.element_ty)
        tl.store(res_out_ptr + out_off, xr, mask=mask)
        x = xr.to(tl.float32)
    var = tl.sum(x * x, 1) / n_cols
    rstd = 1.0 / tl.sqrt(var + eps)
    normed = (x * rstd[:, None]).to(out_ptr.dtype.element_ty).to(tl.float32)
    tl.store(out_ptr + out_off, (normed * w[None, :]).to(out_ptr.dtype.element_ty), mask=mask)


def _as_rows(t: torch.Tensor, three_d: bool):
    """-> (tensor, n_inner, stride0, stride1) addressing t's rows of length H."""
    if three_d:
        return t, t.shape[1], t.stride(0), t.stride(1)
    t2 = t.reshape(-1, t.shape[-1])  # a view when possible
    if t2.stride(-1) != 1:
        t2 = t2.contiguous()
    return t2, 1, t2.stride(0), 0


def _launch(x, residual, weight, eps):
    h = x.shape[-1]
    assert weight.shape == (h,)
    weight = weight.contiguous()
    three_d = x.dim() == 3 and x.stride(-1) == 1 and (residual is None or residual.stride(-1) == 1)
    x2, n_inner, sx0, sx1 = _as_rows(x, three_d)
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    if residual is not None:
        assert residual.shape == x.shape
        r2, _, sr0, sr1 = _as_rows(residual, three_d)
        res_out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    else:
        r2, sr0, sr1, res_out = x2, sx0, sx1, out
    n_rows = x.numel() // h if h else 0
    if n_rows == 0:
        return out, res_out
    block = triton.next_power_of_2(h)
    rows = max(1, min(32, 2048 // block))
    tile = rows * block
    num_warps = 2 if tile <= 512 else 4 if tile <= 4096 else 8 if tile <= 8192 else 16
    _rms_norm_kernel[(triton.cdiv(n_rows, rows),)](
        x2, r2, weight, out, res_out, n_rows, n_inner, sx0, sx1, sr0, sr1, h, float(eps),
        BLOCK=block, ROWS=rows, HAS_RESIDUAL=residual is not None, num_warps=num_warps, **pdl_args(x),
    )
    return out, res_out


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x [..., H] (e.g. [T, H] or per-head [T, heads, head_dim]), weight [H] ->
    new contiguous tensor of x's shape and dtype."""
    if not runs_triton(_rms_norm_kernel, x):
        return rms_norm_ref(x, weight, eps)
    return _launch(x, None, weight, eps)[0]


def fused_add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                       eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns (rms_norm(x + residual), x + residual) as new tensors; inputs untouched."""
    if not runs_triton(_rms_norm_kernel, x):
        return fused_add_rms_norm_ref(x, residual, weight, eps)
    return _launch(x, residual, weight, eps)
