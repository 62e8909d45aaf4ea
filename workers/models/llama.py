"""Llama (and Mistral): the base decoder-only model the other architectures reuse.

Subclasses change behaviour through the class flags below rather than by
overriding layers:
    qkv_bias / o_bias  -- biases on the fused qkv projection / the output projection
                          (None: follow `config.attention_bias`, as HF Llama does)
    qk_norm            -- per-head RMSNorm on q and k before rotary (Qwen3)
"""
from __future__ import annotations

from typing import Iterable

import torch
from torch import nn

from workers.attention import AttentionMetadata
from workers.distributed import LogitsShard
from workers.models.layers import (DecoderLayer, KVCache, RMSNorm, RotaryEmbedding, VocabParallelEmbedding,
                                   get_head_dim, get_rope_params, load_stacked_weights)

# (our fused parameter, checkpoint part, shard id)
STACKED_PARAMS = [
    (".qkv_proj.", ".q_proj.", "q"),
    (".qkv_proj.", ".k_proj.", "k"),
    (".qkv_proj.", ".v_proj.", "v"),
    (".gate_up_proj.", ".gate_proj.", 0),
    (".gate_up_proj.", ".up_proj.", 1),
]


class LlamaModel(nn.Module):
    def __init__(self, config, *, qkv_bias: bool, o_bias: bool, qk_norm: bool, mlp_bias: bool):
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size)
        self.rotary_emb = RotaryEmbedding(get_head_dim(config), config.max_position_embeddings,
                                          get_rope_params(config))
        self.layers = nn.ModuleList(
            DecoderLayer(config, self.rotary_emb, qkv_bias=qkv_bias, o_bias=o_bias,
                         qk_norm=qk_norm, mlp_bias=mlp_bias)
            for _ in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list[KVCache],
                meta: AttentionMetadata, inputs_embeds: torch.Tensor | None = None) -> torch.Tensor:
        """positions: [T], or [3, T] for M-RoPE; inputs_embeds (multimodal) replace the token embeddings."""
        hidden = self.embed_tokens(input_ids) if inputs_embeds is None else inputs_embeds
        residual = None
        for layer, kv_cache in zip(self.layers, kv_caches, strict=True):
            hidden, residual = layer(positions, hidden, residual, kv_cache, meta)
        hidden, _ = self.norm(hidden, residual)
        return hidden


class LlamaForCausalLM(nn.Module):
    qkv_bias: bool | None = None  # None: config.attention_bias
    o_bias: bool | None = None    # None: config.attention_bias
    qk_norm: bool = False
    stacked_params = STACKED_PARAMS  # checkpoint names of fused parameters' parts (weight updates read it)

    def __init__(self, config):
        super().__init__()
        self.config = config
        attention_bias = bool(getattr(config, "attention_bias", False))
        self.model = LlamaModel(
            config,
            qkv_bias=attention_bias if self.qkv_bias is None else self.qkv_bias,
            o_bias=attention_bias if self.o_bias is None else self.o_bias,
            qk_norm=self.qk_norm,
            mlp_bias=bool(getattr(config, "mlp_bias", False)),
        )
        self.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", False))
        if self.tie_word_embeddings:
            self.lm_head = self.model.embed_tokens  # shares the weight Parameter
        else:
            self.lm_head = VocabParallelEmbedding(config.vocab_size, config.hidden_size)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list[KVCache],
                meta: AttentionMetadata) -> torch.Tensor:
        """Flattened (varlen) tokens of all sequences -> final hidden states [T, hidden]."""
        return self.model(input_ids, positions, kv_caches, meta)

    def compute_logits(self, hidden: torch.Tensor, plain: bool = False) -> torch.Tensor | LogitsShard:
        """hidden [N, hidden] -> logits [N, vocab] in the model's dtype (the sampler reads
        bf16 directly and converts to float32 only where it computes on them). Under tensor
        parallelism every rank gets the whole vocabulary (gathered), so every rank samples
        the same tokens from the same seeds and keeps its batch in step; rows that sample
        plainly (`plain`) may get this rank's LogitsShard instead (VocabParallelEmbedding.logits)."""
        return self.lm_head.logits(hidden, plain)

    def _ignore_weight(self, name: str) -> bool:
        if "rotary_emb." in name:  # HF buffers (inv_freq, cos/sin caches)
            return True
        return self.tie_word_embeddings and name == "lm_head.weight"

    def load_weights(self, weights: Iterable[tuple[str, object]], partial: bool = False) -> set[str]:
        """Load HF-named tensors (or safetensors slices, of which each rank reads its shard;
        `partial`: only some, as a weight update sends); see `layers.load_stacked_weights` for
        the errors raised."""
        return load_stacked_weights(self, weights, STACKED_PARAMS, self._ignore_weight, partial)


class MistralForCausalLM(LlamaForCausalLM):
    """Llama-shaped; `head_dim` may be explicit in the config (handled by
    `get_head_dim`). Sliding-window attention is not implemented: the engine caps
    --max-model-len at `sliding_window`, where full attention is the same."""
