"""The FP8 KV cache's number format (--kv-cache-dtype fp8 / fp8_e4m3), as vLLM's.

The cache holds float8_e4m3fn codes; each attention layer has one per-tensor scale for its keys
and one for its values (fp32 device tensors, Attention.k_scale / v_scale). A key x is stored as
e4m3(clamp(x / k_scale, -448, 448)) and read back as code * k_scale. The scales come from the
checkpoint (k_scale / v_scale), from the first batch (--calculate-kv-scales), or are 1.0.

These torch functions are the references the Triton write and read paths are tested against;
the CPU paths call them directly.
"""
from __future__ import annotations

import torch

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0   # torch.finfo(float8_e4m3fn).max: casts past it give NaN, so values saturate first
# --calculate-kv-scales: the first batch's amax maps to these codes, not to 448, so that later
# tokens up to 2.2x (keys) / 4.5x (values) larger still fit (vLLM's K_SCALE_CONSTANT, V_SCALE_CONSTANT)
K_SCALE_CONSTANT = 200.0
V_SCALE_CONSTANT = 100.0

KV_CACHE_DTYPES = ("auto", "fp8", "fp8_e4m3")


def is_fp8(cache: torch.Tensor) -> bool:
    return cache.dtype == FP8_DTYPE


def kv_cache_torch_dtype(kv_cache_dtype: str, model_dtype: torch.dtype) -> torch.dtype:
    """--kv-cache-dtype -> the cache tensors' dtype: auto is the model's."""
    if kv_cache_dtype == "auto":
        return model_dtype
    if kv_cache_dtype in ("fp8", "fp8_e4m3"):
        return FP8_DTYPE
    raise ValueError(f"--kv-cache-dtype must be one of {', '.join(KV_CACHE_DTYPES)}, got {kv_cache_dtype!r}")


def check_device(cache_dtype: torch.dtype, device: torch.device) -> None:
    """The Triton kernels convert to and from e4m3 with the instructions of compute capability 8.9
    (Ada) and later: an older GPU fails at start-up in one line, not inside a kernel's compile."""
    if cache_dtype == FP8_DTYPE and device.type == "cuda" and torch.cuda.get_device_capability(device) < (8, 9):
        name = torch.cuda.get_device_name(device)
        raise ValueError(f"--kv-cache-dtype fp8 needs a GPU of compute capability 8.9 or later (Ada, Hopper, "
                         f"Blackwell); {name} is {'.'.join(map(str, torch.cuda.get_device_capability(device)))}")


def quantize_fp8_ref(x: torch.Tensor, scale: torch.Tensor | None) -> torch.Tensor:
    """x (any float dtype) -> e4m3 codes of x / scale, saturated (scale None: 1.0). The division
    is in fp32 of x as it is (the model dtype's value), as the kernels do it."""
    x = x.float()
    if scale is not None:
        x = x / scale.float()
    return x.clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)


def dequantize_ref(cache_values: torch.Tensor, scale: torch.Tensor | None) -> torch.Tensor:
    """Cache values (fp8 codes or model-dtype values) -> fp32; fp8 codes times their scale."""
    x = cache_values.float()
    if cache_values.dtype == FP8_DTYPE and scale is not None:
        x = x * scale.float()
    return x


def to_cache_dtype(x: torch.Tensor, cache: torch.Tensor, scale: torch.Tensor | None) -> torch.Tensor:
    """x as `cache` stores it: quantized when the cache is FP8, else cast."""
    return quantize_fp8_ref(x, scale) if is_fp8(cache) else x.to(cache.dtype)


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    """An FP8 tensor viewed as uint8 (the CPU build has no index_copy_ for float8): data moves
    as bytes, values are the same."""
    return t.view(torch.uint8) if t.dtype == FP8_DTYPE else t


def kv_scales_from_amax(k_amax: torch.Tensor, v_amax: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """--calculate-kv-scales: the scales that map the first batch's largest |key| / |value| to
    K_SCALE_CONSTANT / V_SCALE_CONSTANT (vLLM's calc_kv_scales). An all-zero batch keeps a
    positive scale."""
    tiny = torch.finfo(torch.float32).tiny
    return ((k_amax.float() / K_SCALE_CONSTANT).clamp_min(tiny),
            (v_amax.float() / V_SCALE_CONSTANT).clamp_min(tiny))


_UNIT_SCALES: dict[torch.device, torch.Tensor] = {}


def fp8_scales(device: torch.device, k_scale: torch.Tensor | None,
               v_scale: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """The scales a kernel reads for an FP8 cache: the given ones, or a 1.0 tensor made once per
    device (a call without scales: the warm-up's attention, a benchmark)."""
    if (k_scale is None or v_scale is None) and device not in _UNIT_SCALES:
        _UNIT_SCALES[device] = torch.ones(1, dtype=torch.float32, device=device)
    return (_UNIT_SCALES[device] if k_scale is None else k_scale,
            _UNIT_SCALES[device] if v_scale is None else v_scale)
