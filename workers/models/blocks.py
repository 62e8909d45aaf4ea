"""The decoder blocks that models compose: the gated MLP, self-attention over the paged KV
cache, the pre-norm decoder layer, and the decoder stack (embedding -> layers -> final norm).

A model whose layer is shaped differently writes its own layer from the same pieces (see
workers/models/olmo2.py: post-norms, and q/k norms over the whole projection) and hands it to
DecoderModel; nothing here needs an edit for it.

The residual stream is carried between layers as (hidden, residual), hidden + residual being
the layer's output, so that the add fuses into the next norm (residual None: the first layer).
The hot ops are looked up on `layers` at run time (use_triton_kernels() rebinds them there)."""
from __future__ import annotations

from typing import Callable, Iterable

import torch
from torch import nn

from kernels.qk_rope_cache import qk_norm_rope_ref
from workers.attention import Attention, AttentionMetadata
from workers.distributed import LogitsShard, tp_rank, tp_size
from workers.models import layers
from workers.models.layers import (ColumnParallelLinear, KVCache, RMSNorm, RotaryEmbedding, RowParallelLinear,
                                   Shard, VocabParallelEmbedding, get_head_dim, get_num_kv_heads, get_rope_params,
                                   heads_of_rank, layer_sliding_window, split_shards)
from workers.models.weights import STACKED_PARAMS, load_weights


class GatedMLP(nn.Module):
    """down(act(gate(x)) * up(x)) with gate and up fused; after a pre-norm (forward_normed) the
    norm is fused into gate_up at decode sizes, as the SiLU is into down.

    act: "silu" (SwiGLU) or "gelu_tanh" (GeGLU: Gemma's gelu_pytorch_tanh, not fused into the GEMV)."""

    def __init__(self, hidden_size: int, intermediate_size: int, bias: bool = False, norm_slot: int | None = 1,
                 act: str = "silu"):
        super().__init__()
        if act not in ("silu", "gelu_tanh"):
            raise ValueError(f"GatedMLP: unsupported activation {act!r} (silu, gelu_tanh)")
        self.act = act
        self.gate_up_proj = ColumnParallelLinear(
            hidden_size, split_shards({0: intermediate_size, 1: intermediate_size}, tp_rank(), tp_size()), bias)
        self.down_proj = RowParallelLinear(intermediate_size, hidden_size, bias, norm_slot=norm_slot)

    def forward(self, x: torch.Tensor):
        """mlp(x), with no norm before it (a post-norm layer)."""
        return self._down(self.gate_up_proj(x))

    def forward_normed(self, x: torch.Tensor, residual: torch.Tensor | None,
                       norm: RMSNorm) -> tuple[torch.Tensor, torch.Tensor]:
        """(mlp(norm(x + residual)), the new residual)."""
        gate_up, residual = self.gate_up_proj.forward_normed(x, residual, norm)
        return self._down(gate_up), residual

    def _down(self, gate_up: torch.Tensor):
        if self.act == "silu":
            return self.down_proj(gate_up, silu_mul=True)
        return self.down_proj(layers.gelu_tanh_and_mul(gate_up))


class SelfAttention(nn.Module):
    """qkv projection -> [per-head q/k RMSNorm] -> rotary, KV-cache write -> paged attention -> o_proj.

    forward: the pre-norm path (the norm fused into the qkv projection). A layer that treats q
    and k otherwise projects with qkv_proj itself, then calls split_qkv and attend."""

    def __init__(self, config, rotary_emb: RotaryEmbedding, *, qkv_bias: bool, o_bias: bool,
                 qk_norm: bool, o_norm_slot: int | None = 0, sliding_window: int | None = None,
                 logits_soft_cap: float | None = None, scale: float | None = None):
        """sliding_window: this layer's window (layers.layer_sliding_window), None: full attention;
        logits_soft_cap: attention scores become cap * tanh(scores / cap) (Gemma 2);
        scale: the score scale, head_dim ** -0.5 unless the model says otherwise."""
        super().__init__()
        total_heads, total_kv_heads = config.num_attention_heads, get_num_kv_heads(config)
        self.head_dim = get_head_dim(config)
        self.num_heads, self.num_kv_heads, kv_start = heads_of_rank(total_heads, total_kv_heads, tp_rank(), tp_size())
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        d = self.head_dim
        shards = {"q": Shard(total_heads * d, tp_rank() * self.q_size, self.q_size, 0),
                  "k": Shard(total_kv_heads * d, kv_start * d, self.kv_size, self.q_size),
                  "v": Shard(total_kv_heads * d, kv_start * d, self.kv_size, self.q_size + self.kv_size)}
        self.qkv_proj = ColumnParallelLinear(config.hidden_size, shards, qkv_bias)
        self.o_proj = RowParallelLinear(total_heads * d, config.hidden_size, o_bias, norm_slot=o_norm_slot)
        self.per_head_qk_norm = qk_norm   # (a model may norm q and k otherwise, before attend)
        if qk_norm:
            self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
            self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
        else:
            self.q_norm = self.k_norm = None
        self.rotary_emb = rotary_emb  # shared instance
        self.attn = Attention(self.num_heads, self.num_kv_heads, self.head_dim,
                              self.head_dim ** -0.5 if scale is None else scale,
                              sliding_window=sliding_window, logits_soft_cap=logits_soft_cap)

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor, residual: torch.Tensor | None,
                norm: RMSNorm, kv_cache: KVCache, meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        """(attention(norm(hidden + residual)), the new residual); the norm is fused into the qkv
        projection at decode sizes (residual None: the first layer)."""
        qkv, residual = self.qkv_proj.forward_normed(hidden, residual, norm)
        return self.attend(positions, *self.split_qkv(qkv), kv_cache, meta), residual

    def split_qkv(self, qkv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The fused projection [T, q + k + v] -> q, k, v (views)."""
        return qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)

    def attend(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               kv_cache: KVCache, meta: AttentionMetadata):
        """q [T, heads * head_dim], k and v [T, kv_heads * head_dim] -> o_proj(attention): the
        per-head q/k norm (if any), rotary and the KV-cache write in one op, then paged attention."""
        t = q.shape[0]
        q = q.view(t, self.num_heads, self.head_dim)
        k = k.view(t, self.num_kv_heads, self.head_dim)
        v = v.view(t, self.num_kv_heads, self.head_dim)
        norms = ((self.q_norm.weight, self.k_norm.weight, self.q_norm.eps) if self.per_head_qk_norm
                 else (None, None, 0.0))
        rope = dict(mrope_section=self.rotary_emb.mrope_section, is_neox_style=self.rotary_emb.is_neox_style)
        if meta.calculate_kv_scales:   # once, eagerly: the keys as the cache gets them, unfused
            self.attn.calculate_kv_scales(qk_norm_rope_ref(positions, q, k, self.rotary_emb.cos_sin_cache,
                                                           *norms, **rope)[1], v)
        q = layers.qk_norm_rope_cache(positions, q, k, v, self.rotary_emb.cos_sin_cache, *kv_cache, meta.slot_mapping,
                                      *norms, **rope, k_scale=self.attn.k_scale, v_scale=self.attn.v_scale)
        return self.o_proj(self.attn(q, kv_cache, meta))


class DecoderLayer(nn.Module):
    """The pre-norm block (Llama, Mistral, Qwen2, Qwen3): x + attn(norm(x)), then + mlp(norm(.))."""

    def __init__(self, config, rotary_emb: RotaryEmbedding, layer_idx: int, *, qkv_bias: bool, o_bias: bool,
                 qk_norm: bool, mlp_bias: bool):
        super().__init__()
        self.self_attn = SelfAttention(config, rotary_emb, qkv_bias=qkv_bias, o_bias=o_bias, qk_norm=qk_norm,
                                       sliding_window=layer_sliding_window(config, layer_idx))
        self.mlp = GatedMLP(config.hidden_size, config.intermediate_size, mlp_bias)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor, residual: torch.Tensor | None,
                kv_cache: KVCache, meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        hidden, residual = self.self_attn(positions, hidden, residual, self.input_layernorm, kv_cache, meta)
        return self.mlp.forward_normed(hidden, residual, self.post_attention_layernorm)


class DecoderModel(nn.Module):
    """Embedding -> layers -> final norm. `make_layer(config, rotary_emb, layer_idx)` builds one
    layer, a module called as layer(positions, hidden, residual, kv_cache, meta) -> (hidden, residual);
    `make_norm(config)` the final norm (RMSNorm by default), called as RMSNorm is."""

    def __init__(self, config, make_layer: Callable[[object, RotaryEmbedding, int], nn.Module],
                 make_norm: Callable[[object], nn.Module] | None = None):
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size)
        self.rotary_emb = RotaryEmbedding(get_head_dim(config), config.max_position_embeddings,
                                          get_rope_params(config))
        self.layers = nn.ModuleList(make_layer(config, self.rotary_emb, i) for i in range(config.num_hidden_layers))
        self.norm = (make_norm(config) if make_norm is not None
                     else RMSNorm(config.hidden_size, config.rms_norm_eps))

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list[KVCache],
                meta: AttentionMetadata, inputs_embeds: torch.Tensor | None = None) -> torch.Tensor:
        """positions: [T], or [3, T] for M-RoPE; inputs_embeds (multimodal) replace the token embeddings."""
        hidden = self.embed_tokens(input_ids) if inputs_embeds is None else inputs_embeds
        residual = None
        for layer, kv_cache in zip(self.layers, kv_caches, strict=True):
            hidden, residual = layer(positions, hidden, residual, kv_cache, meta)
        hidden, _ = self.norm(hidden, residual)
        return hidden


class DecoderForCausalLM(nn.Module):
    """A decoder stack (`self.model`, built by make_model(config)) and its lm_head, tied to the
    embedding when the config says so; the weight names are the checkpoint's own (HF's
    `model.*`, `lm_head.*`) with q/k/v and gate/up fused (STACKED_PARAMS)."""
    stacked_params = STACKED_PARAMS  # checkpoint names of fused parameters' parts (weight updates read it)

    def __init__(self, config, make_model: Callable[[object], nn.Module]):
        super().__init__()
        self.config = config
        self.model = make_model(config)
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

    def hf_to_loom(self, name: str) -> str | None:
        """The checkpoint's names are ours, less HF's rotary buffers (inv_freq, cos/sin caches)
        and a tied lm_head's copy of the embedding."""
        if "rotary_emb." in name or (self.tie_word_embeddings and name == "lm_head.weight"):
            return None
        return name

    def load_weights(self, weights: Iterable[tuple[str, object]], partial: bool = False) -> set[str]:
        """Load HF-named tensors (or safetensors slices, of which each rank reads its shard;
        `partial`: only some, as a weight update sends); see `weights.load_stacked_weights` for
        the errors raised."""
        return load_weights(self, weights, partial)
