"""Paged attention through torch's fused scaled_dot_product_attention: the CPU path.

Same contract as kernels/paged_attention.py (varlen queries, each the last q_len of
its sequence's seq_len tokens, keys and values in the paged caches). The decode
rows go in one batched SDPA call (keys padded to the longest, an additive mask),
each sequence with several queries in one call of its own (causal, offset when it
continues a cached prefix). GQA heads are shared in the kernel (enable_gqa), not
copied. On CPU, SDPA runs one fused kernel where the reference
(paged_attention_ref) runs einsum, mask, softmax and einsum as separate ops.

What every layer of a step shares (which rows decode, where their keys are, the
padding mask) is an `SdpaPlan`, built once per step (the model runner puts it in
the attention metadata), not once per layer.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass
class SdpaPlan:
    """The step's attention layout, the same for every layer.

    Decodes: each decode row's keys are gathered, one index_select per cache, from
    the cache viewed as [slots * Hkv, D] straight into [rows, Hkv, S, D] (S = the
    longest row), the layout SDPA reads. A position past a row's length gathers the
    row's first token instead (written, so finite: an unwritten slot may hold NaN,
    and NaN * 0 is NaN) and the additive mask gives it no weight."""
    qsl: list[int]
    lens: list[int]
    decode_tok: torch.Tensor | None     # [R]: each decode row's query token
    decode_gather: torch.Tensor | None  # [R * Hkv * S]: rows of the cache viewed as [slots * Hkv, D]
    decode_bias: torch.Tensor | None    # [R, 1, 1, S]: 0 within the row's length, -inf past it
    max_len: int
    prefills: list[tuple[int, int, torch.Tensor]]  # (first query token, query tokens, cache slots) per sequence

    @classmethod
    def build(cls, query_start_loc: torch.Tensor, seq_lens: torch.Tensor, block_table: torch.Tensor,
              block_size: int, num_kv_heads: int, dtype: torch.dtype) -> "SdpaPlan":
        qsl, lens = query_start_loc.tolist(), seq_lens.tolist()
        dev = block_table.device
        decode = [i for i in range(len(lens)) if qsl[i + 1] - qsl[i] == 1]
        tok = gather = bias = None
        max_len = 0
        if decode:
            idx = torch.tensor(decode, device=dev)
            row_lens = seq_lens.long().index_select(0, idx)
            max_len = max(lens[i] for i in decode)
            pos = torch.arange(max_len, device=dev)
            valid = pos[None, :] < row_lens[:, None]                                  # [R, S]
            pos = torch.where(valid, pos[None, :], 0)
            slots = block_table.index_select(0, idx).long().gather(1, pos // block_size) * block_size + pos % block_size
            heads = torch.arange(num_kv_heads, device=dev)
            gather = (slots[:, None, :] * num_kv_heads + heads[None, :, None]).flatten()  # [R, Hkv, S]
            bias = torch.zeros(valid.shape, dtype=dtype, device=dev).masked_fill_(~valid, float("-inf"))[:, None, None]
            tok = torch.tensor([qsl[i] for i in decode], device=dev)
        prefills = []
        for i, seq_len in enumerate(lens):
            if qsl[i + 1] - qsl[i] > 1:
                pos = torch.arange(seq_len, device=dev)
                slots = block_table[i].long().index_select(0, pos // block_size) * block_size + pos % block_size
                prefills.append((i, qsl[i + 1] - qsl[i], slots))
        return cls(qsl, lens, tok, gather, bias, max_len, prefills)


def paged_attention_sdpa(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                         query_start_loc: torch.Tensor, seq_lens: torch.Tensor, block_table: torch.Tensor,
                         scale: float, plan: SdpaPlan | None = None) -> torch.Tensor:
    """query [T, Hq, D] -> [T, Hq, D]. `plan`: the step's SdpaPlan (built here when None)."""
    _, block_size, num_kv_heads, head_dim = key_cache.shape
    if plan is None:
        plan = SdpaPlan.build(query_start_loc, seq_lens, block_table, block_size, num_kv_heads, query.dtype)
    out = torch.empty_like(query)
    keys, values = key_cache.view(-1, head_dim), value_cache.view(-1, head_dim)
    if plan.decode_tok is not None:
        rows = plan.decode_tok.shape[0]
        k = keys.index_select(0, plan.decode_gather).view(rows, num_kv_heads, plan.max_len, head_dim)
        v = values.index_select(0, plan.decode_gather).view(rows, num_kv_heads, plan.max_len, head_dim)
        q = query.index_select(0, plan.decode_tok).unsqueeze(2)                 # [R, Hq, 1, D]
        o = F.scaled_dot_product_attention(q, k.to(q.dtype), v.to(q.dtype), attn_mask=plan.decode_bias.to(q.dtype),
                                           scale=scale, enable_gqa=True)
        out.index_copy_(0, plan.decode_tok, o.squeeze(2))
    cache_rows = key_cache.view(-1, num_kv_heads, head_dim)
    vcache_rows = value_cache.view(-1, num_kv_heads, head_dim)
    for i, q_len, slots in plan.prefills:
        seq_len, q_lo = plan.lens[i], plan.qsl[i]
        k = cache_rows.index_select(0, slots).transpose(0, 1)                    # [Hkv, S, D]
        v = vcache_rows.index_select(0, slots).transpose(0, 1)
        q = query[q_lo:q_lo + q_len].transpose(0, 1)                              # [Hq, Q, D]
        mask = None
        if q_len != seq_len:  # queries at positions seq_len - q_len ... seq_len - 1 see keys up to theirs
            pos = torch.arange(seq_len, device=query.device)
            mask = pos[None, :] <= pos[seq_len - q_len:, None]
        o = F.scaled_dot_product_attention(q, k.to(q.dtype), v.to(q.dtype), attn_mask=mask, scale=scale,
                                           is_causal=mask is None, enable_gqa=True)
        out[q_lo:q_lo + q_len] = o.transpose(0, 1)
    return out
