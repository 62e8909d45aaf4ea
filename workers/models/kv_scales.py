"""A checkpoint's FP8 KV-cache scales -> each attention layer's k_scale / v_scale
(workers/attention.py; used with --kv-cache-dtype fp8, kept but unused otherwise, as vLLM).

The names vLLM accepts (maybe_remap_kv_scale_name, and compressed-tensors' kv_cache_scheme):
  layers.N.self_attn.{k,v}_scale             (Quark, AutoRound, our own name less .attn)
  layers.N.self_attn.attn.{k,v}_scale        (vLLM's own)
  layers.N.self_attn.{k,v}_proj.{k,v}_scale  (ModelOpt)
  layers.N.self_attn.qkv_proj.{k,v}_scale
  layers.N.self_attn.{k,v}_proj.output_scale (compressed-tensors, llm-compressor)
  layers.N.self_attn.kv_scale                (deprecated: one scale for both)
A query or attention-probability scale (q_scale, q_proj.output_scale, prob_scale) is read and
dropped: the query stays in the model's dtype. A scale with several values (per head) is taken
at its largest, which keeps every head's values in range.
"""
from __future__ import annotations

import logging
import re

import torch
from torch import nn

logger = logging.getLogger(__name__)

_KV_SCALE = re.compile(r"layers\.(\d+)\.self_attn\.(?:attn\.|[kv]_proj\.|qkv_proj\.)?(k|v|kv|q|prob)_scale$")
_OUTPUT_SCALE = re.compile(r"layers\.(\d+)\.self_attn\.([kqv])_proj\.output_scale$")
_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.")


class KVScaleLoader:
    """Takes a checkpoint's KV-cache scales out of the weight stream into the Attention layers."""

    def __init__(self, model: nn.Module):
        from workers.attention import Attention
        self.layers: dict[int, Attention] = {}
        for name, module in model.named_modules():
            m = _LAYER.search(name + ".")
            if isinstance(module, Attention) and m:
                self.layers[int(m.group(1))] = module
        self.loaded = 0

    def take(self, name: str, tensor) -> bool:
        """Whether `name` is a KV-cache scale (then loaded, or dropped: a query scale)."""
        m = _KV_SCALE.search(name) or _OUTPUT_SCALE.search(name)
        if m is None:
            return False
        layer, which = int(m.group(1)), m.group(2)
        if which in ("q", "prob"):
            return True
        attn = self.layers.get(layer)
        if attn is None:   # (the generic path makes its attention layers at the first forward)
            logger.warning("checkpoint KV-cache scale %s: no attention layer %d to take it; scale 1.0", name, layer)
            return True
        value = tensor if isinstance(tensor, torch.Tensor) else tensor[...]
        value = value.detach().float().amax().reshape(1)
        if not bool(value > 0) or not bool(torch.isfinite(value)):
            raise ValueError(f"checkpoint KV-cache scale {name!r} is {value.item()}: it must be positive and finite")
        for target in ((attn.k_scale, attn.v_scale) if which == "kv" else
                       (attn.k_scale,) if which == "k" else (attn.v_scale,)):
            target.copy_(value.to(target.device))
        self.loaded += 1
        return True
