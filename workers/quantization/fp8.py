"""FP8 (e4m3) weights: vLLM's `fp8` format.

* Online (`--quantization fp8` on a bf16/fp16/fp32 checkpoint): every linear's weight is
  quantized per output channel as it arrives (the weight loader does it, so a weight update of
  bf16 tensors is re-quantized on arrival too); activations are quantized per token at run time.
* Serialized (`quantization_config.quant_method == "fp8"`): fp8 weights with a per-tensor
  `weight_scale` (one per checkpoint tensor: the q, k and v of a fused qkv_proj keep their
  own, as per-channel scales of their rows) and, with `activation_scheme: static`, an
  `input_scale` (a fused layer takes its parts' largest, as vLLM does).
* Block-wise (`weight_block_size: [128, 128]`, Qwen3-FP8 and DeepSeek): fp8 weights with a
  float32 `weight_scale_inv` per 128x128 block (`Fp8BlockLinearMethod`).

compressed-tensors' FP8 schemes reuse `Fp8LinearMethod` (workers/quantization/compressed_tensors.py).
"""
from __future__ import annotations

import torch
from torch import nn

from ipc import envs
from kernels import fp8_linear as k
from workers.quantization.base import LinearMethod, QuantizationConfig, QuantizationError
from workers.quantization.params import QuantDims, quant_param, whole


def _is_fp8(loaded) -> bool:
    dtype = loaded.dtype if isinstance(loaded, torch.Tensor) else loaded.get_dtype()
    return str(dtype).upper() in ("TORCH.FLOAT8_E4M3FN", "F8_E4M3")


def _shard_rows(layer, shard_id) -> tuple[int, int]:
    """(first row, rows) of this rank's weight that a checkpoint tensor (shard id) fills."""
    shards = getattr(layer, "shards", None)
    if shards is None or shard_id is None:
        return 0, layer.weight.shape[0]
    offset = 0
    for sid, s in shards.items():
        if sid == shard_id:
            return offset, s.size
        offset += s.size
    raise KeyError(shard_id)


class Fp8LinearMethod(LinearMethod):
    """fp8 weight [N, K] with a float32 scale per output row (per-tensor checkpoint scales are
    spread over their rows), optional static input scale; see the module docstring."""

    def __init__(self, online: bool, static_input: bool = False):
        self.online, self.static_input = online, static_input

    weight_dtype = "fp8_e4m3"

    def create_weights(self, layer: nn.Module) -> None:
        device = layer.quant_device
        weight = quant_param(layer, QuantDims(0), k.FP8, device)
        dense_loader = weight.weight_loader

        @torch.no_grad()
        def load_weight(param, loaded, shard_id=None):
            if _is_fp8(loaded):
                return dense_loader(param, loaded, shard_id)
            # a float weight (online, or a weight update): keep this rank's part, then quantize
            # its rows, writing their scales (the rows of other parts keep theirs)
            staging = torch.empty(param.shape, dtype=torch.float32, device=param.device)
            dense_loader(staging, loaded, shard_id)
            rows = [_shard_rows(layer, sid) for sid in (layer.shards if shard_id is None and hasattr(layer, "shards")
                                                        else (shard_id,))]
            for start, size in rows:
                q, s = k.quantize_rows(staging.narrow(0, start, size))
                param.data.narrow(0, start, size).copy_(q)
                layer.weight_scale.data.narrow(0, start, size).copy_(s)

        weight.weight_loader = load_weight
        layer.weight = weight
        scale = quant_param(layer, QuantDims(0, has_in=False), torch.float32, device, required=not self.online)
        scale_loader = scale.weight_loader

        @torch.no_grad()
        def load_scale(param, loaded, shard_id=None):
            t = whole(loaded).float()
            if t.numel() == 1 or t.dim() == 2 and t.shape[1] == 1:
                t = t.reshape(-1)
            if t.numel() == 1:   # per-tensor: every row of this part
                start, size = _shard_rows(layer, shard_id)
                param.data.narrow(0, start, size).fill_(t.item())
                return
            scale_loader(param, t, shard_id)

        scale.weight_loader = load_scale
        layer.weight_scale = scale
        if self.static_input:
            inp = nn.Parameter(torch.zeros((), dtype=torch.float32, device=device), requires_grad=False)

            @torch.no_grad()
            def load_input_scale(param, loaded, shard_id=None):
                param.data.copy_(torch.maximum(param.data, whole(loaded).float().reshape(())))

            inp.weight_loader, inp.full_shape = load_input_scale, ()
            inp.shard_ids = tuple(getattr(layer, "shards", {None: None}))
            layer.input_scale = inp

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        layer.weight_scale.data = layer.weight_scale.data.contiguous()

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        w, scale = layer.weight, layer.weight_scale
        input_scale = getattr(layer, "input_scale", None)
        if not x.is_cuda:
            if input_scale is not None:   # the static activation rounding, emulated
                xq, xs = k.quantize_per_token_ref(x, input_scale)
                x = (xq.float() * xs).to(x.dtype)
            y = k.fp8_linear_ref(x, w, scale, bias)
        elif x.shape[0] <= k.MAX_GEMV_ROWS:
            y = k.fp8_gemv(x, w, scale, bias)
        elif x.dtype == torch.bfloat16 and w.shape[0] % 16 == 0 and w.shape[1] % 16 == 0:
            y = k.scaled_mm_per_channel(x, w, scale, bias, input_scale)
        else:
            y = k.fp8_linear_ref(x, w, scale, bias)
        return y.view(*shape[:-1], y.shape[-1])

    def gemv_weight(self, layer, x):
        """At decode rows on the GPU: the fp8 weight and its row scales (kernels/fp8_linear.fp8_gemv's path)."""
        if not x.is_cuda or x.shape[0] > k.MAX_GEMV_ROWS or envs.LOOM_FP8_GEMV == "legacy":
            return None
        return layer.weight, layer.weight_scale

    def dense_to_checkpoint(self, layer, weight, shard_id=None):
        if self.online:
            return {"weight": weight}
        q, s = k.quantize_rows(weight)
        return {"weight": q, "weight_scale": s.view(-1, 1)}


class Fp8BlockLinearMethod(LinearMethod):
    """fp8 weight [N, K] with a float32 `weight_scale_inv` per block x block tile."""
    weight_dtype = "fp8_e4m3"

    def __init__(self, block: tuple[int, int], scale_name: str = "weight_scale_inv"):
        if block[0] != block[1]:
            raise QuantizationError(f"unsupported quantization_config: fp8 weight_block_size {list(block)} "
                                    f"(only square blocks)")
        self.block = block[0]
        self.scale_name = scale_name   # compressed-tensors names it weight_scale

    def create_weights(self, layer: nn.Module) -> None:
        device = layer.quant_device
        shards = getattr(layer, "shards", {})
        if len(shards) > 1 and any(s.size % self.block for s in shards.values()):   # as vLLM
            raise QuantizationError(f"block-wise fp8: the fused parts' output sizes "
                                    f"{[s.size for s in shards.values()]} are not multiples of the block "
                                    f"size {self.block}")
        weight = quant_param(layer, QuantDims(0), k.FP8, device)
        dense_loader, block = weight.weight_loader, self.block

        @torch.no_grad()
        def load_weight(param, loaded, shard_id=None):
            if _is_fp8(loaded):
                return dense_loader(param, loaded, shard_id)
            # a float weight (a weight update): this rank's part, its rows' blocks quantized
            staging = torch.empty(param.shape, dtype=torch.float32, device=param.device)
            dense_loader(staging, loaded, shard_id)
            scale = getattr(layer, self.scale_name)
            sids = layer.shards if shard_id is None and hasattr(layer, "shards") else (shard_id,)
            for start, size in (_shard_rows(layer, sid) for sid in sids):
                q, s = k.quantize_blocks(staging.narrow(0, start, size), block)
                param.data.narrow(0, start, size).copy_(q)
                scale.data.narrow(0, start // block, s.shape[0]).copy_(s)

        weight.weight_loader = load_weight
        layer.weight = weight
        setattr(layer, self.scale_name, quant_param(layer, QuantDims(0, block, block), torch.float32, device))

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        w, scale = layer.weight, getattr(layer, self.scale_name)
        if not x.is_cuda:
            y = k.fp8_linear_ref(x, w, scale, bias, self.block)
        elif x.shape[0] <= k.MAX_GEMV_ROWS:
            y = k.fp8_gemv(x, w, scale, bias, self.block)
        elif x.shape[1] % self.block == 0:
            y = k.block_fp8_gemm(x, w, scale, bias, self.block)
        else:
            y = k.fp8_linear_ref(x, w, scale, bias, self.block)
        return y.view(*shape[:-1], y.shape[-1])

    def dense_to_checkpoint(self, layer, weight, shard_id=None):
        q, s = k.quantize_blocks(weight, self.block)
        return {"weight": q, self.scale_name: s}


class Fp8Config(QuantizationConfig):
    """vLLM's `fp8`: online from a float checkpoint, or serialized (per-tensor or block-wise)."""
    name = "fp8"

    def __init__(self, serialized: bool, activation_scheme: str = "dynamic", block: list | None = None,
                 ignore: list | None = None):
        if activation_scheme not in ("dynamic", "static"):
            raise QuantizationError(f"fp8 activation_scheme {activation_scheme!r} is not supported "
                                    f"(dynamic or static)")
        self.serialized, self.activation_scheme = serialized, activation_scheme
        self.block = tuple(block) if block else None
        self.ignore = tuple(ignore or ())

    @classmethod
    def from_config(cls, cfg: dict | None) -> "Fp8Config":
        if cfg is None:   # --quantization fp8 on a float checkpoint
            return cls(serialized=False)
        return cls(serialized=True, activation_scheme=cfg.get("activation_scheme", "dynamic"),
                   block=cfg.get("weight_block_size"), ignore=cfg.get("ignored_layers") or cfg.get(
                       "modules_to_not_convert"))

    def linear_method(self, prefix: str, layer: nn.Module) -> LinearMethod | None:
        if self.is_ignored(prefix):
            return None
        if self.block is not None:
            return Fp8BlockLinearMethod(self.block)
        return Fp8LinearMethod(online=not self.serialized, static_input=self.activation_scheme == "static")

    @property
    def description(self) -> str:
        if not self.serialized:
            return "fp8 (online, per-channel weights, per-token activations)"
        if self.block:
            return f"fp8 (block-wise {self.block[0]}x{self.block[1]} weights)"
        return f"fp8 (per-tensor weights, {self.activation_scheme} activations)"

