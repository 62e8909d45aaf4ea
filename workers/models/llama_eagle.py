"""EAGLE draft heads for a Llama-family target (vLLM's llama_eagle.py and llama_eagle3.py).

EAGLE-1 (yuhuili/EAGLE-LLaMA3-Instruct-8B): the head's input at position i is the embedding of
token i + 1 fused with the target's last hidden state at i, x = fc([embed; h]) (fc [H, 2H]);
one Llama decoder layer without its input norm; its output e = hidden + residual stands for the
target's next hidden state: the target's own lm_head reads it, and the next draft step takes it
as h. The embedding and lm_head are the target's.

EAGLE-3 (yuhuili/EAGLE3-LLaMA3.1-Instruct-8B): h is fc([a_low; a_mid; a_high]) (fc [H, 3H]) over
three of the target's residual streams (the auxiliary layers), or the previous draft step's
pre-norm output; the layer (`midlayer`) attends over [input_layernorm(embed); hidden_norm(h)]
(its q/k/v projections take 2H); its output is normed by `norm` for its own lm_head over a
draft vocabulary, whose ids map to the target's by `d2t` (target = draft + d2t[draft]).

The speculators format (a config.json with `speculators_model_type` and
`transformer_layer_config`) maps to the same heads. Weights go through the decoder blocks'
tensor-parallel linears, so under TP the head runs sharded on every rank."""
from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass

import torch
from torch import nn

from workers.attention import AttentionMetadata
from workers.distributed import tp_rank, tp_size
from workers.models.blocks import GatedMLP, SelfAttention
from workers.models.layers import (ColumnParallelLinear, KVCache, RMSNorm, RotaryEmbedding, Shard,
                                   VocabParallelEmbedding, get_head_dim, get_num_kv_heads, get_rope_params,
                                   heads_of_rank, replicated)
from workers.models.weights import STACKED_PARAMS, load_stacked_weights


@dataclass(frozen=True)
class EagleHeadConfig:
    """What a head's config.json says, whichever layout it comes in."""
    method: str                    # "eagle" or "eagle3"
    layer: object                  # a transformers LlamaConfig: the decoder layer's shape
    draft_vocab_size: int          # eagle3: its lm_head's rows (the target's vocabulary for EAGLE-1)
    target_hidden_size: int
    norm_before_residual: bool     # eagle3: the residual is hidden_norm(h) rather than h
    aux_layer_ids: tuple[int, ...] | None   # eagle3: the target layers whose input streams fuse
    para_norms: bool               # EAGLE-1 HASS / speculators: norms on the embedding and on h
    fc_bias: bool


def read_head_config(model_dir: str, method: str) -> EagleHeadConfig:
    """The head's config.json: an HF Llama-style config (EAGLE's own releases) or the
    speculators format (its `transformer_layer_config`, the algorithm's fields beside it)."""
    from workers.hf_config import config_classes_only
    with config_classes_only():   # the config class alone (workers/hf_config.py)
        from transformers import LlamaConfig
    with open(os.path.join(model_dir, "config.json")) as f:
        raw = json.load(f)
    speculators = "speculators_model_type" in raw or "transformer_layer_config" in raw
    layer = dict(raw.get("transformer_layer_config", raw)) if speculators else dict(raw)
    for k in ("architectures", "model_type", "auto_map"):
        layer.pop(k, None)
    config = LlamaConfig(**layer)
    eagle_config = raw.get("eagle_config") or {}
    aux = (raw.get("eagle_aux_hidden_state_layer_ids") or eagle_config.get("eagle_aux_hidden_state_layer_ids")
           or layer.get("eagle_aux_hidden_state_layer_ids"))
    if raw.get("norm_before_fc"):
        raise ValueError(f"{model_dir}: norm_before_fc EAGLE-3 heads are not supported")
    return EagleHeadConfig(
        method=method, layer=config,
        draft_vocab_size=int(raw.get("draft_vocab_size") or layer.get("draft_vocab_size") or config.vocab_size),
        target_hidden_size=int(raw.get("target_hidden_size") or layer.get("target_hidden_size") or config.hidden_size),
        # (vLLM's defaults: True in the speculators format, False in EAGLE-3's own config)
        norm_before_residual=bool(raw.get("norm_before_residual", speculators)),
        aux_layer_ids=tuple(int(i) for i in aux) if aux else None,
        para_norms=bool(raw.get("add_para_norm") or raw.get("layernorms")),
        fc_bias=bool(raw.get("fusion_bias") or raw.get("bias", False) is True))


def default_aux_layers(num_layers: int) -> tuple[int, int, int]:
    """vLLM's auxiliary layers (2, L // 2, L - 3), clamped into a small target's layers."""
    return tuple(min(max(i, 0), num_layers - 1) for i in (2, num_layers // 2, num_layers - 3))


def _replicated_linear(in_features: int, out_features: int, bias: bool) -> nn.Linear:
    """A linear every rank holds whole (fc: its product feeds the sharded layer, replicated)."""
    lin = nn.Linear(in_features, out_features, bias=bias)
    lin.weight.requires_grad_(False)
    replicated(lin.weight)
    if bias:
        lin.bias.requires_grad_(False)
        replicated(lin.bias)
    return lin


def _qkv_shards(config) -> dict:
    """SelfAttention's q/k/v shards of this rank (for a qkv projection of another input width)."""
    total_heads, total_kv = config.num_attention_heads, get_num_kv_heads(config)
    d = get_head_dim(config)
    heads, kv_heads, kv_start = heads_of_rank(total_heads, total_kv, tp_rank(), tp_size())
    q, kv = heads * d, kv_heads * d
    return {"q": Shard(total_heads * d, tp_rank() * q, q, 0), "k": Shard(total_kv * d, kv_start * d, kv, q),
            "v": Shard(total_kv * d, kv_start * d, kv, q + kv)}


class EagleDecoderLayer(nn.Module):
    """The head's one decoder layer. EAGLE-1: attention over x itself (no input norm), x the
    residual. EAGLE-3: attention over [input_layernorm(embed); hidden_norm(h)] (2H wide)."""

    def __init__(self, config, rotary_emb: RotaryEmbedding, eagle3: bool, norm_before_residual: bool):
        super().__init__()
        bias = bool(getattr(config, "attention_bias", False))
        self.eagle3, self.norm_before_residual = eagle3, norm_before_residual
        self.self_attn = SelfAttention(config, rotary_emb, qkv_bias=bias, o_bias=bias, qk_norm=False)
        # EAGLE-1's output is the plain sum hidden + residual: its down_proj is summed at once
        self.mlp = GatedMLP(config.hidden_size, config.intermediate_size, bool(getattr(config, "mlp_bias", False)),
                            norm_slot=1 if eagle3 else None)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        if eagle3:
            self.self_attn.qkv_proj = ColumnParallelLinear(2 * config.hidden_size, _qkv_shards(config), bias)
            self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
            self.hidden_norm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, positions: torch.Tensor, embeds: torch.Tensor | None, hidden: torch.Tensor,
                kv_cache: KVCache, meta: AttentionMetadata):
        """-> (mlp output, residual): the layer's output is their sum."""
        if self.eagle3:
            normed = self.hidden_norm(hidden)
            residual = normed if self.norm_before_residual else hidden
            x = torch.cat((self.input_layernorm(embeds), normed), dim=-1)
        else:
            x = residual = hidden
        attn = self.self_attn.attend(positions, *self.self_attn.split_qkv(self.self_attn.qkv_proj(x)), kv_cache, meta)
        return self.mlp.forward_normed(attn, residual, self.post_attention_layernorm)


class EagleHead(nn.Module):
    """An EAGLE-1 or EAGLE-3 head. forward(ids, positions, h) -> (the rows its lm_head reads,
    the hidden states the next draft step takes as h). The target's embedding (and, for
    EAGLE-1, lm_head) are used, not owned: `attach_target` hands them over."""
    stacked_params = STACKED_PARAMS

    def __init__(self, hc: EagleHeadConfig, max_positions: int = 0):
        """max_positions: the positions the rotary cache covers at least (the target's context
        and the drafts past it), whatever the head's own config says."""
        super().__init__()
        config = hc.layer
        self.hc, self.config = hc, config
        self.eagle3 = hc.method == "eagle3"
        h = config.hidden_size
        self.rotary_emb = RotaryEmbedding(get_head_dim(config), max(config.max_position_embeddings, max_positions),
                                          get_rope_params(config))
        self.layers = nn.ModuleList([EagleDecoderLayer(config, self.rotary_emb, self.eagle3,
                                                       hc.norm_before_residual)])
        fused = 3 * hc.target_hidden_size if self.eagle3 else 2 * h
        self.fc = _replicated_linear(fused, h, hc.fc_bias)
        if self.eagle3:
            self.norm = RMSNorm(h, config.rms_norm_eps)
            self.lm_head = VocabParallelEmbedding(hc.draft_vocab_size, h)
            self.register_buffer("d2t", torch.zeros(hc.draft_vocab_size, dtype=torch.long), persistent=False)
        elif hc.para_norms:   # HASS: the embedding and h normed before the fusion
            self.embedding_layernorm = RMSNorm(h, config.rms_norm_eps)
            self.hidden_states_layernorm = RMSNorm(h, config.rms_norm_eps)
        self.embed_tokens: VocabParallelEmbedding | None = None   # own (an EAGLE-3 checkpoint's) or the target's
        self._target = ()    # (the target's embedding, lm_head): not submodules, so not the head's parameters

    @property
    def kv_cache_shape(self) -> tuple[int, int, int]:
        a = self.layers[0].self_attn
        return 1, a.num_kv_heads, a.head_dim

    def attach_target(self, embed: VocabParallelEmbedding, lm_head: VocabParallelEmbedding) -> None:
        self._target = (embed, lm_head)

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        return (self.embed_tokens or self._target[0])(ids)

    def combine(self, aux: torch.Tensor) -> torch.Tensor:
        """EAGLE-3: the target's three auxiliary streams [T, 3H] -> h [T, H]."""
        return self.fc(aux)

    def forward(self, ids: torch.Tensor, positions: torch.Tensor, hidden: torch.Tensor, kv_cache: KVCache,
                meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        embeds = self.embed(ids)
        if self.eagle3:
            out, residual = self.layers[0](positions, embeds, hidden, kv_cache, meta)
            return self.norm(out, residual)          # (normed: the lm_head's, pre-norm: the next h)
        if self.hc.para_norms:
            embeds, hidden = self.embedding_layernorm(embeds), self.hidden_states_layernorm(hidden)
        out, residual = self.layers[0](positions, None, self.fc(torch.cat((embeds, hidden), dim=-1)), kv_cache, meta)
        out = out + residual
        return out, out

    def draft_tokens(self, rows: torch.Tensor) -> torch.Tensor:
        """Greedy drafts (target ids) from the rows forward() gave for the lm_head."""
        if not self.eagle3:
            return self._target[1].logits(rows).argmax(dim=-1)
        best = self.lm_head.logits(rows)[:, :self.hc.draft_vocab_size].argmax(dim=-1)
        return best + self.d2t[best]

    # ------------------------------------------------------------ checkpoint names
    def hf_to_loom(self, name: str) -> str | None:
        """EAGLE-3's `midlayer.` is layers.0; speculators' `fusion_fc` / `transformer.` /
        `pre_lm_head_layernorm` are fc / layers.0 / hidden_states_layernorm; an EAGLE-1
        checkpoint's embedding copy is the target's (skipped), and `t2d` is not needed."""
        for old, new in (("midlayer.", "layers.0."), ("transformer.", "layers.0."), ("fusion_fc.", "fc."),
                         ("pre_lm_head_layernorm.", "hidden_states_layernorm."), ("model.", "")):
            if name.startswith(old):
                name = new + name[len(old):]
        if name in ("t2d", "d2t") or "rotary_emb." in name:
            return None
        if not self.eagle3 and (name.startswith("embed_tokens.") or name.startswith("lm_head.")
                                or name == "layers.0.input_layernorm.weight"):
            return None
        return name


def load_eagle_head(model_dir: str, method: str, target: nn.Module, dtype: torch.dtype,
                    device: torch.device | str, load_format: str = "auto", max_positions: int = 0) -> EagleHead:
    """The head in model_dir (safetensors or pytorch_model.bin, the public layouts), on device
    in dtype, attached to the target's embedding and lm_head."""
    from workers.model_loader import _default_dtype, init_dummy_weights, iterate_checkpoint
    hc = read_head_config(model_dir, method)
    tcfg = target.config.get_text_config() if hasattr(target.config, "get_text_config") else target.config
    if method == "eagle3" and hc.target_hidden_size != tcfg.hidden_size or \
            method == "eagle" and hc.layer.hidden_size != tcfg.hidden_size:
        raise ValueError(f"EAGLE head {model_dir}: hidden size {hc.target_hidden_size} does not match the "
                         f"target's {tcfg.hidden_size}")
    tensors = {} if load_format == "dummy" else dict(iterate_checkpoint(model_dir, device))
    own_embed = method == "eagle3" and any(n.endswith("embed_tokens.weight") for n in tensors)
    fc_bias = any(n.endswith("fc.bias") for n in tensors)
    if fc_bias != hc.fc_bias:
        hc = dataclasses.replace(hc, fc_bias=fc_bias)
    with torch.device(device), _default_dtype(dtype):
        head = EagleHead(hc, max_positions)
        if own_embed:
            head.embed_tokens = VocabParallelEmbedding(hc.layer.vocab_size, hc.layer.hidden_size)
    head = head.eval().requires_grad_(False)
    if load_format == "dummy":
        init_dummy_weights(head)
    else:
        d2t = tensors.get("d2t")
        if method == "eagle3" and d2t is not None:
            d2t = d2t[:] if not isinstance(d2t, torch.Tensor) else d2t
            head.d2t.copy_(d2t.to(torch.long))
        load_stacked_weights(head, ((head.hf_to_loom(n), t) for n, t in tensors.items()
                                    if head.hf_to_loom(n) is not None), head.stacked_params)
    inner = target_language_model(target)
    head.attach_target(inner.model.embed_tokens, inner.lm_head)
    return head


def target_language_model(target: nn.Module) -> nn.Module:
    """The causal LM inside the target (LLaVA's language_model; else the target itself)."""
    return getattr(target, "language_model", target)
