"""gpt-oss (GptOssForCausalLM): attention with q/k/v/o biases and a learned per-head sink logit
in the softmax's denominator (HF's `sinks`), sliding-window (128) and full layers alternating
(`layer_types`), YaRN rotary; on every layer a routed MoE: a router with a bias, the top-k
logits' softmax as the routing weights, and experts with biases and a clamped SwiGLU
("swigluoai", kernels/fused_moe.py).

Checkpoint names are HF's. The experts come stacked, not per expert: `mlp.experts.gate_up_proj`
[E, H, 2I] with gate and up interleaved along 2I, `gate_up_proj_bias` [E, 2I], `down_proj`
[E, I, H], `down_proj_bias` [E, H] (a bf16 checkpoint), or, in the released checkpoints
(`quantization_config.quant_method == "mxfp4"`), `*_blocks` and `*_scales`: MXFP4, dequantized
here at load to the model's dtype (no W4A16 kernel yet), in the [E, out, in] layout they are
stored in. Both become FusedMoE's [gate; up] stacked w13 and w2 (workers/models/moe.py)."""
from __future__ import annotations

from typing import Iterable, Iterator

import torch
from torch import nn

from kernels.fused_moe import deinterleave_gate_up
from workers.attention import Attention, AttentionMetadata
from workers.distributed import tp_rank, tp_size
from workers.models.blocks import DecoderForCausalLM, DecoderModel, SelfAttention
from workers.models.layers import KVCache, RMSNorm, RotaryEmbedding, _check_shape, _narrow, _set_loader, \
    layer_sliding_window, replicated
from workers.models.moe import FusedMoE

# MXFP4 (OCP microscaling): a block of 32 FP4 (E2M1) values, two to a byte (low nibble first),
# shares one E8M0 scale byte, 2 ** (scale - 127)
FP4_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
MXFP4_BLOCK = 32
DEQUANT_ROWS = 1 << 20   # blocks unpacked at a time: bounds the temporaries (a 120b layer is 1 GB packed)


def dequantize_mxfp4(blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """blocks uint8 [..., G, 16] and scales uint8 [..., G] -> [..., G * 32] in dtype (exact:
    every MXFP4 value is a bf16). The [E, out, in] layout of gpt-oss's checkpoint is kept, as
    transformers' convert_moe_packed_tensors computes it before its transpose."""
    if blocks.shape[:-1] != scales.shape or blocks.shape[-1] != MXFP4_BLOCK // 2:
        raise ValueError(f"MXFP4 blocks {tuple(blocks.shape)} and scales {tuple(scales.shape)} do not match")
    lut = torch.tensor(FP4_VALUES, dtype=dtype, device=blocks.device)
    out = torch.empty((*blocks.shape[:-1], MXFP4_BLOCK), dtype=dtype, device=blocks.device)
    rows_b, rows_s, rows_o = blocks.reshape(-1, MXFP4_BLOCK // 2), scales.reshape(-1), out.view(-1, MXFP4_BLOCK)
    for lo in range(0, rows_b.shape[0], DEQUANT_ROWS):
        b, o = rows_b[lo:lo + DEQUANT_ROWS].to(torch.uint8), rows_o[lo:lo + DEQUANT_ROWS]
        o[:, 0::2] = lut[(b & 0x0F).int()]
        o[:, 1::2] = lut[(b >> 4).int()]
        o.copy_(torch.ldexp(o, rows_s[lo:lo + DEQUANT_ROWS].to(torch.int32).sub(127).unsqueeze(-1)))
    return out.flatten(-2)


def quant_method(config) -> str | None:
    """config.json's `quantization_config.quant_method` (a dict, or transformers' config object)."""
    qc = getattr(config, "quantization_config", None)
    if qc is None:
        return None
    return qc.get("quant_method") if isinstance(qc, dict) else getattr(qc, "quant_method", None)


@torch.no_grad()
def _head_loader(param: nn.Parameter, loaded, shard_id=None) -> None:
    """One value per query head [total heads]: this rank's heads (its q heads' range)."""
    heads = param.shape[0]
    _check_shape(loaded, (heads * tp_size(),))
    param.data.copy_(_narrow(loaded, 0, tp_rank() * heads, heads))


class GptOssAttention(SelfAttention):
    """SelfAttention (fused qkv with biases, o_proj with a bias, the layer's window) whose
    attention has the sinks: this rank's heads' [num_heads] logits, HF's `self_attn.sinks`."""

    def __init__(self, config, rotary_emb: RotaryEmbedding, layer_idx: int):
        bias = bool(getattr(config, "attention_bias", True))
        super().__init__(config, rotary_emb, qkv_bias=bias, o_bias=bias, qk_norm=False,
                         sliding_window=layer_sliding_window(config, layer_idx))
        sinks = nn.Parameter(torch.empty(self.num_heads), requires_grad=False)
        _set_loader(sinks, _head_loader, (config.num_attention_heads,))
        self.attn = Attention(self.num_heads, self.num_kv_heads, self.head_dim, self.attn.scale,
                              sliding_window=self.attn.sliding_window, sinks=sinks)


class GptOssRouter(nn.Module):
    """The replicated router with its bias: hidden [T, H] -> logits [T, E] (HF's `mlp.router`)."""

    def __init__(self, hidden_size: int, num_experts: int):
        super().__init__()
        self.weight = replicated(nn.Parameter(torch.empty(num_experts, hidden_size), requires_grad=False))
        self.bias = replicated(nn.Parameter(torch.empty(num_experts), requires_grad=False))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return nn.functional.linear(x, self.weight, self.bias)


class GptOssMLP(nn.Module):
    """HF routes by the top-k router logits and softmaxes those k: the same weights as a
    softmax over all experts renormalised over the chosen k (FusedMoE's renormalize)."""

    def __init__(self, config):
        super().__init__()
        e, h, i = config.num_local_experts, config.hidden_size, config.intermediate_size
        self.router = GptOssRouter(h, e)
        self.experts = FusedMoE(e, config.num_experts_per_tok, h, i, renormalize=True, activation="swigluoai")
        self.experts.add_biases()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.experts(x, self.router(x))


class GptOssDecoderLayer(nn.Module):
    def __init__(self, config, rotary_emb: RotaryEmbedding, layer_idx: int):
        super().__init__()
        self.self_attn = GptOssAttention(config, rotary_emb, layer_idx)
        self.mlp = GptOssMLP(config)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor, residual: torch.Tensor | None,
                kv_cache: KVCache, meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        hidden, residual = self.self_attn(positions, hidden, residual, self.input_layernorm, kv_cache, meta)
        normed, residual = self.post_attention_layernorm(hidden, residual)
        return self.mlp(normed), residual


class GptOssForCausalLM(DecoderForCausalLM):
    def __init__(self, config):
        method = quant_method(config)
        if method not in (None, "mxfp4"):
            raise ValueError(f"gpt-oss: unsupported quantization {method!r} (a bf16 or an MXFP4 checkpoint)")
        super().__init__(config, lambda config: DecoderModel(config, GptOssDecoderLayer))

    def hf_to_loom(self, name: str) -> str | None:
        if name.endswith(".self_attn.sinks"):
            return name.replace(".self_attn.sinks", ".self_attn.attn.sinks")
        return super().hf_to_loom(name)

    def load_weights(self, weights: Iterable[tuple[str, object]], partial: bool = False) -> set[str]:
        """HF's stacked expert tensors (bf16 or MXFP4) become w13 / w2 and their biases (the
        checkpoint names are still what a duplicate or an unmapped tensor is reported by)."""
        dtype = self.model.layers[0].mlp.experts.w13_weight.dtype
        return super().load_weights(_expert_tensors(weights, dtype), partial)


_EXPERTS = ".mlp.experts."


def _expert_tensors(weights: Iterable[tuple[str, object]], dtype: torch.dtype) -> Iterator[tuple[str, object]]:
    """Rewrites HF's expert tensors into FusedMoE's parameters, whole ([E, ...], each rank's
    loader keeps its part), and passes every other tensor through. An MXFP4 weight's blocks
    and scales may come in either order (or files apart): the first waits for the second."""
    pending: dict[str, object] = {}
    for name, tensor in weights:
        if _EXPERTS not in name:
            yield name, tensor
            continue
        prefix, leaf = name.split(_EXPERTS)
        prefix += _EXPERTS
        if leaf.endswith(("_blocks", "_scales")):
            proj, kind = leaf.rsplit("_", 1)
            other = f"{prefix}{proj}_{'scales' if kind == 'blocks' else 'blocks'}"
            if other not in pending:
                pending[name] = tensor
                continue
            blocks, scales = (tensor, pending.pop(other)) if kind == "blocks" else (pending.pop(other), tensor)
            weight = dequantize_mxfp4(_whole(blocks), _whole(scales), dtype)   # [E, out, in]
            yield _expert_weight(prefix, proj, weight)
        elif leaf in ("gate_up_proj", "down_proj"):          # bf16: [E, in, out]
            yield _expert_weight(prefix, leaf, _whole(tensor).transpose(1, 2))
        elif leaf == "gate_up_proj_bias":
            yield f"{prefix}w13_bias", deinterleave_gate_up(_whole(tensor), 1)
        elif leaf == "down_proj_bias":
            yield f"{prefix}w2_bias", tensor
        else:
            yield name, tensor   # (reported as unmapped by the loader)
    if pending:
        raise ValueError(f"MXFP4 tensors without their blocks or scales: {', '.join(sorted(pending))}")


def _expert_weight(prefix: str, proj: str, weight: torch.Tensor) -> tuple[str, torch.Tensor]:
    """weight [E, out, in] of gate_up_proj (gate and up interleaved over out) or down_proj."""
    if proj == "gate_up_proj":
        return f"{prefix}w13_weight", deinterleave_gate_up(weight, 1)
    if proj == "down_proj":
        return f"{prefix}w2_weight", weight
    raise ValueError(f"unknown expert tensor {prefix}{proj}")


def _whole(loaded) -> torch.Tensor:
    """A tensor, or a safetensors slice read whole (experts are rearranged before sharding)."""
    return loaded if isinstance(loaded, torch.Tensor) else loaded[:]
