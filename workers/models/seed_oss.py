"""Seed-OSS (SeedOssForCausalLM, ByteDance Seed-OSS-36B): Llama with the q/k/v biases
(`attention_bias`, True in the checkpoints) and the o_proj bias (`attention_out_bias`) set
apart, and `mlp_bias`. Weight names are HF's."""
from __future__ import annotations

import functools

from workers.models.blocks import DecoderForCausalLM
from workers.models.llama import LlamaModel


class SeedOssForCausalLM(DecoderForCausalLM):
    def __init__(self, config):
        super().__init__(config, functools.partial(
            LlamaModel, qkv_bias=bool(getattr(config, "attention_bias", True)),
            o_bias=bool(getattr(config, "attention_out_bias", False)), qk_norm=False,
            mlp_bias=bool(getattr(config, "mlp_bias", False))))
