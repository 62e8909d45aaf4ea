"""Quantized parameters and their tensor-parallel weight loaders.

Every tensor of a quantized linear (packed weights, scales, zero points, g_idx) runs along the
layer's output features on one dim and its input features on the other, each possibly packed
or grouped: GPTQ's qweight [K/8, N], its scales [K/g, N], compressed-tensors' weight_packed
[N, K/8], block-FP8's weight_scale_inv [N/128, K/128]. `QuantDims` says which dim is which and
how many features one element covers; `quant_param` makes the rank's parameter with a loader
that keeps its share, exactly as the dense loaders in workers/models/layers.py do:
column-parallel layers keep their output rows of each fused part (q/k/v, gate/up: each part's
rows packed or grouped on their own), row-parallel ones their input columns (and the scale
groups along them, which must not straddle ranks).
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
from torch import nn

from workers.distributed import tp_rank
from workers.models.layers import _check_shape, _narrow, _set_loader, _shape


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


@dataclass(frozen=True)
class QuantDims:
    out_dim: int | None      # the dim along the output features (None: a 1-D tensor along the input)
    out_factor: int = 1      # output features per element on out_dim (8: packed int4; 128: a block scale)
    in_factor: int = 1       # input features per element on the other dim
    shard_in: bool = True    # row-parallel: split along the input (False: every rank holds all, act-order scales)
    has_in: bool = True      # False: a 1-D tensor along the output (per-channel scales)

    @property
    def in_dim(self) -> int:
        return 0 if self.out_dim is None else 1 - self.out_dim


def _dims_shape(dims: QuantDims, out: int, inp: int) -> tuple[int, ...]:
    if not dims.has_in:
        return (out,)
    if dims.out_dim is None:
        return (inp,)
    return (out, inp) if dims.out_dim == 0 else (inp, out)


def _layer_in_full(layer) -> int:
    return layer.in_features * getattr(layer, "tp", 1)


def quant_param(layer: nn.Module, dims: QuantDims, dtype: torch.dtype, device: torch.device,
                required: bool = True) -> nn.Parameter:
    """This rank's parameter for a tensor laid out as `dims` on `layer` (a Column- or
    RowParallelLinear), with its loader. required=False: not in a checkpoint (computed)."""
    column = hasattr(layer, "shards")
    in_full = _layer_in_full(layer)
    if column:
        out_local = sum(cdiv(s.size, dims.out_factor) for s in layer.shards.values())
        out_full = sum(cdiv(s.full, dims.out_factor) for s in layer.shards.values())
        in_local = cdiv(in_full, dims.in_factor)
        shard_ids = tuple(layer.shards)
    else:
        out_local = out_full = cdiv(layer.out_features, dims.out_factor)
        in_local = cdiv(layer.in_features if dims.shard_in else in_full, dims.in_factor)
        shard_ids = (None,)
        if dims.shard_in and layer.tp > 1 and layer.in_features % dims.in_factor:
            raise ValueError(f"{layer.in_features} input features per rank do not split into whole groups "
                             f"of {dims.in_factor}: use fewer tensor-parallel ranks")
    param = nn.Parameter(torch.empty(_dims_shape(dims, out_local, in_local), dtype=dtype, device=device),
                         requires_grad=False)
    loader = functools.partial(_column_loader if column else _row_loader, layer, dims)
    _set_loader(param, loader, _dims_shape(dims, out_full, cdiv(in_full, dims.in_factor)),
                shard_ids if required else ())
    return param


@torch.no_grad()
def _column_loader(layer, dims: QuantDims, param: nn.Parameter, loaded, shard_id=None) -> None:
    shards, f = layer.shards, dims.out_factor
    in_size = cdiv(_layer_in_full(layer), dims.in_factor)
    if dims.out_dim is None:   # along the input only: every rank holds all of it
        _check_shape(loaded, (in_size,))
        param.data.copy_(_narrow(loaded, 0, 0, in_size))
        return
    if shard_id is None and list(shards) != [None]:   # the fused tensor whole (dummy weights)
        start = 0
        for sid, s in shards.items():
            _column_loader(layer, dims, param, _narrow(loaded, dims.out_dim, start, cdiv(s.full, f)), sid)
            start += cdiv(s.full, f)
        return
    offset = 0
    for sid, s in shards.items():
        if sid == shard_id:
            break
        offset += cdiv(s.size, f)
    s = shards[shard_id]
    if s.size != s.full and (s.start % f or s.size % f):
        raise ValueError(f"a rank's {s.size} output features do not split into whole groups of {f}: "
                         f"use fewer tensor-parallel ranks")
    _check_shape(loaded, _dims_shape(dims, cdiv(s.full, f), in_size))
    part = _narrow(loaded, dims.out_dim, s.start // f, cdiv(s.size, f))
    param.data.narrow(dims.out_dim, offset, cdiv(s.size, f)).copy_(part)


@torch.no_grad()
def _row_loader(layer, dims: QuantDims, param: nn.Parameter, loaded, shard_id=None) -> None:
    in_full = cdiv(_layer_in_full(layer), dims.in_factor)
    _check_shape(loaded, _dims_shape(dims, cdiv(layer.out_features, dims.out_factor), in_full))
    if not dims.shard_in or layer.tp == 1 or not dims.has_in:
        param.data.copy_(loaded[...] if not isinstance(loaded, torch.Tensor) else loaded)
        return
    part = layer.in_features // dims.in_factor
    param.data.copy_(_narrow(loaded, dims.in_dim, tp_rank() * part, part))


def whole(loaded) -> torch.Tensor:
    """A checkpoint tensor or safetensors slice, read whole (small tensors: scales)."""
    return loaded if isinstance(loaded, torch.Tensor) else loaded[...]


def loaded_shape(loaded) -> tuple[int, ...]:
    return _shape(loaded)
