"""Paged attention over block tables, and the KV-cache write.

KV cache layout, per layer: key_cache and value_cache, each
[num_blocks, block_size, num_kv_heads, head_dim]. A token at position p of a
sequence lives in block block_table[seq, p // block_size] at offset
p % block_size; `slot_mapping[t] = block * block_size + offset` for each new
token t of the step.

One varlen batch serves prefill, chunked prefill, prefix-cache hits and decode:
sequence i has queries q[query_start_loc[i]:query_start_loc[i+1]], which are the
*last* q_len tokens of its seq_lens[i] tokens of context (causal).
"""
from __future__ import annotations

import torch


def write_kv_cache_ref(key: torch.Tensor, value: torch.Tensor, key_cache: torch.Tensor,
                       value_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Scatter key/value [T, Hkv, D] into the paged caches at slot_mapping [T].

    Slots < 0 are padding and are skipped."""
    num_blocks, block_size, h, d = key_cache.shape
    valid = slot_mapping >= 0
    if not bool(valid.all()):
        key, value, slot_mapping = key[valid], value[valid], slot_mapping[valid]
    key_cache.view(num_blocks * block_size, h, d).index_copy_(0, slot_mapping.long(), key.to(key_cache.dtype))
    value_cache.view(num_blocks * block_size, h, d).index_copy_(0, slot_mapping.long(), value.to(value_cache.dtype))


def paged_attention_ref(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                        query_start_loc: torch.Tensor, seq_lens: torch.Tensor,
                        block_table: torch.Tensor, scale: float) -> torch.Tensor:
    """Causal attention of query [T, Hq, D] over the paged caches. Returns [T, Hq, D].

    Pure torch, one sequence at a time: the oracle for the Triton kernel and
    the CPU path of the model runner."""
    out = torch.empty_like(query)
    num_kv_heads = key_cache.shape[2]
    group = query.shape[1] // num_kv_heads
    block_size = key_cache.shape[1]
    qsl = query_start_loc.tolist()
    lens = seq_lens.tolist()
    for i, seq_len in enumerate(lens):
        q_lo, q_hi = qsl[i], qsl[i + 1]
        q_len = q_hi - q_lo
        if q_len == 0:
            continue
        n_blocks = (seq_len + block_size - 1) // block_size
        blocks = block_table[i, :n_blocks].long()
        k = key_cache[blocks].flatten(0, 1)[:seq_len]  # [S, Hkv, D]
        v = value_cache[blocks].flatten(0, 1)[:seq_len]
        q = query[q_lo:q_hi].float()  # [Q, Hq, D]
        k = k.float().repeat_interleave(group, dim=1)
        v = v.float().repeat_interleave(group, dim=1)
        scores = torch.einsum("qhd,shd->hqs", q, k) * scale
        # query j sits at absolute position seq_len - q_len + j; it sees keys <= that.
        q_pos = torch.arange(seq_len - q_len, seq_len, device=query.device)
        k_pos = torch.arange(seq_len, device=query.device)
        mask = k_pos[None, :] > q_pos[:, None]
        scores.masked_fill_(mask[None], float("-inf"))
        probs = torch.softmax(scores, dim=-1)
        out[q_lo:q_hi] = torch.einsum("hqs,shd->qhd", probs, v).to(query.dtype)
    return out
