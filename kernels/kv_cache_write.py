"""The KV-cache write alone: key/value [T, Hkv, D] into the paged caches at slot_mapping.

Native models write the cache inside the attention prologue (kernels/qk_rope_cache.py, fused
with the rotary). A model whose rotary runs elsewhere (the generic transformers path, where
the HF module rotates q and k itself) writes here instead. Unlike write_kv_cache_ref, the
padding slots (< 0) are skipped inside the kernel: no host sync, so it runs under CUDA graphs.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.jit import runs_triton, step_jit
from kernels.kv_quant import FP8_DTYPE, fp8_scales
from kernels.paged_attention import write_kv_cache_ref


@step_jit(pointers=("slot_ptr",))
def _write_kv_cache_kernel(k_ptr, v_ptr, kc_ptr, vc_ptr, slot_ptr, k_scale_ptr, v_scale_ptr,
                           stride_kt, stride_kh, stride_vt, stride_vh, stride_cb, stride_cs, stride_ch,
                           num_kv_heads,
                           HEAD_DIM: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
                           BLOCK_SIZE: tl.constexpr, FP8: tl.constexpr):
    """Program t: token t's key and value heads (nothing for a padding token). FP8: the caches
    get e4m3 codes of key / k_scale and value / v_scale, saturated (kernels/kv_quant.py)."""
    t = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    if slot >= 0:
        cache_off = (slot // BLOCK_SIZE) * stride_cb + (slot % BLOCK_SIZE) * stride_cs
        offs_h = tl.arange(0, BLOCK_H)[:, None]
        offs_d = tl.arange(0, BLOCK_D)[None, :]
        mask = (offs_h < num_kv_heads) & (offs_d < HEAD_DIM)
        k = tl.load(k_ptr + t * stride_kt + offs_h * stride_kh + offs_d, mask=mask)
        if FP8:
            k = tl.clamp(k.to(tl.float32) / tl.load(k_scale_ptr), -448.0, 448.0)
        tl.store(kc_ptr + cache_off + offs_h * stride_ch + offs_d, k.to(kc_ptr.dtype.element_ty), mask=mask)
        v = tl.load(v_ptr + t * stride_vt + offs_h * stride_vh + offs_d, mask=mask)
        if FP8:
            v = tl.clamp(v.to(tl.float32) / tl.load(v_scale_ptr), -448.0, 448.0)
        tl.store(vc_ptr + cache_off + offs_h * stride_ch + offs_d, v.to(vc_ptr.dtype.element_ty), mask=mask)


def write_kv_cache(key: torch.Tensor, value: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                   slot_mapping: torch.Tensor, k_scale: torch.Tensor | None = None,
                   v_scale: torch.Tensor | None = None) -> None:
    """Triton version of write_kv_cache_ref (same arguments): key/value [T, Hkv, D] with any
    token and head strides and a contiguous last dim; k_scale / v_scale: an FP8 cache's."""
    if not runs_triton(_write_kv_cache_kernel, key):
        return write_kv_cache_ref(key, value, key_cache, value_cache, slot_mapping, k_scale, v_scale)
    num_tokens, num_kv_heads, head_dim = key.shape
    assert value.shape == key.shape and key_cache.shape[2:] == (num_kv_heads, head_dim)
    assert value_cache.stride() == key_cache.stride()
    assert key.stride(-1) == value.stride(-1) == key_cache.stride(-1) == 1, "need a contiguous last dim"
    if num_tokens == 0:
        return
    fp8 = key_cache.dtype == FP8_DTYPE
    k_scale, v_scale = fp8_scales(key.device, k_scale, v_scale) if fp8 else (key, key)
    _write_kv_cache_kernel[(num_tokens,)](
        key, value, key_cache, value_cache, slot_mapping.contiguous(), k_scale, v_scale,
        key.stride(0), key.stride(1), value.stride(0), value.stride(1),
        key_cache.stride(0), key_cache.stride(1), key_cache.stride(2), num_kv_heads,
        HEAD_DIM=head_dim, BLOCK_H=triton.next_power_of_2(num_kv_heads), BLOCK_D=triton.next_power_of_2(head_dim),
        BLOCK_SIZE=key_cache.shape[1], FP8=fp8, num_warps=1 if num_kv_heads * head_dim <= 1024 else 4)
