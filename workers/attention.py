"""Attention metadata for one step, and the attention layer that uses it.

The metadata follows vLLM's contract so that one varlen kernel serves prefill,
chunked prefill, prefix-cache hits and decode in the same batch.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
from torch import nn

from kernels.cascade_attention import CascadePrefix
from kernels.kv_quant import kv_scales_from_amax
from kernels.paged_attention import paged_attention_ref
from kernels.sdpa_attention import SdpaPlan, paged_attention_sdpa


@dataclass
class AttentionMetadata:
    query_start_loc: torch.Tensor  # int32 [B+1]: where each sequence's new tokens start
    seq_lens: torch.Tensor         # int32 [B]: full context, new tokens included
    block_table: torch.Tensor      # int32 [B, max_blocks]
    slot_mapping: torch.Tensor     # int64 [T]: cache slot of each new token (-1 = padding)
    max_query_len: int             # the largest single query, not a sum
    max_seq_len: int
    backend: str = "torch"         # "torch" (SDPA on CPU, the reference elsewhere) or "triton"
    num_decodes: int = 0           # leading sequences with one query token (a tiling hint)
    num_kv_splits: int | None = None  # split-KV for decode (None: chosen per launch)
    sdpa_plan: SdpaPlan | None = None  # the CPU path's layout of the step, built by its first layer
    seq_order: torch.Tensor | None = None  # int32 [num_decodes]: the decodes, longest context first
    # while a piecewise CUDA graph is captured: called in attention's place, it ends the graph's
    # current piece and returns the buffer attention will write at replay (workers/piecewise_graphs.py)
    graph_split: Callable | None = None
    # --calculate-kv-scales: this step (the first with tokens, run eagerly) sets each layer's scales
    calculate_kv_scales: bool = False
    # cascade attention: the step's common prefix, read once for every query (workers/cascade_attn.py)
    cascade: CascadePrefix | None = None


class Attention(nn.Module):
    """Attention of this step's queries over the paged cache (which already holds
    this step's keys and values: see layers.qk_norm_rope_cache)."""

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float, *,
                 sliding_window: int | None = None, logits_soft_cap: float | None = None,
                 sinks: nn.Parameter | None = None):
        """sliding_window: a query sees only the last `sliding_window` keys, its own included (HF's
        convention); logits_soft_cap: scores become cap * tanh(scores / cap) before the softmax;
        sinks [num_heads] (gpt-oss): each head's learned logit joins the softmax's denominator (a
        parameter the model loads: this module owns it, so it is read at call time)."""
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.scale = scale
        self.sliding_window = int(sliding_window) if sliding_window else None
        self.logits_soft_cap = float(logits_soft_cap) if logits_soft_cap else None
        if sinks is not None and tuple(sinks.shape) != (num_heads,):
            raise ValueError(f"Attention: sinks of shape {tuple(sinks.shape)}, expected ({num_heads},)")
        self.sinks = sinks
        # an FP8 cache's per-tensor scales (kernels/kv_quant.py): device tensors, which kernels
        # read (so CUDA graphs replay with the loaded or calculated values); not in the state
        # dict, so sleep, wake-up and weight updates leave them as they are
        self.register_buffer("k_scale", torch.ones(1, dtype=torch.float32), persistent=False)
        self.register_buffer("v_scale", torch.ones(1, dtype=torch.float32), persistent=False)

    def calculate_kv_scales(self, k: torch.Tensor, v: torch.Tensor) -> None:
        """--calculate-kv-scales: the scales from this batch's keys (as the cache gets them:
        normed and rotated) and values, in place, on the device."""
        k_scale, v_scale = kv_scales_from_amax(k.abs().amax(), v.abs().amax())
        self.k_scale.copy_(k_scale.reshape(1))
        self.v_scale.copy_(v_scale.reshape(1))

    def forward(self, q: torch.Tensor, kv_cache: tuple[torch.Tensor, torch.Tensor],
                meta: AttentionMetadata, out: torch.Tensor | None = None) -> torch.Tensor:
        """q [T, Hq, D] -> [T, Hq * D] (written into `out` [T, Hq, D] when given)."""
        if meta.graph_split is not None:
            return meta.graph_split(self, q, kv_cache)
        t = q.shape[0]
        key_cache, value_cache = kv_cache
        if meta.backend == "triton" and meta.cascade is not None and self.sliding_window is None \
                and self.sinks is None:
            from kernels.cascade_attention import cascade_attention
            out = cascade_attention(q, key_cache, value_cache, meta.query_start_loc, meta.seq_lens, meta.block_table,
                                    self.scale, meta.max_query_len, meta.cascade, num_decodes=meta.num_decodes,
                                    seq_order=meta.seq_order, out=out, logits_soft_cap=self.logits_soft_cap,
                                    k_scale=self.k_scale, v_scale=self.v_scale)
        elif meta.backend == "triton":
            from kernels.paged_attention import paged_attention
            out = paged_attention(q, key_cache, value_cache, meta.query_start_loc, meta.seq_lens,
                                  meta.block_table, self.scale, meta.max_query_len, meta.max_seq_len,
                                  num_decodes=meta.num_decodes, num_kv_splits=meta.num_kv_splits,
                                  seq_order=meta.seq_order, out=out, sliding_window=self.sliding_window,
                                  logits_soft_cap=self.logits_soft_cap, sinks=self.sinks,
                                  k_scale=self.k_scale, v_scale=self.v_scale)
        elif q.device.type == "cpu":  # torch's fused CPU attention kernels
            if meta.sdpa_plan is None:  # once per step: every layer shares it
                meta.sdpa_plan = SdpaPlan.build(meta.query_start_loc, meta.seq_lens, meta.block_table,
                                                key_cache.shape[1], key_cache.shape[2], q.dtype)
            res = paged_attention_sdpa(q, key_cache, value_cache, meta.query_start_loc, meta.seq_lens,
                                       meta.block_table, self.scale, meta.sdpa_plan, self.sliding_window,
                                       self.logits_soft_cap, self.sinks, self.k_scale, self.v_scale)
            out = res if out is None else out.copy_(res.view_as(out))
        else:
            res = paged_attention_ref(q, key_cache, value_cache, meta.query_start_loc, meta.seq_lens,
                                      meta.block_table, self.scale, self.sliding_window, self.logits_soft_cap,
                                      self.sinks, self.k_scale, self.v_scale)
            out = res if out is None else out.copy_(res)
        return out.reshape(t, self.num_heads * self.head_dim)


def model_sliding_window(model: nn.Module) -> int | None:
    """The window every Attention layer of `model` attends within, when they all share one;
    None when any layer is global (it reads every block), the windows differ, or there is none."""
    windows = {m.sliding_window for m in model.modules() if isinstance(m, Attention)}
    return windows.pop() if len(windows) == 1 else None
