"""Arcee (ArceeForCausalLM, AFM-4.5B): Llama with a plain (not gated) MLP,
down(relu(up(x)) ** 2) (`hidden_act` "relu2"). Biases follow `attention_bias` / `mlp_bias`;
weight names are HF's (`mlp.up_proj`, `mlp.down_proj`)."""
from __future__ import annotations

import torch
from torch import nn

from workers.distributed import tp_rank, tp_size
from workers.models.blocks import DecoderForCausalLM, DecoderLayer, DecoderModel, SelfAttention
from workers.models.weights import STACKED_PARAMS
from workers.models.layers import (ColumnParallelLinear, RMSNorm, RotaryEmbedding, RowParallelLinear,
                                   layer_sliding_window, split_shards)


class ReluSquaredMLP(nn.Module):
    """down(relu(up(x)) ** 2): up column-parallel, down row-parallel (one all-reduce)."""

    def __init__(self, hidden_size: int, intermediate_size: int, bias: bool):
        super().__init__()
        self.up_proj = ColumnParallelLinear(hidden_size, split_shards({None: intermediate_size}, tp_rank(), tp_size()),
                                            bias)
        self.down_proj = RowParallelLinear(intermediate_size, hidden_size, bias, norm_slot=1)

    def forward_normed(self, x: torch.Tensor, residual: torch.Tensor | None,
                       norm: RMSNorm) -> tuple[torch.Tensor, torch.Tensor]:
        """(mlp(norm(x + residual)), the new residual)."""
        up, residual = self.up_proj.forward_normed(x, residual, norm)
        return self.down_proj(torch.relu(up).square()), residual


class ArceeDecoderLayer(DecoderLayer):
    """The pre-norm block with the ReLU² MLP."""

    def __init__(self, config, rotary_emb: RotaryEmbedding, layer_idx: int):
        nn.Module.__init__(self)   # DecoderLayer's forward, with this layer's own modules
        bias = bool(getattr(config, "attention_bias", False))
        self.self_attn = SelfAttention(config, rotary_emb, qkv_bias=bias, o_bias=bias, qk_norm=False,
                                       sliding_window=layer_sliding_window(config, layer_idx))
        self.mlp = ReluSquaredMLP(config.hidden_size, config.intermediate_size, bool(getattr(config, "mlp_bias", False)))
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)


class ArceeForCausalLM(DecoderForCausalLM):
    stacked_params = [m for m in STACKED_PARAMS if m[0] == ".qkv_proj."]   # up_proj is no part of a gate_up

    def __init__(self, config):
        super().__init__(config, lambda config: DecoderModel(config, ArceeDecoderLayer))
