"""Llama (and Mistral): the pre-norm decoder that Qwen2 and Qwen3 reuse.

Subclasses change behaviour through the class flags below rather than by
overriding layers:
    qkv_bias / o_bias  -- biases on the fused qkv projection / the output projection
                          (None: follow `config.attention_bias`, as HF Llama does)
    qk_norm            -- per-head RMSNorm on q and k before rotary (Qwen3)
"""
from __future__ import annotations

import functools

from workers.models.blocks import DecoderForCausalLM, DecoderLayer, DecoderModel


class LlamaModel(DecoderModel):
    """The decoder stack of pre-norm layers (DecoderLayer)."""

    def __init__(self, config, *, qkv_bias: bool, o_bias: bool, qk_norm: bool, mlp_bias: bool):
        super().__init__(config, functools.partial(DecoderLayer, qkv_bias=qkv_bias, o_bias=o_bias,
                                                   qk_norm=qk_norm, mlp_bias=mlp_bias))


class LlamaForCausalLM(DecoderForCausalLM):
    qkv_bias: bool | None = None  # None: config.attention_bias
    o_bias: bool | None = None    # None: config.attention_bias
    qk_norm: bool = False

    def __init__(self, config):
        attention_bias = bool(getattr(config, "attention_bias", False))
        super().__init__(config, functools.partial(
            LlamaModel,
            qkv_bias=attention_bias if self.qkv_bias is None else self.qkv_bias,
            o_bias=attention_bias if self.o_bias is None else self.o_bias,
            qk_norm=self.qk_norm,
            mlp_bias=bool(getattr(config, "mlp_bias", False)),
        ))


class MistralForCausalLM(LlamaForCausalLM):
    """Llama-shaped; `head_dim` may be explicit in the config (handled by
    `get_head_dim`); `sliding_window` (every layer) through layers.layer_sliding_window."""
