"""Paged attention through torch's fused scaled_dot_product_attention: the CPU path.

Same contract as kernels/paged_attention.py (varlen queries, each the last q_len of
its sequence's seq_len tokens, keys and values in the paged caches). The decode
rows go in one batched SDPA call (keys padded to the longest, a padding mask), each
sequence with several queries in one call of its own (causal, offset when it
continues a cached prefix). GQA heads are shared in the kernel (enable_gqa), not
copied. On CPU, SDPA runs one fused, multi-threaded kernel where the reference
(paged_attention_ref) runs einsum, mask, softmax and einsum as separate ops.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F


def paged_attention_sdpa(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                         query_start_loc: torch.Tensor, seq_lens: torch.Tensor, block_table: torch.Tensor,
                         scale: float) -> torch.Tensor:
    """query [T, Hq, D] -> [T, Hq, D]."""
    out = torch.empty_like(query)
    qsl, lens = query_start_loc.tolist(), seq_lens.tolist()
    decode = [i for i in range(len(lens)) if qsl[i + 1] - qsl[i] == 1]
    if decode:
        _decode(out, query, key_cache, value_cache, qsl, lens, block_table, scale, decode)
    block_size = key_cache.shape[1]
    for i, seq_len in enumerate(lens):
        q_lo, q_hi = qsl[i], qsl[i + 1]
        q_len = q_hi - q_lo
        if q_len <= 1:
            continue
        blocks = block_table[i, :-(-seq_len // block_size)].long()
        k = key_cache[blocks].flatten(0, 1)[:seq_len].transpose(0, 1)   # [Hkv, S, D]
        v = value_cache[blocks].flatten(0, 1)[:seq_len].transpose(0, 1)
        q = query[q_lo:q_hi].transpose(0, 1)                            # [Hq, Q, D]
        mask = None
        if q_len != seq_len:  # queries at positions seq_len - q_len ... seq_len - 1 see keys up to theirs
            pos = torch.arange(seq_len, device=query.device)
            mask = pos[None, :] <= pos[seq_len - q_len:, None]
        o = F.scaled_dot_product_attention(q, k.to(q.dtype), v.to(q.dtype), attn_mask=mask, scale=scale,
                                           is_causal=mask is None, enable_gqa=True)
        out[q_lo:q_hi] = o.transpose(0, 1)
    return out


def _decode(out, query, key_cache, value_cache, qsl, lens, block_table, scale, rows: list[int]):
    num_blocks, block_size = key_cache.shape[:2]
    idx = torch.tensor(rows, device=query.device)
    row_lens = torch.tensor([lens[i] for i in rows], device=query.device)
    max_len = max(lens[i] for i in rows)
    blocks = block_table[idx, :-(-max_len // block_size)].long().clamp(0, num_blocks - 1)
    k = key_cache[blocks].flatten(1, 2)[:, :max_len]                      # [B, S, Hkv, D]
    v = value_cache[blocks].flatten(1, 2)[:, :max_len]
    valid = torch.arange(max_len, device=query.device)[None, :] < row_lens[:, None]   # [B, S]
    if not bool(valid.all()):  # slots past a row's length may hold NaN: zero them (NaN * 0 is NaN)
        k = k.masked_fill(~valid[:, :, None, None], 0.0)
        v = v.masked_fill(~valid[:, :, None, None], 0.0)
    tok = torch.tensor([qsl[i] for i in rows], device=query.device)
    q = query[tok].unsqueeze(2)                                         # [B, Hq, 1, D]
    o = F.scaled_dot_product_attention(q, k.transpose(1, 2).to(q.dtype), v.transpose(1, 2).to(q.dtype),
                                       attn_mask=valid[:, None, None, :], scale=scale, enable_gqa=True)
    out[tok] = o.squeeze(2)
