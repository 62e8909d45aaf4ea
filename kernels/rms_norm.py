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


def rms_norm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.float()
    var = xf.pow(2).mean(-1, keepdim=True)
    normed = (xf * torch.rsqrt(var + eps)).to(x.dtype)
    return (normed.float() * weight.float()).to(x.dtype)


def fused_add_rms_norm_ref(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                           eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    new_residual = (x.float() + residual.float()).to(x.dtype)
    return rms_norm_ref(new_residual, weight, eps), new_residual


@triton.jit
def _rms_norm_kernel(
    x_ptr, res_ptr, w_ptr, out_ptr, res_out_ptr,
    stride_x, stride_r, n_cols, eps,
    BLOCK: tl.constexpr, HAS_RESIDUAL: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < n_cols
    x = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0).to(tl.float32)
    if HAS_RESIDUAL:
        r = tl.load(res_ptr + row * stride_r + offs, mask=mask, other=0.0).to(tl.float32)
        xr = (x + r).to(res_out_ptr.dtype.element_ty)
        tl.store(res_out_ptr + row * n_cols + offs, xr, mask=mask)
        x = xr.to(tl.float32)
    var = tl.sum(x * x, 0) / n_cols
    rstd = 1.0 / tl.sqrt(var + eps)
    normed = (x * rstd).to(out_ptr.dtype.element_ty).to(tl.float32)
    w = tl.load(w_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * n_cols + offs, (normed * w).to(out_ptr.dtype.element_ty), mask=mask)


def _rows(x: torch.Tensor) -> torch.Tensor:
    """[..., H] -> [R, H] with a contiguous last dim (a view when possible)."""
    x2 = x.reshape(-1, x.shape[-1])
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    return x2


def _launch(x, residual, weight, eps):
    h = x.shape[-1]
    assert weight.shape == (h,)
    weight = weight.contiguous()
    x2 = _rows(x)
    n_rows = x2.shape[0]
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    if residual is not None:
        assert residual.shape == x.shape
        r2 = _rows(residual)
        res_out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    else:
        r2, res_out = x2, out
    if n_rows == 0:
        return out, res_out
    block = triton.next_power_of_2(h)
    num_warps = 1 if block <= 256 else 4 if block <= 2048 else 8 if block <= 8192 else 16
    _rms_norm_kernel[(n_rows,)](
        x2, r2, weight, out, res_out, x2.stride(0), r2.stride(0), h, float(eps),
        BLOCK=block, HAS_RESIDUAL=residual is not None, num_warps=num_warps,
    )
    return out, res_out


def _use_triton(t: torch.Tensor) -> bool:
    return t.is_cuda or type(_rms_norm_kernel).__name__ == "InterpretedFunction"


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x [..., H], weight [H] -> new tensor of x's shape and dtype."""
    if not _use_triton(x):
        return rms_norm_ref(x, weight, eps)
    return _launch(x, None, weight, eps)[0]


def fused_add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                       eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns (rms_norm(x + residual), x + residual) as new tensors; inputs untouched."""
    if not _use_triton(x):
        return fused_add_rms_norm_ref(x, residual, weight, eps)
    return _launch(x, residual, weight, eps)
