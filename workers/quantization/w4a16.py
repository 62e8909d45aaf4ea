"""4-bit weights, 16-bit activations: vLLM's `gptq` and `awq`, and compressed-tensors'
pack-quantized W4A16 (workers/quantization/compressed_tensors.py picks it). Each is loaded in
its checkpoint's own layout (TP-sharded by the loaders of workers/quantization/params.py), then
repacked into the one layout kernels/w4a16.py runs: its N x K layout (`qweight` int32 [N, K/8],
`scales` and float `zeros` [N, G], act-order's k sorted by group with `w4_perm` permuting x),
or, for a row-parallel act-order layer under TP, `qweight` int32 [K/8, N], `scales`/`zeros`
[G, N] and `g_idx`:

* GPTQ (AutoGPTQ / GPTQModel, `checkpoint_format` gptq): qweight int32 [K/8, N] (8 k per word,
  k % 8 in nibble k % 8: already the kernel's), qzeros int32 [G, N/8] holding zero - 1,
  scales fp16 [G, N], g_idx [K] (the group of each k; `desc_act` permutes it);
* AWQ (AutoAWQ GEMM): qweight int32 [K, N/8] and qzeros [G, N/8] packed along N in AWQ's
  order (column 8j + AWQ_ORDER[i] in nibble i), scales [G, N], zeros stored as they are;
* compressed-tensors pack-quantized: weight_packed int32 [N, K/8] (values + 8), weight_scale
  [N, G], weight_zero_point int32 [N/8, G] (asymmetric), weight_g_idx [K] (actorder "group"),
  weight_shape [2].

Under tensor parallelism a row-parallel layer keeps its input rows of qweight and their
groups of scales and zeros; with act-order (g_idx) every rank keeps all the groups, since its
rows may use any of them.
"""
from __future__ import annotations

import torch
from torch import nn

from kernels import w4a16 as k
from workers.quantization.base import LinearMethod, QuantizationConfig, QuantizationError
from workers.quantization.params import QuantDims, quant_param

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)   # nibble i of an AWQ word holds column 8j + AWQ_ORDER[i]
SEQUENTIAL = tuple(range(8))


def unpack_cols(t: torch.Tensor, order=SEQUENTIAL) -> torch.Tensor:
    """int32 [R, C/8] packed along the columns -> int32 [R, C] (0..15)."""
    shifts = torch.tensor([4 * i for i in range(8)], device=t.device, dtype=torch.int32)
    nib = (t[:, :, None] >> shifts) & 0xF            # [R, C/8, nibble]
    cols = torch.empty_like(nib)
    cols[:, :, list(order)] = nib                    # nibble i -> column order[i]
    return cols.reshape(t.shape[0], -1)


def pack_cols(q: torch.Tensor, order=SEQUENTIAL) -> torch.Tensor:
    """int [R, C] (0..15) -> int32 [R, C/8], the inverse of unpack_cols."""
    r, c = q.shape
    q = q.to(torch.int32).reshape(r, c // 8, 8)[:, :, list(order)]
    shifts = torch.tensor([4 * i for i in range(8)], device=q.device, dtype=torch.int32)
    return (q << shifts).sum(dim=-1, dtype=torch.int32)


def quantize_groups(w: torch.Tensor, group: int, sym: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """w [N, K] -> (q int32 [N, K] in 0..15, scales [N, G], zeros int32 [N, G]), GPTQ's
    round-to-nearest grid: symmetric zero 8 and scale 2 max|w| / 15; asymmetric min..max."""
    n, kdim = w.shape
    wg = w.float().reshape(n, kdim // group, group)
    if sym:
        scale = (wg.abs().amax(-1) * 2 / 15).clamp(min=1e-8)
        zero = torch.full_like(scale, 8.0)
    else:
        lo, hi = wg.amin(-1).clamp(max=0), wg.amax(-1).clamp(min=0)
        scale = ((hi - lo) / 15).clamp(min=1e-8)
        zero = torch.round(-lo / scale).clamp(0, 15)
    q = torch.clamp(torch.round(wg / scale[..., None]) + zero[..., None], 0, 15)
    return q.reshape(n, kdim).to(torch.int32), scale, zero.to(torch.int32)


class W4A16LinearMethod(LinearMethod):
    """One of the three checkpoint layouts (fmt "gptq", "awq" or "ct"), run by kernels/w4a16.py."""
    weight_dtype = "int4"

    def __init__(self, fmt: str, group: int, sym: bool, act_order: bool):
        self.fmt, self.group_cfg, self.sym, self.act_order = fmt, group, sym, act_order

    def _group(self, layer) -> int:
        in_full = layer.in_features * getattr(layer, "tp", 1)
        return in_full if self.group_cfg in (-1, None, 0) else self.group_cfg

    def create_weights(self, layer: nn.Module) -> None:
        g, dev = self._group(layer), layer.quant_device
        in_full = layer.in_features * getattr(layer, "tp", 1)
        if in_full % g or g % 8:
            raise QuantizationError(f"{self.fmt}: group size {g} does not divide the {in_full} input features")
        whole_groups = self.act_order or self.group_cfg in (-1, None, 0)   # every rank keeps every group
        dt = layer.quant_dtype

        def param(name, dims, dtype, required=True):
            setattr(layer, name, quant_param(layer, dims, dtype, dev, required))

        if self.fmt == "gptq":
            param("qweight", QuantDims(1, in_factor=8), torch.int32)
            param("qzeros", QuantDims(1, 8, g, shard_in=not whole_groups), torch.int32)
            param("scales", QuantDims(1, 1, g, shard_in=not whole_groups), dt)
            param("g_idx", QuantDims(None), torch.int32, required=self.act_order)
        elif self.fmt == "awq":
            param("qweight", QuantDims(1, 8), torch.int32)
            param("qzeros", QuantDims(1, 8, g), torch.int32)
            param("scales", QuantDims(1, 1, g), dt)
        else:
            param("weight_packed", QuantDims(0, in_factor=8), torch.int32)
            param("weight_scale", QuantDims(0, 1, g, shard_in=not whole_groups), dt)
            if not self.sym:
                param("weight_zero_point", QuantDims(0, 8, g, shard_in=not whole_groups), torch.int32)
            if self.act_order:
                param("weight_g_idx", QuantDims(None), torch.int32)
            shape = nn.Parameter(torch.zeros(2, dtype=torch.int64, device=dev), requires_grad=False)
            shape.weight_loader = lambda p, loaded, shard_id=None: None   # the layer knows its shape
            shape.full_shape, shape.shard_ids = (2,), ()
            layer.weight_shape = shape

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        """Repack into kernels/w4a16.py's layout, replacing the checkpoint's parameters."""
        g_idx = None
        if self.fmt == "gptq":
            qweight = layer.qweight.data
            zeros = unpack_cols(layer.qzeros.data) + 1            # GPTQ v1 stores zero - 1
            scales = layer.scales.data
            if self.act_order:
                g_idx = layer.g_idx.data
            del layer.qzeros, layer.g_idx
        elif self.fmt == "awq":
            qweight = k.pack_k(unpack_cols(layer.qweight.data, AWQ_ORDER))
            zeros = unpack_cols(layer.qzeros.data, AWQ_ORDER)
            scales = layer.scales.data
            del layer.qzeros
        else:
            qweight = k.pack_k(unpack_cols(layer.weight_packed.data).t())
            scales = layer.weight_scale.data.t()
            # zero points: packed along N ([N/8, G]), stored + 8 as the values are; symmetric: 8
            zeros = (unpack_cols(layer.weight_zero_point.data.t().contiguous()) if not self.sym
                     else torch.full_like(scales, 8.0))
            if self.act_order:
                g_idx = layer.weight_g_idx.data
            for name in ("weight_packed", "weight_scale", "weight_zero_point", "weight_g_idx", "weight_shape"):
                if hasattr(layer, name):
                    delattr(layer, name)
        # the group of a rank's local k (row-parallel without act-order: its own groups, from 0)
        layer.w4_group = self._group(layer) if self.group_cfg not in (-1, None, 0) else layer.in_features
        keep = lambda t: nn.Parameter(t.contiguous(), requires_grad=False)   # noqa: E731
        scales, zeros = scales.to(layer.quant_dtype), zeros.to(layer.quant_dtype)
        # the N x K layout (act-order's k sorted by group, x permuted per call) where the groups can
        # be made contiguous: every layer but a row-parallel act-order one under TP
        nk = k.repack_nk(qweight, scales, zeros, g_idx, layer.w4_group)
        layer.w4_nk = nk is not None
        if nk is not None:
            qweight, scales, zeros, perm = nk
            g_idx = None
            layer.register_buffer("w4_perm", perm, persistent=False)
        layer.qweight = keep(qweight)
        layer.scales = keep(scales)
        layer.zeros = keep(zeros)
        if g_idx is not None:
            layer.g_idx = keep(g_idx.to(torch.int32))

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        if layer.w4_nk:
            y = k.w4a16_linear_nk(x, layer.qweight, layer.scales, layer.zeros, layer.w4_perm, layer.w4_group, bias)
            return y.view(*shape[:-1], y.shape[-1])
        args = (layer.qweight, layer.scales, layer.zeros, getattr(layer, "g_idx", None), layer.w4_group, bias)
        if not x.is_cuda:
            y = k.w4a16_ref(x, *args)
        elif x.shape[0] <= k.MAX_GEMV_ROWS:
            y = k.w4a16_gemv(x, *args)
        else:
            y = k.w4a16_gemm(x, *args)
        return y.view(*shape[:-1], y.shape[-1])

    def dense_to_checkpoint(self, layer, weight, shard_id=None):
        """Round-to-nearest quantization in the checkpoint's layout (no act-order)."""
        g = self._group(layer)
        q, s, z = quantize_groups(weight, g, self.sym)
        dt = layer.quant_dtype
        if self.fmt == "gptq":
            return {"qweight": k.pack_k(q.t()), "qzeros": pack_cols((z - 1).t() & 0xF), "scales": s.t().to(dt),
                    "g_idx": (torch.arange(weight.shape[1], device=weight.device) // g).to(torch.int32)}
        if self.fmt == "awq":
            return {"qweight": pack_cols(q.t(), AWQ_ORDER), "qzeros": pack_cols(z.t(), AWQ_ORDER),
                    "scales": s.t().to(dt)}
        out = {"weight_packed": pack_cols(q), "weight_scale": s.to(dt),
               "weight_shape": torch.tensor(weight.shape, dtype=torch.int64)}
        if not self.sym:
            out["weight_zero_point"] = pack_cols(z.t()).t().contiguous()
        return out


class GPTQConfig(QuantizationConfig):
    """vLLM's `gptq`: 4-bit, group_size (-1: one group), desc_act, sym; `modules_to_not_convert`."""
    name = "gptq"

    def __init__(self, bits: int, group: int, desc_act: bool, sym: bool, ignore=(), checkpoint_format: str = "gptq"):
        if bits != 4:
            raise QuantizationError(f"unsupported quantization_config: gptq with {bits} bits (Loom serves 4)")
        if checkpoint_format not in ("gptq", None):
            raise QuantizationError(f"unsupported quantization_config: gptq checkpoint_format {checkpoint_format!r}")
        self.bits, self.group, self.desc_act, self.sym = bits, group, desc_act, sym
        self.ignore = tuple(ignore or ())

    @classmethod
    def from_config(cls, cfg: dict) -> "GPTQConfig":
        return cls(int(cfg.get("bits", 4)), int(cfg.get("group_size", 128)), bool(cfg.get("desc_act", False)),
                   bool(cfg.get("sym", True)), cfg.get("modules_to_not_convert") or (),
                   cfg.get("checkpoint_format", "gptq"))

    def linear_method(self, prefix, layer):
        if self.is_ignored(prefix):
            return None
        return W4A16LinearMethod("gptq", self.group, self.sym, self.desc_act)

    @property
    def description(self) -> str:
        return f"gptq (4-bit, group {self.group}, {'sym' if self.sym else 'asym'}{', desc_act' if self.desc_act else ''})"


class AWQConfig(QuantizationConfig):
    """vLLM's `awq`: AutoAWQ's GEMM layout, 4-bit, zero points."""
    name = "awq"

    def __init__(self, bits: int, group: int, zero_point: bool, version: str, ignore=()):
        if bits != 4:
            raise QuantizationError(f"unsupported quantization_config: awq with {bits} bits (Loom serves 4)")
        if str(version).lower() != "gemm":
            raise QuantizationError(f"unsupported quantization_config: awq version {version!r} (Loom serves gemm)")
        if not zero_point:
            raise QuantizationError("unsupported quantization_config: awq without zero_point")
        self.bits, self.group = bits, group
        self.ignore = tuple(ignore or ())

    @classmethod
    def from_config(cls, cfg: dict) -> "AWQConfig":
        return cls(int(cfg.get("bits", cfg.get("w_bit", 4))), int(cfg.get("group_size", cfg.get("q_group_size", 128))),
                   bool(cfg.get("zero_point", True)), cfg.get("version", "gemm"), cfg.get("modules_to_not_convert") or ())

    def linear_method(self, prefix, layer):
        if self.is_ignored(prefix):
            return None
        return W4A16LinearMethod("awq", self.group, sym=False, act_order=False)

    @property
    def description(self) -> str:
        return f"awq (4-bit, group {self.group})"
