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
the attention metadata), not once per layer; a sliding window's layout is built
by the first layer with that window and kept on the plan for the others.

A soft-capped layer (Gemma 2) or one with attention sinks (gpt-oss) cannot go through SDPA,
which has no hook between the scores and the softmax: it runs scores, cap, mask, softmax (the
sink in its denominator) by hand on the same layout.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from kernels.kv_quant import FP8_DTYPE
from kernels.paged_attention import soft_cap, softmax_with_sinks


@dataclass
class DecodeLayout:
    """Where the decode rows' keys are, for one window (or none).

    Each decode row's keys are gathered, one index_select per cache, from the cache
    viewed as [slots * Hkv, D] straight into [rows, Hkv, S, D] (S = the most keys a row
    sees), the layout SDPA reads. A position a row does not see gathers the row's first
    visible key instead (written, so finite: an unwritten slot may hold NaN, and NaN * 0
    is NaN) and the additive mask gives it no weight. With a window, a row gathers only
    its last `window` positions: a trimmed cache has freed the blocks before them."""
    tok: torch.Tensor     # [R]: each decode row's query token
    gather: torch.Tensor  # [R * Hkv * S]: rows of the cache viewed as [slots * Hkv, D]
    bias: torch.Tensor    # [R, 1, 1, S]: 0 where the row sees the key, -inf elsewhere
    width: int            # S


@dataclass
class PrefillLayout:
    """One sequence with several queries: its keys from the first one any query sees."""
    seq: int
    q_len: int
    slots: torch.Tensor             # [S]: cache slots of its keys
    mask: torch.Tensor | None       # [Q, S] bool (True: seen), None: plain causal (q_len == S)


@dataclass
class SdpaPlan:
    """The step's attention layout, the same for every layer (per window)."""
    qsl: list[int]
    lens: list[int]
    block_table: torch.Tensor
    block_size: int
    num_kv_heads: int
    dtype: torch.dtype
    # window (None: full attention) -> layouts, built by the first layer that needs them
    decodes: dict[int | None, DecodeLayout | None] = field(default_factory=dict)
    prefills: dict[int | None, list[PrefillLayout]] = field(default_factory=dict)

    @classmethod
    def build(cls, query_start_loc: torch.Tensor, seq_lens: torch.Tensor, block_table: torch.Tensor,
              block_size: int, num_kv_heads: int, dtype: torch.dtype) -> "SdpaPlan":
        return cls(query_start_loc.tolist(), seq_lens.tolist(), block_table, block_size, num_kv_heads, dtype)

    def decode_layout(self, window: int | None) -> DecodeLayout | None:
        if window not in self.decodes:
            self.decodes[window] = self._decode_layout(window)
        return self.decodes[window]

    def prefill_layouts(self, window: int | None) -> list[PrefillLayout]:
        if window not in self.prefills:
            self.prefills[window] = self._prefill_layouts(window)
        return self.prefills[window]

    def _first_key(self, seq_len: int, q_len: int, window: int | None) -> int:
        """The first key position any of a sequence's queries sees."""
        return 0 if window is None else max(0, seq_len - q_len - window + 1)

    def _slots(self, i: int, pos: torch.Tensor) -> torch.Tensor:
        return self.block_table[i].long().index_select(0, pos // self.block_size) * self.block_size \
            + pos % self.block_size

    def _decode_layout(self, window: int | None) -> DecodeLayout | None:
        qsl, lens, dev = self.qsl, self.lens, self.block_table.device
        decode = [i for i in range(len(lens)) if qsl[i + 1] - qsl[i] == 1]
        if not decode:
            return None
        idx = torch.tensor(decode, device=dev)
        row_lens = torch.tensor([lens[i] for i in decode], device=dev)
        first = torch.tensor([self._first_key(lens[i], 1, window) for i in decode], device=dev)
        width = int((row_lens - first).max())
        pos = first[:, None] + torch.arange(width, device=dev)[None, :]             # [R, S]
        valid = pos < row_lens[:, None]
        pos = torch.where(valid, pos, first[:, None])
        slots = (self.block_table.index_select(0, idx).long().gather(1, pos // self.block_size) * self.block_size
                 + pos % self.block_size)
        heads = torch.arange(self.num_kv_heads, device=dev)
        gather = (slots[:, None, :] * self.num_kv_heads + heads[None, :, None]).flatten()  # [R, Hkv, S]
        bias = torch.zeros(valid.shape, dtype=self.dtype, device=dev).masked_fill_(~valid, float("-inf"))
        tok = torch.tensor([qsl[i] for i in decode], device=dev)
        return DecodeLayout(tok, gather, bias[:, None, None], width)

    def _prefill_layouts(self, window: int | None) -> list[PrefillLayout]:
        dev = self.block_table.device
        out = []
        for i, seq_len in enumerate(self.lens):
            q_len = self.qsl[i + 1] - self.qsl[i]
            if q_len <= 1:
                continue
            first = self._first_key(seq_len, q_len, window)
            k_pos = torch.arange(first, seq_len, device=dev)
            mask = None
            if q_len != seq_len - first:  # queries at seq_len - q_len ... seq_len - 1 see keys up to theirs
                q_pos = k_pos[seq_len - q_len - first:, None]
                mask = k_pos[None, :] <= q_pos
                if window is not None:
                    mask &= k_pos[None, :] > q_pos - window
            elif window is not None and q_len > window:  # a whole prompt longer than the window
                mask = (k_pos[None, :] <= k_pos[:, None]) & (k_pos[None, :] > k_pos[:, None] - window)
            out.append(PrefillLayout(i, q_len, self._slots(i, k_pos), mask))
        return out


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, scale: float,
            cap: float | None, sinks: torch.Tensor | None = None) -> torch.Tensor:
    """softmax(q k^T * scale [+ mask]) v over [..., H, L, D] (GQA: k, v have fewer heads).
    mask: bool (True: seen) or additive; None: causal. A soft cap or sinks [H] go by hand: SDPA
    has no hook between the scores and the softmax."""
    if cap is None and sinks is None:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, is_causal=mask is None,
                                              enable_gqa=True)
    group = q.shape[-3] // k.shape[-3]
    k, v = k.repeat_interleave(group, dim=-3), v.repeat_interleave(group, dim=-3)
    scores = soft_cap(torch.matmul(q.float(), k.float().transpose(-1, -2)) * scale, cap)
    if mask is None:
        mask = torch.ones(scores.shape[-2:], dtype=torch.bool, device=q.device).tril_()
    if mask.dtype == torch.bool:
        scores = scores.masked_fill(~mask, float("-inf"))
    else:
        scores = scores + mask
    probs = softmax_with_sinks(scores, None if sinks is None else sinks.view(-1, 1, 1))
    return torch.matmul(probs, v.float()).to(q.dtype)


def paged_attention_sdpa(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                         query_start_loc: torch.Tensor, seq_lens: torch.Tensor, block_table: torch.Tensor,
                         scale: float, plan: SdpaPlan | None = None, sliding_window: int | None = None,
                         logits_soft_cap: float | None = None, sinks: torch.Tensor | None = None,
                         k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None) -> torch.Tensor:
    """query [T, Hq, D] -> [T, Hq, D]. `plan`: the step's SdpaPlan (built here when None).
    sliding_window, logits_soft_cap, sinks, k_scale, v_scale: as paged_attention_ref's. An FP8
    cache's codes are widened to the query's dtype (exact); k_scale folds into the score scale
    and v_scale into the output (exact: both are linear), read on the host (this is the CPU path)."""
    _, block_size, num_kv_heads, head_dim = key_cache.shape
    out_scale = None
    if key_cache.dtype == FP8_DTYPE:
        scale = scale * (1.0 if k_scale is None else float(k_scale))
        out_scale = None if v_scale is None else float(v_scale)
    if plan is None:
        plan = SdpaPlan.build(query_start_loc, seq_lens, block_table, block_size, num_kv_heads, query.dtype)
    out = torch.empty_like(query)
    keys, values = key_cache.view(-1, head_dim), value_cache.view(-1, head_dim)
    dec = plan.decode_layout(sliding_window)
    if dec is not None:
        rows = dec.tok.shape[0]
        k = keys.index_select(0, dec.gather).view(rows, num_kv_heads, dec.width, head_dim)
        v = values.index_select(0, dec.gather).view(rows, num_kv_heads, dec.width, head_dim)
        q = query.index_select(0, dec.tok).unsqueeze(2)                 # [R, Hq, 1, D]
        o = _attend(q, k.to(q.dtype), v.to(q.dtype), dec.bias.to(q.dtype), scale, logits_soft_cap, sinks)
        if out_scale is not None:
            o = o * out_scale
        out.index_copy_(0, dec.tok, o.squeeze(2))
    cache_rows = key_cache.view(-1, num_kv_heads, head_dim)
    vcache_rows = value_cache.view(-1, num_kv_heads, head_dim)
    for p in plan.prefill_layouts(sliding_window):
        q_lo = plan.qsl[p.seq]
        k = cache_rows.index_select(0, p.slots).transpose(0, 1)                    # [Hkv, S, D]
        v = vcache_rows.index_select(0, p.slots).transpose(0, 1)
        q = query[q_lo:q_lo + p.q_len].transpose(0, 1)                              # [Hq, Q, D]
        o = _attend(q, k.to(q.dtype), v.to(q.dtype), p.mask, scale, logits_soft_cap, sinks)
        if out_scale is not None:
            o = o * out_scale
        out[q_lo:q_lo + p.q_len] = o.transpose(0, 1)
    return out
