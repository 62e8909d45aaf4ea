"""Paged attention over block tables (the KV-cache write is fused into the
attention prologue: kernels/qk_rope_cache.py).

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

import functools
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from typing import NamedTuple

import torch

from ipc import envs
from kernels.kv_quant import FP8_DTYPE, as_bytes, dequantize_ref, fp8_scales, to_cache_dtype


def write_kv_cache_ref(key: torch.Tensor, value: torch.Tensor, key_cache: torch.Tensor,
                       value_cache: torch.Tensor, slot_mapping: torch.Tensor,
                       k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None) -> None:
    """Scatter key/value [T, Hkv, D] into the paged caches at slot_mapping [T].

    Slots < 0 are padding and are skipped. An FP8 cache stores key / k_scale and value / v_scale
    as e4m3, saturated (kernels/kv_quant.py)."""
    num_blocks, block_size, h, d = key_cache.shape
    valid = slot_mapping >= 0
    if not bool(valid.all()):
        key, value, slot_mapping = key[valid], value[valid], slot_mapping[valid]
    for x, cache, x_scale in ((key, key_cache, k_scale), (value, value_cache, v_scale)):
        as_bytes(cache).view(num_blocks * block_size, h, d).index_copy_(
            0, slot_mapping.long(), as_bytes(to_cache_dtype(x, cache, x_scale)))


def paged_attention_ref(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                        query_start_loc: torch.Tensor, seq_lens: torch.Tensor,
                        block_table: torch.Tensor, scale: float, sliding_window: int | None = None,
                        logits_soft_cap: float | None = None, sinks: torch.Tensor | None = None,
                        k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None) -> torch.Tensor:
    """Causal attention of query [T, Hq, D] over the paged caches. Returns [T, Hq, D].

    k_scale, v_scale: an FP8 cache's per-tensor scales (fp32 [1] tensors; None: 1.0): keys and
    values are read as code * scale, in fp32.

    sliding_window: a query at position p sees keys p - sliding_window < k <= p (HF's
    convention), and no block before its window's is read (a trimmed cache may have freed
    them). logits_soft_cap: scores = cap * tanh(scores / cap), after the scale, before the mask.
    sinks [Hq] (gpt-oss): each head's learned logit joins the softmax's denominator as one more
    key with no value (HF's `sinks`: the probabilities of the real keys sum to less than 1).

    Pure torch: the oracle for the Triton kernel and the CPU path of the model
    runner. Sequences with one query (decode) go in one batched product, the
    others one at a time."""
    out = torch.empty_like(query)
    q_lens = (query_start_loc[1:] - query_start_loc[:-1]).tolist()
    decode = [i for i, n in enumerate(q_lens) if n == 1]
    if decode:
        _decode_ref(out, query, key_cache, value_cache, query_start_loc, seq_lens, block_table, scale, decode,
                    sliding_window, logits_soft_cap, sinks, k_scale, v_scale)
    for i, q_len in enumerate(q_lens):
        if q_len > 1:
            _sequence_ref(out, query, key_cache, value_cache, query_start_loc, seq_lens, block_table, scale, i,
                          sliding_window, logits_soft_cap, sinks, k_scale, v_scale)
    return out


def softmax_with_sinks(scores: torch.Tensor, sinks: torch.Tensor | None) -> torch.Tensor:
    """softmax over the last dim of scores, each row's sink (broadcast to scores[..., :1]) one
    more logit in it whose probability is dropped (HF gpt-oss: softmax(cat(scores, sink))[:-1]).
    A row that sees no key gives all its weight to the sink: zeros, where plain softmax is NaN."""
    if sinks is None:
        return torch.softmax(scores, dim=-1)
    sink = sinks.float().expand(*scores.shape[:-1], 1)
    return torch.softmax(torch.cat([scores, sink], dim=-1), dim=-1)[..., :-1]


def soft_cap(scores: torch.Tensor, cap: float | None) -> torch.Tensor:
    """Gemma 2's attention logit soft-capping: cap * tanh(scores / cap) (None: unchanged)."""
    return scores if cap is None else torch.tanh(scores / cap) * cap


def _sequence_ref(out, query, key_cache, value_cache, query_start_loc, seq_lens, block_table, scale, i: int,
                  sliding_window: int | None = None, logits_soft_cap: float | None = None,
                  sinks: torch.Tensor | None = None, k_scale: torch.Tensor | None = None,
                  v_scale: torch.Tensor | None = None):
    """Sequence i's queries, which are the last q_len of its seq_len tokens."""
    _, block_size, num_kv_heads, head_dim = key_cache.shape
    q_lo, q_hi = int(query_start_loc[i]), int(query_start_loc[i + 1])
    q_len, seq_len = q_hi - q_lo, int(seq_lens[i])
    # the first key any query sees (its first query's window), from the start of its block
    first = 0 if sliding_window is None else max(0, seq_len - q_len - sliding_window + 1) // block_size * block_size
    blocks = block_table[i, first // block_size:(seq_len + block_size - 1) // block_size].long()
    k = dequantize_ref(key_cache[blocks].flatten(0, 1)[:seq_len - first], k_scale)  # [S, Hkv, D]
    v = dequantize_ref(value_cache[blocks].flatten(0, 1)[:seq_len - first], v_scale)
    q = query[q_lo:q_hi].float().view(q_len, num_kv_heads, -1, head_dim)  # [Q, Hkv, group, D]
    scores = soft_cap(torch.einsum("qkgd,skd->kgqs", q, k) * scale, logits_soft_cap)
    # query j sits at absolute position seq_len - q_len + j; it sees keys <= that.
    q_pos = torch.arange(seq_len - q_len, seq_len, device=query.device)
    k_pos = torch.arange(first, seq_len, device=query.device)
    hidden = k_pos[None, :] > q_pos[:, None]
    if sliding_window is not None:
        hidden |= k_pos[None, :] <= q_pos[:, None] - sliding_window
    scores.masked_fill_(hidden, float("-inf"))
    probs = softmax_with_sinks(scores, None if sinks is None else sinks.view(num_kv_heads, -1, 1, 1))
    out[q_lo:q_hi] = torch.einsum("kgqs,skd->qkgd", probs, v).flatten(1, 2).to(query.dtype)


def _decode_ref(out, query, key_cache, value_cache, query_start_loc, seq_lens, block_table, scale,
                rows: list[int], sliding_window: int | None = None, logits_soft_cap: float | None = None,
                sinks: torch.Tensor | None = None, k_scale: torch.Tensor | None = None,
                v_scale: torch.Tensor | None = None):
    """The sequences `rows`, each with one query that sees all its tokens (the last
    sliding_window of them), padded to the longest."""
    num_blocks, block_size, num_kv_heads, head_dim = key_cache.shape
    idx = torch.tensor(rows, device=query.device)
    lens = seq_lens[idx].long()                                   # [B]
    max_len = int(lens.max())
    blocks = block_table[idx, :(max_len + block_size - 1) // block_size].long().clamp(0, num_blocks - 1)
    k = dequantize_ref(key_cache[blocks].flatten(1, 2)[:, :max_len], k_scale)  # [B, S, Hkv, D]; past a length: masked
    v = dequantize_ref(value_cache[blocks].flatten(1, 2)[:, :max_len], v_scale)
    tok = query_start_loc[idx].long()
    q = query[tok].float().view(len(rows), num_kv_heads, -1, head_dim)   # [B, Hkv, group, D]
    pos = torch.arange(max_len, device=query.device)[None, :]
    pad = pos >= lens[:, None]   # [B, S]
    if sliding_window is not None:   # (blocks before the window are read but get no weight)
        pad |= pos <= lens[:, None] - 1 - sliding_window
        k.masked_fill_(pad[:, :, None, None], 0.0)   # a trimmed cache's freed blocks may hold anything
    scores = soft_cap(torch.einsum("bkgd,bskd->bkgs", q, k) * scale, logits_soft_cap)
    scores.masked_fill_(pad[:, None, None, :], float("-inf"))
    v.masked_fill_(pad[:, :, None, None], 0.0)   # unwritten slots may hold NaN, and 0 * NaN is NaN
    probs = softmax_with_sinks(scores, None if sinks is None else sinks.view(1, num_kv_heads, -1, 1))
    out[tok] = torch.einsum("bkgs,bskd->bkgd", probs, v).flatten(1, 2).to(query.dtype)


# --------------------------------------------------------------------------
# Triton implementations
# --------------------------------------------------------------------------
import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from kernels.jit import is_interpreted, pdl_args, pdl_wait, runs_triton, sm_count, step_jit  # noqa: E402


def _last_dim_contiguous(x: torch.Tensor) -> torch.Tensor:
    return x if x.stride(-1) == 1 else x.contiguous()


@triton.jit
def _attend_keys(q, m_i, l_i, acc, start, kv_hi, q_pos, offs_m, window, qk_scale, soft_cap, bt_row, k_head,
                 v_head, offs_d, d_ok, stride_kb, stride_ks, stride_vb, stride_vs,
                 BLOCK_N: tl.constexpr, BLOCK_SIZE: tl.constexpr, MASKED: tl.constexpr, CAUSAL: tl.constexpr,
                 IEEE: tl.constexpr, DOT_F32: tl.constexpr, HAS_WINDOW: tl.constexpr, HAS_SOFTCAP: tl.constexpr,
                 KV_FP8: tl.constexpr):
    """One BLOCK_N tile of keys [start, start + BLOCK_N) into the online softmax (m_i, l_i, acc).
    MASKED=False: every key of the tile is below kv_hi and visible to every row (the causal
    split's mask-free part: no bounds, no causal or window test). CAUSAL=False (cascade's
    shared-prefix launch): every key below kv_hi is visible to every row, no causal test (the
    window's still applies)."""
    offs_n = start + tl.arange(0, BLOCK_N)
    n_ok = offs_n < kv_hi
    if MASKED:
        blk = tl.load(bt_row + offs_n // BLOCK_SIZE, mask=n_ok, other=0).to(tl.int64)
    else:
        blk = tl.load(bt_row + offs_n // BLOCK_SIZE).to(tl.int64)
    in_blk = offs_n % BLOCK_SIZE
    k_ptrs = k_head + blk[None, :] * stride_kb + in_blk[None, :] * stride_ks + offs_d[:, None]
    if MASKED:
        k = tl.load(k_ptrs, mask=n_ok[None, :] & d_ok[:, None], other=0.0)  # [BLOCK_D, BLOCK_N]
    else:
        k = tl.load(k_ptrs, mask=d_ok[:, None], other=0.0)
    if KV_FP8:
        k = k.to(q.dtype)
    if DOT_F32:
        k = k.to(tl.float32)
    if IEEE:
        s = tl.dot(q, k, input_precision="ieee")
    else:
        s = tl.dot(q, k)
    s = s * qk_scale
    if HAS_SOFTCAP:  # tanh(x) = 1 - 2 / (e^2x + 1): -1 and 1 at the extremes, never NaN
        s = (1.0 - 2.0 / (tl.exp2(s * 2.8853900817779268) + 1.0)) * soft_cap
    if MASKED:
        if CAUSAL:
            visible = (offs_n[None, :] <= q_pos[:, None]) & n_ok[None, :]
        else:
            visible = n_ok[None, :] & (offs_m[:, None] >= 0)
        if HAS_WINDOW:
            visible = visible & (offs_n[None, :] > q_pos[:, None] - window)
        s = tl.where(visible, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(s - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    v_ptrs = v_head + blk[:, None] * stride_vb + in_blk[:, None] * stride_vs + offs_d[None, :]
    if MASKED:
        v = tl.load(v_ptrs, mask=n_ok[:, None] & d_ok[None, :], other=0.0)  # [BLOCK_N, BLOCK_D]
    else:
        v = tl.load(v_ptrs, mask=d_ok[None, :], other=0.0)
    if KV_FP8:  # (p then goes to the query's dtype, never to e4m3)
        v = v.to(q.dtype)
    if DOT_F32:
        p = p.to(v.dtype)
        v = v.to(tl.float32)
    if IEEE:
        pv = tl.dot(p.to(v.dtype), v, input_precision="ieee")
    else:
        pv = tl.dot(p.to(v.dtype), v)
    acc = acc * alpha[:, None] + pv
    return m_new, l_i, acc


@step_jit(ints=("num_seqs", "part_tok_base", "stride_bt", "window", "part_splits", "split_base"),
          pointers=("qsl_ptr", "seq_lens_ptr", "bt_ptr", "order_ptr", "sinks_ptr", "kv_begin_ptr"))
def _paged_attention_kernel(
    q_ptr, kc_ptr, vc_ptr, out_ptr,
    part_acc_ptr, part_ml_ptr,
    qsl_ptr, seq_lens_ptr, bt_ptr, order_ptr, sinks_ptr,
    k_scale_ptr, v_scale_ptr, kv_begin_ptr,
    qk_scale, num_seqs, num_q_heads, part_tok_base, window, soft_cap, part_splits, split_base,
    stride_qt, stride_qh, stride_ot, stride_oh,
    stride_kb, stride_ks, stride_kh,
    stride_vb, stride_vs, stride_vh,
    stride_bt,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    GROUP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_Q: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    NUM_SPLITS: tl.constexpr, ONE_TILE_PER_SEQ: tl.constexpr, ORDERED: tl.constexpr,
    IEEE: tl.constexpr, DOT_F32: tl.constexpr, PDL: tl.constexpr,
    HAS_WINDOW: tl.constexpr, HAS_SOFTCAP: tl.constexpr, HAS_SINKS: tl.constexpr,
    KV_FP8: tl.constexpr, CAUSAL_SPLIT: tl.constexpr, HEAVY_FIRST: tl.constexpr,
    CAUSAL: tl.constexpr = True, SUFFIX: tl.constexpr = False,
    PARTIAL: tl.constexpr = False,
):
    """One program = BLOCK_Q query tokens x the GROUP query heads of one KV head
    (BLOCK_M = BLOCK_Q * GROUP rows, padded), over one KV split.

    HAS_WINDOW: a row at position p sees keys p - window < k <= p, and the KV loop starts at
    the tile's first query's window, so no key before it is read (a trimmed cache's block
    table holds freed blocks there). HAS_SOFTCAP: qk_scale is scale / cap and soft_cap is
    cap * log2(e), scores = soft_cap * tanh(q.k * qk_scale). HAS_SINKS: each query head's
    sink logit (sinks_ptr [Hq], natural log) joins the softmax's denominator once: unsplit, it
    starts the running max and sum (a key of weight exp(sink) and no value); split, the
    reduce adds it to the splits' merge. Without any, full attention compiles as it always has.

    KV_FP8: the caches hold e4m3 codes of key / k_scale and value / v_scale. A tile's codes are
    widened to the query's dtype (exact: every e4m3 value is a bf16/fp16 value) and multiply in
    its MMA with an fp32 accumulator; k_scale folds into qk_scale and v_scale into the output,
    both exact as scores and output are linear in them. Two-level accumulation, as vLLM's fix
    for FP8 attention's long-context accuracy (vllm-project/flash-attention#104): each tile's
    P @ V comes out of the MMA as an fp32 partial and is added into a separate fp32 running
    accumulator (acc * alpha + pv), never accumulated across tiles in an FP8 MMA's
    reduced-precision accumulator (the fault on Hopper that cost 128k needle retrieval).

    Cascade attention (kernels/cascade_attention.py) launches it twice over one step's queries,
    PARTIAL, each writing partials at its own splits of one buffer of part_splits splits, from
    split_base on (ints, not constexprs: a variant per prefix split count, not per pair), which the split-KV reduce then merges by their log-sum-exps: CAUSAL=False,
    every query of the launch's one "sequence" against the whole shared prefix (a prefill-style
    launch: many queries, one KV sequence, no mask); SUFFIX, each sequence's own keys from
    kv_begin on (the shared prefix's length, read from kv_begin_ptr on the device, so a decode
    CUDA graph replays with each step's prefix). Off, both compile as they always have (no load).

    CAUSAL_SPLIT (long-prefill tiles; causal launches only): a tile's keys that every row sees run
    without the mask (_attend_keys MASKED=False), the diagonal's with it. HEAVY_FIRST: multi-tile
    launches start from their last (heaviest causal) tile."""
    pdl_wait(PDL)
    pid = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)

    if ORDERED:
        # decode, longest sequence first: program pid is KV head pid % H of the
        # (pid // H)-th longest sequence, so the GPU starts the longest work first
        num_kv_heads = num_q_heads // GROUP
        seq = tl.load(order_ptr + pid // num_kv_heads)
        kvh = pid % num_kv_heads
        tile = pid * 0
    elif ONE_TILE_PER_SEQ:
        seq = pid
        tile = pid * 0
    else:
        if HEAVY_FIRST:
            # causal tiles of a long prompt: the last ones see the most keys, so they start first and
            # the light ones fill the launch's tail
            pid = tl.num_programs(0) - 1 - pid
        # Tiles of sequence i are programs [qsl[i] // BLOCK_Q + i, qsl[i+1] // BLOCK_Q + i + 1);
        # binary search for the last i whose first tile is <= pid.
        lo = 0
        hi = num_seqs
        while lo < hi:
            mid = (lo + hi) // 2
            first = tl.load(qsl_ptr + mid) // BLOCK_Q + mid
            if first <= pid:
                lo = mid + 1
            else:
                hi = mid
        seq = lo - 1
        if seq < 0:  # (a launch over a slice of the batch: qsl[0] > 0)
            return
        tile = pid - (tl.load(qsl_ptr + seq) // BLOCK_Q + seq)

    q_start = tl.load(qsl_ptr + seq)
    q_len = tl.load(qsl_ptr + seq + 1) - q_start
    if tile * BLOCK_Q >= q_len:
        return
    seq_len = tl.load(seq_lens_ptr + seq)
    ctx_len = seq_len - q_len

    offs_m = tl.arange(0, BLOCK_M)
    q_idx = tile * BLOCK_Q + offs_m // GROUP  # query index inside this sequence
    head = kvh * GROUP + offs_m % GROUP
    row_ok = (offs_m // GROUP < BLOCK_Q) & (q_idx < q_len)
    q_pos = ctx_len + q_idx  # absolute position of each row's token
    tok = (q_start + q_idx).to(tl.int64)
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < HEAD_DIM

    q = tl.load(q_ptr + tok[:, None] * stride_qt + head[:, None] * stride_qh + offs_d[None, :],
                mask=row_ok[:, None] & d_ok[None, :], other=0.0)
    if DOT_F32:  # the interpreter's tl.dot mishandles bf16/fp16 operands
        q = q.to(tl.float32)
    if KV_FP8:
        qk_scale = qk_scale * tl.load(k_scale_ptr)

    # keys this tile can see: [0, kv_end) (causal w.r.t. the tile's last query)
    if CAUSAL:
        kv_end = tl.minimum(seq_len, ctx_len + tl.minimum(q_len, (tile + 1) * BLOCK_Q))
    else:
        kv_end = seq_len
    if HAS_WINDOW:
        # ... from the window of the tile's first query on: [kv_start, kv_end)
        kv_start = tl.maximum(ctx_len + tile * BLOCK_Q - window + 1, 0)
        if NUM_SPLITS > 1:
            chunk = tl.cdiv(tl.cdiv(kv_end - kv_start, NUM_SPLITS), BLOCK_N) * BLOCK_N
            kv_lo = kv_start + split * chunk
            kv_hi = tl.minimum(kv_end, kv_lo + chunk)
        else:
            kv_lo = kv_start
            kv_hi = kv_end
    elif SUFFIX and NUM_SPLITS > 1:
        kv_begin = tl.load(kv_begin_ptr)
        chunk = tl.cdiv(tl.cdiv(kv_end - kv_begin, NUM_SPLITS), BLOCK_N) * BLOCK_N
        kv_lo = kv_begin + split * chunk
        kv_hi = tl.minimum(kv_end, kv_lo + chunk)
    elif SUFFIX:
        kv_lo = kv_end * 0 + tl.load(kv_begin_ptr)
        kv_hi = kv_end
    elif NUM_SPLITS > 1:
        chunk = tl.cdiv(tl.cdiv(kv_end, NUM_SPLITS), BLOCK_N) * BLOCK_N
        kv_lo = split * chunk
        kv_hi = tl.minimum(kv_end, kv_lo + chunk)
    else:
        kv_lo = kv_end * 0
        kv_hi = kv_end

    if HAS_SINKS and NUM_SPLITS == 1:
        m_i = tl.load(sinks_ptr + head, mask=row_ok, other=0.0).to(tl.float32) * 1.4426950408889634
        l_i = tl.full([BLOCK_M], 1.0, dtype=tl.float32)
    else:
        m_i = tl.full([BLOCK_M], -1.0e30, dtype=tl.float32)
        l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    bt_row = bt_ptr + seq.to(tl.int64) * stride_bt
    k_head = kc_ptr + kvh.to(tl.int64) * stride_kh
    v_head = vc_ptr + kvh.to(tl.int64) * stride_vh

    kv_mid = kv_lo
    if CAUSAL_SPLIT and CAUSAL:
        # keys every row of the tile sees (below its first query's position + 1) run without the
        # causal mask, whole BLOCK_N tiles of them; the diagonal's few tiles then run masked
        seen_by_all = tl.minimum(kv_hi, ctx_len + tile * BLOCK_Q + 1)
        kv_mid = kv_lo + tl.maximum(seen_by_all - kv_lo, 0) // BLOCK_N * BLOCK_N
        for start in range(kv_lo, kv_mid, BLOCK_N):
            m_i, l_i, acc = _attend_keys(
                q, m_i, l_i, acc, start, kv_hi, q_pos, offs_m, window, qk_scale, soft_cap, bt_row, k_head,
                v_head, offs_d, d_ok, stride_kb, stride_ks, stride_vb, stride_vs,
                BLOCK_N, BLOCK_SIZE, False, CAUSAL, IEEE, DOT_F32, HAS_WINDOW, HAS_SOFTCAP, KV_FP8)
    for start in range(kv_mid, kv_hi, BLOCK_N):
        m_i, l_i, acc = _attend_keys(
            q, m_i, l_i, acc, start, kv_hi, q_pos, offs_m, window, qk_scale, soft_cap, bt_row, k_head,
            v_head, offs_d, d_ok, stride_kb, stride_ks, stride_vb, stride_vs,
            BLOCK_N, BLOCK_SIZE, True, CAUSAL, IEEE, DOT_F32, HAS_WINDOW, HAS_SOFTCAP, KV_FP8)

    if KV_FP8:
        acc = acc * tl.load(v_scale_ptr)
    if not PARTIAL and NUM_SPLITS == 1:
        l_safe = tl.where(l_i == 0.0, 1.0, l_i)
        o = acc / l_safe[:, None]
        tl.store(out_ptr + tok[:, None] * stride_ot + head[:, None] * stride_oh + offs_d[None, :],
                 o.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])
    else:
        # partial results, [T, Hq, NUM_SPLITS, (D | 2)] fp32: unnormalised acc, (max, sum)
        if not PARTIAL:
            row = ((tok - part_tok_base) * num_q_heads + head) * NUM_SPLITS + split
        else:   # (cascade: this launch's splits of a shared buffer)
            row = ((tok - part_tok_base) * num_q_heads + head) * part_splits + split_base + split
        tl.store(part_acc_ptr + row[:, None] * HEAD_DIM + offs_d[None, :], acc,
                 mask=row_ok[:, None] & d_ok[None, :])
        tl.store(part_ml_ptr + row * 2, m_i, mask=row_ok)
        tl.store(part_ml_ptr + row * 2 + 1, l_i, mask=row_ok)


@step_jit(ints=("tok_base",))
def _split_kv_reduce_kernel(
    part_acc_ptr, part_ml_ptr, out_ptr, sinks_ptr, stride_ot, stride_oh, num_q_heads, tok_base,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    NUM_SPLITS: tl.constexpr, BLOCK_S: tl.constexpr, PDL: tl.constexpr, HAS_SINKS: tl.constexpr,
):
    pdl_wait(PDL)
    t = tl.program_id(0).to(tl.int64)  # token - tok_base
    h = tl.program_id(1)
    offs_s = tl.arange(0, BLOCK_S)
    s_ok = offs_s < NUM_SPLITS
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < HEAD_DIM
    row = (t * num_q_heads + h) * NUM_SPLITS + offs_s
    m = tl.load(part_ml_ptr + row * 2, mask=s_ok, other=float("-inf"))
    l_ = tl.load(part_ml_ptr + row * 2 + 1, mask=s_ok, other=0.0)
    if HAS_SINKS:   # the head's sink joins the merged denominator once (log2 domain, as m)
        sink = tl.load(sinks_ptr + h).to(tl.float32) * 1.4426950408889634
        m_max = tl.maximum(tl.max(m, 0), sink)
    else:
        m_max = tl.max(m, 0)
    w = tl.exp2(m - m_max)  # empty splits carry m = -1e30 -> weight 0
    total = tl.sum(w * l_, 0)
    if HAS_SINKS:
        total += tl.exp2(sink - m_max)
    acc = tl.load(part_acc_ptr + row[:, None] * HEAD_DIM + offs_d[None, :],
                  mask=s_ok[:, None] & d_ok[None, :], other=0.0)
    o = tl.sum(acc * w[:, None], 0) / tl.where(total == 0.0, 1.0, total)
    tl.store(out_ptr + (t + tok_base) * stride_ot + h * stride_oh + offs_d, o.to(out_ptr.dtype.element_ty),
             mask=d_ok)


MIN_SPLIT_TOKENS = 32  # the least KV per split worth a program of its own
MAX_KV_SPLITS = 32
SPLIT_BELOW_PROGRAMS_PER_SM = 3  # a decode batch with fewer (sequence, KV head) programs per SM splits
SPLIT_PROGRAMS_PER_SM = 4  # what a split decode aims for
LONG_TILE_PROGRAMS_PER_SM = 6  # below this many unsplit decode programs per SM, 128-key tiles
LONG_TILE_MAX_SPLITS = 4  # a decode split at most this many ways streams 128 keys per step, 2 deep


def choose_num_kv_splits(num_seqs: int, num_kv_heads: int, max_query_len: int, max_seq_len: int,
                         device: torch.device) -> int:
    """Split-KV (flash-decoding) heuristic, for pure decode batches whose
    (sequence, kv head) programs are fewer than SPLIT_BELOW_PROGRAMS_PER_SM per
    SM: split each sequence's KV until there are about SPLIT_PROGRAMS_PER_SM
    programs per SM, with at least MIN_SPLIT_TOKENS keys per split (at most
    MAX_KV_SPLITS). On an H200 (Qwen3-0.6B's heads, the offline workload's
    contexts of 1,000-2,000 keys; bench/RESULTS.md, session 12): 28 decodes take
    50 us in 2 splits against 69 in 8, 42 decodes 59 us in 2 against 65 unsplit,
    13 decodes 32 us in 4 against 40 in 16; one decode at 1,024 keys 6.7 us in
    32 splits against 10.0 in 4. Returns a power of two (1 = no split) so few
    kernel variants get compiled."""
    if max_query_len != 1 or max_seq_len < 2 * MIN_SPLIT_TOKENS:
        return 1
    programs = max(1, num_seqs * num_kv_heads)
    sms = sm_count(device)
    if programs >= SPLIT_BELOW_PROGRAMS_PER_SM * sms:
        return 1
    want = min(triton.cdiv(SPLIT_PROGRAMS_PER_SM * sms, programs), max_seq_len // MIN_SPLIT_TOKENS, MAX_KV_SPLITS)
    if want < 2:
        return 1
    return 1 << (want.bit_length() - 1)


FEW_PREFILL_PROGRAMS_PER_SM = 1.0  # a launch of multi-query tiles with fewer programs per SM is a short chunk
CHUNK_SPLIT_MIN_KEYS = 512  # ... whose KV splits in two from this many keys


def choose_chunk_kv_splits(programs_per_sm: float, max_seq_len: int) -> int:
    """Split-KV for a launch of multi-query tiles: a short prompt chunk over a long
    context has fewer (query tile, KV head) programs than SMs, each walking the whole
    context while SMs idle. In two: Llama-3.1-70B's rank at TP=2, 140 queries over
    1,000 keys, 29.1 -> 26.5 us (4 ways: 29.7; bench/RESULTS.md, session 21)."""
    if programs_per_sm >= FEW_PREFILL_PROGRAMS_PER_SM or max_seq_len < CHUNK_SPLIT_MIN_KEYS:
        return 1
    return 2


def paged_attention(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                    query_start_loc: torch.Tensor, seq_lens: torch.Tensor,
                    block_table: torch.Tensor, scale: float, max_query_len: int,
                    max_seq_len: int, num_kv_splits: int | None = None,
                    num_decodes: int = 0, seq_order: torch.Tensor | None = None,
                    out: torch.Tensor | None = None, sliding_window: int | None = None,
                    logits_soft_cap: float | None = None, sinks: torch.Tensor | None = None,
                    k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None) -> torch.Tensor:
    """Varlen causal paged attention (Triton). Same semantics as paged_attention_ref
    (sliding_window, logits_soft_cap, sinks [Hq], and an FP8 cache's k_scale / v_scale too: fp32
    device tensors, read by the kernel, so a CUDA graph replays with their current values).

    query [T, Hq, D] (last dim contiguous; token/head strides free), caches
    [num_blocks, block_size, Hkv, D], query_start_loc int32 [B+1], seq_lens
    int32 [B], block_table int32 [B, max_blocks]. max_query_len / max_seq_len
    are host ints: max_query_len must be >= every q_len (it picks the tiling);
    max_seq_len only feeds the split-KV heuristic.

    num_kv_splits forces the number of KV splits (1 = off; None = automatic:
    decode-only batches with long contexts and few (sequence, kv head) pairs).

    num_decodes (optional host hint): if the first num_decodes sequences are
    decodes (q_len == 1, so they own tokens [0, num_decodes)), a mixed batch is
    run as two launches, the decodes with decode tiling (and split-KV when
    worth it) and the rest with prefill tiling; otherwise a mixed batch runs in
    one launch with prefill-sized tiles, which wastes tensor-core work on the
    decode rows. The result is the same either way.

    seq_order (optional, int32): a permutation of the decodes, longest first: of
    all B sequences in a pure decode batch, of the first num_decodes in a mixed
    one. Programs then start in that order with a sequence's KV heads side by
    side, so the longest work is not left for the tail of the launch when
    context lengths differ.

    out (optional, [T, Hq, D], last dim contiguous): written in place and returned, as a piecewise
    CUDA graph needs attention's output at a fixed address."""
    if not runs_triton(_paged_attention_kernel, query):
        ref = paged_attention_ref(query, key_cache, value_cache, query_start_loc, seq_lens, block_table, scale,
                                  sliding_window, logits_soft_cap, sinks, k_scale, v_scale)
        return ref if out is None else out.copy_(ref)
    num_tokens, num_q_heads, head_dim = query.shape
    num_blocks, block_size, num_kv_heads, kd = key_cache.shape
    assert kd == head_dim and value_cache.shape == key_cache.shape
    assert num_q_heads % num_kv_heads == 0
    assert key_cache.dtype == value_cache.dtype and key_cache.dtype in (query.dtype, FP8_DTYPE), \
        "the caches hold the query's dtype or FP8"
    assert key_cache.stride(-1) == 1 and value_cache.stride(-1) == 1
    num_seqs = seq_lens.shape[0]
    if out is None:
        out = torch.empty((num_tokens, num_q_heads, head_dim), dtype=query.dtype, device=query.device)
    assert out.shape == query.shape and out.stride(-1) == 1
    if num_tokens == 0 or num_seqs == 0:
        return out
    query = _last_dim_contiguous(query)
    query_start_loc = query_start_loc.to(torch.int32).contiguous()
    seq_lens = seq_lens.to(torch.int32).contiguous()
    block_table = block_table.to(torch.int32)
    if block_table.stride(-1) != 1:
        block_table = block_table.contiguous()
    max_query_len = max(1, int(max_query_len))
    nd = int(num_decodes)
    kv = _KVCaches.of(key_cache, value_cache, k_scale, v_scale)
    if sinks is not None:
        assert sinks.shape == (num_q_heads,) and sinks.is_contiguous(), "sinks: one logit per query head"
    variant = _Variant(scale, sliding_window, logits_soft_cap, sinks)
    if sliding_window is not None:   # the split-KV heuristics see the keys a query reads
        max_seq_len = min(max_seq_len, sliding_window + max_query_len - 1)
    if 0 < nd < num_seqs and max_query_len > 1:
        decodes = _Launch(query_start_loc[:nd + 1], seq_lens[:nd], block_table[:nd], 1, 0, nd, seq_order)
        prefills = _Launch(query_start_loc[nd:], seq_lens[nd:], block_table[nd:], max_query_len, nd, num_tokens)
        with _beside(query) as side:
            with side:
                _attention_launch(query, kv, out, prefills, variant, max_seq_len, num_kv_splits)
            _attention_launch(query, kv, out, decodes, variant, max_seq_len, num_kv_splits)
    else:
        pure_decode = max_query_len == 1 or nd == num_seqs
        batch = _Launch(query_start_loc, seq_lens, block_table, max_query_len, 0, num_tokens,
                        seq_order if pure_decode else None)
        _attention_launch(query, kv, out, batch, variant, max_seq_len, num_kv_splits)
    return out


@functools.cache
def _concurrent_launches() -> bool:
    return envs.LOOM_ATTENTION_STREAMS   # read once per process (at the first mixed batch)


_SIDE_STREAMS: dict[int, torch.cuda.Stream] = {}


def side_stream(device: torch.device) -> torch.cuda.Stream:
    """The device's one side stream for attention launches that run beside the main stream's."""
    side = _SIDE_STREAMS.get(device.index)
    if side is None:
        side = _SIDE_STREAMS[device.index] = torch.cuda.Stream(device)
    return side


@contextmanager
def _beside(query: torch.Tensor):
    """A mixed batch's two launches (prompt tiles, decodes) write disjoint rows, so the prompt
    tiles run on a side stream beside the decodes: their few long programs start first and the
    decodes' short ones fill the SMs around them, where one after the other each launch's last
    wave left SMs idle. Yields the context to launch the prompt tiles in: the side stream (which
    first waits for this stream's work, the KV-cache writes; this stream waits for it on exit),
    or a no-op where there is none (CPU, a graph capture, LOOM_ATTENTION_STREAMS=0)."""
    if not (query.is_cuda and _concurrent_launches()) or torch.cuda.is_current_stream_capturing():
        yield nullcontext()
        return
    main = torch.cuda.current_stream(query.device)
    side = side_stream(main.device)
    side.wait_stream(main)
    try:
        yield torch.cuda.stream(side)
    finally:
        main.wait_stream(side)


@dataclass(slots=True, frozen=True)
class _Variant:
    """What one layer's attention computes: its scale, window, soft cap and sinks."""
    scale: float
    sliding_window: int | None = None
    logits_soft_cap: float | None = None
    sinks: torch.Tensor | None = None

    def kernel_args(self) -> tuple[float, int, float, dict]:
        """(qk_scale, window, soft_cap, constexpr flags), in the kernel's log2 domain."""
        log2e = 1.4426950408889634
        cap, window = self.logits_soft_cap, self.sliding_window
        flags = dict(HAS_WINDOW=window is not None, HAS_SOFTCAP=cap is not None, HAS_SINKS=self.sinks is not None)
        if cap is None:
            return float(self.scale) * log2e, window or 0, 0.0, flags
        return float(self.scale) / cap, window or 0, float(cap) * log2e, flags


class _KVCaches(NamedTuple):
    """The caches one launch reads, with an FP8 cache's scales (else unused pointers)."""
    key: torch.Tensor
    value: torch.Tensor
    k_scale: torch.Tensor
    v_scale: torch.Tensor

    @classmethod
    def of(cls, key: torch.Tensor, value: torch.Tensor, k_scale: torch.Tensor | None,
           v_scale: torch.Tensor | None) -> "_KVCaches":
        if key.dtype != FP8_DTYPE:
            return cls(key, value, key, key)
        return cls(key, value, *fp8_scales(key.device, k_scale, v_scale))

    @property
    def fp8(self) -> bool:
        return self.key.dtype == FP8_DTYPE


@dataclass(slots=True)
class _Launch:
    """The sequences of one kernel launch: query_start_loc holds absolute token indices, and
    every token they own is in [tok_lo, tok_hi)."""
    query_start_loc: torch.Tensor
    seq_lens: torch.Tensor
    block_table: torch.Tensor
    max_query_len: int
    tok_lo: int
    tok_hi: int
    seq_order: torch.Tensor | None = None


def query_rows(group: int, max_query_len: int) -> int:
    """BLOCK_M: a tile's rows, query tokens x the GROUP heads of a KV head (padded to 16)."""
    return max(16, triton.next_power_of_2(group), min(64, triton.next_power_of_2(max_query_len * group)))


def tile_config(group: int, block_d: int, max_query_len: int, is_fp32: bool, num_splits: int,
                programs_per_sm: float = 0.0, max_seq_len: int = 0) -> dict:
    """Tile sizes of one launch: BLOCK_M rows (query tokens x the GROUP heads of a
    KV head), BLOCK_N keys per iteration, warps and pipeline stages. From
    bench/tune_attention.py on an H200: 64x32 tiles beat 128x64 by 13-17% on
    prefill, but a short chunk with fewer programs (query tiles x KV heads) than
    SMs streams 64 keys per step (140 queries of Llama-3.1-70B's TP=2 rank over
    1,000 keys: 29.1 us against 37.3); an unsplit decode with few programs per SM (programs_per_sm:
    sequences x KV heads over SMs) streams 128 keys per step, 3 stages deep:
    48 decodes of 100-2,000 keys take 63 us that way against 78-91 us with 64.
    A decode split a few ways has long splits, so it streams 128 keys 2 deep (42
    decodes of 800-1,700 keys in 2 splits: 59 us, against 63 with 64-key tiles);
    one split many ways has a few tiles per split, which gain nothing from
    software pipelining (batch 1 at 256-2,000 keys, 32 splits: 6.5-7.5 us
    unpipelined against 6.8-7.8 two stages deep). A long prefill (long_prefill) takes
    long_prefill_tiles. causal_split, heavy_first (optional, default False): the kernel's
    CAUSAL_SPLIT and HEAVY_FIRST."""
    decode_bf16 = max_query_len == 1 and not is_fp32 and block_d <= 128
    short_chunk = max_query_len > 1 and not is_fp32 and 0 < programs_per_sm < FEW_PREFILL_PROGRAMS_PER_SM
    block_n = 64 if decode_bf16 or short_chunk else 32
    stages = 1 if num_splits > LONG_TILE_MAX_SPLITS else 2
    if decode_bf16 and num_splits == 1 and 0 < programs_per_sm < LONG_TILE_PROGRAMS_PER_SM:
        block_n, stages = 128, 3
    elif decode_bf16 and 1 < num_splits <= LONG_TILE_MAX_SPLITS:
        block_n = 128
    tiles = dict(block_m=query_rows(group, max_query_len), block_n=block_n, num_warps=4, num_stages=stages)
    if programs_per_sm >= LONG_PREFILL_PROGRAMS_PER_SM and long_prefill(max_query_len, max_seq_len, is_fp32,
                                                                        block_d, group):
        tiles.update(long_prefill_tiles())
    return tiles


LONG_PREFILL_KEYS = 4096  # a launch of multi-query tiles over at least this many keys is a long prefill ...
LONG_PREFILL_QUERIES = 256  # ... when its longest chunk has at least this many queries
LONG_PREFILL_PROGRAMS_PER_SM = 2.0  # ... and enough short tiles to fill the SMs with half as many long ones
LONG_PREFILL_TILES = "128,64,8,3"  # its BLOCK_M,BLOCK_N,num_warps,num_stages (LOOM_LONG_PREFILL_TILES wins)


def long_prefill(max_query_len: int, max_seq_len: int, is_fp32: bool, block_d: int, group: int) -> bool:
    """Whether a launch gets the long-prefill tiles: a 16k prompt's chunks are compute bound
    (2 x 16,384^2 x 128 FLOPs per query head, half of them masked), where the standard
    workload's prompts (100-1,024 tokens) keep the small tiles tuned for them. Only where the
    long tiles fit: 16-bit queries, head_dim <= 128, a KV head's group dividing BLOCK_M."""
    return (max_query_len >= LONG_PREFILL_QUERIES and max_seq_len >= LONG_PREFILL_KEYS and not is_fp32
            and block_d <= 128 and group <= 8 and _long_prefill_setting() is not None)


@functools.cache
def _long_prefill_setting() -> tuple[int, int, int, int] | None:
    raw = (envs.LOOM_LONG_PREFILL_TILES or LONG_PREFILL_TILES).strip().lower()
    if raw in ("0", "off", "none"):
        return None
    block_m, block_n, warps, stages = (int(x) for x in raw.split(","))
    return block_m, block_n, warps, stages


def long_prefill_tiles() -> dict:
    """The long-prefill tiles (FA2 on Hopper: 128 query rows x 64 keys, 8 warps, 3 stages), the
    causal split (the keys every row of a tile sees run without the mask, the diagonal with it) and
    the heaviest tiles first (a causal tile's work grows with its queries' positions)."""
    block_m, block_n, warps, stages = _long_prefill_setting()
    return dict(block_m=block_m, block_n=block_n, num_warps=warps, num_stages=stages, causal_split=True,
                heavy_first=True)


@dataclass(slots=True)
class Partials:
    """Unnormalised partial results that several launches write side by side, each at its own
    splits, for one split-KV reduce to merge (cascade attention): acc [T, Hq, splits, D] and
    (max, sum) [T, Hq, splits, 2], fp32, rows from token 0 of the step."""
    acc: torch.Tensor
    ml: torch.Tensor

    @classmethod
    def empty(cls, num_tokens: int, num_q_heads: int, num_splits: int, head_dim: int,
              device: torch.device) -> "Partials":
        return cls(torch.empty((num_tokens, num_q_heads, num_splits, head_dim), dtype=torch.float32, device=device),
                   torch.empty((num_tokens, num_q_heads, num_splits, 2), dtype=torch.float32, device=device))

    @property
    def num_splits(self) -> int:
        return self.acc.shape[2]

    def reduce_into(self, out: torch.Tensor, num_tokens: int) -> None:
        """out[:num_tokens] = the merge of every split of each (token, head), by log-sum-exp."""
        num_q_heads, num_splits, head_dim = self.acc.shape[1:]
        _split_kv_reduce_kernel[(num_tokens, num_q_heads)](
            self.acc, self.ml, out, out, out.stride(0), out.stride(1), num_q_heads, 0,
            HEAD_DIM=head_dim, BLOCK_D=max(16, triton.next_power_of_2(head_dim)), NUM_SPLITS=num_splits,
            BLOCK_S=triton.next_power_of_2(num_splits), num_warps=4, HAS_SINKS=False, **pdl_args(out))


@dataclass(slots=True, frozen=True)
class PartialLaunch:
    """Where a launch that writes partials (cascade attention) writes, and what it reads:
    its splits start at split_base of `partials`; keys from kv_begin on (the suffix: each
    sequence's own; int32 [1] on the device), or, not causal, every key of its one sequence to
    every query (the prefix)."""
    partials: Partials
    split_base: int
    num_splits: int
    kv_begin: torch.Tensor | None = None
    causal: bool = True


def _attention_launch(query: torch.Tensor, kv: _KVCaches, out: torch.Tensor,
                      launch: _Launch, variant: _Variant, max_seq_len: int, num_kv_splits: int | None,
                      partial: PartialLaunch | None = None) -> None:
    """One kernel launch (two with split-KV) over the sequences of `launch`; with `partial`, one
    launch that writes its partial results there (no reduce)."""
    key_cache, value_cache = kv.key, kv.value
    num_q_heads, head_dim = query.shape[1], query.shape[2]
    block_size, num_kv_heads = key_cache.shape[1], key_cache.shape[2]
    group = num_q_heads // num_kv_heads
    num_seqs = launch.seq_lens.shape[0]
    num_tokens = launch.tok_hi - launch.tok_lo
    if num_tokens <= 0 or num_seqs == 0:
        return

    block_d = max(16, triton.next_power_of_2(head_dim))
    is_fp32 = query.dtype == torch.float32
    block_q = query_rows(group, launch.max_query_len) // group
    one_tile = launch.max_query_len <= block_q
    # programs with work: a sequence's query tiles, at most one of them partial
    programs = (num_seqs if one_tile else triton.cdiv(num_tokens, block_q) + num_seqs) * num_kv_heads
    programs_per_sm = programs / sm_count(query.device)
    if partial is not None:
        num_splits = partial.num_splits
    elif num_kv_splits is not None:
        num_splits = max(1, int(num_kv_splits))
    elif one_tile:
        num_splits = choose_num_kv_splits(num_seqs, num_kv_heads, launch.max_query_len, max_seq_len, query.device)
    else:
        num_splits = choose_chunk_kv_splits(programs_per_sm, max_seq_len)
    # (cascade's partial launches keep their own tiles: the long-prefill ones are for causal prompt chunks,
    # and the prefix launch's split count was chosen for the short tiles' programs)
    tiles = tile_config(group, block_d, launch.max_query_len, is_fp32, num_splits, programs_per_sm,
                        max_seq_len if partial is None else 0)
    block_m = tiles["block_m"]
    if block_m != block_q * group:   # (bench/tune_attention.py sets other tiles)
        block_q = block_m // group
        one_tile = launch.max_query_len <= block_q

    num_tiles = num_seqs if one_tile else launch.tok_hi // block_q + num_seqs
    ordered = launch.seq_order is not None and one_tile  # (the order maps whole sequences to programs)
    grid = (num_seqs * num_kv_heads, 1, num_splits) if ordered else (num_tiles, num_kv_heads, num_splits)
    part_tok_base, cascade, part_splits, split_base = launch.tok_lo, {}, 0, 0
    if partial is not None:
        part_acc, part_ml, part_tok_base = partial.partials.acc, partial.partials.ml, 0
        cascade = dict(CAUSAL=partial.causal, SUFFIX=partial.kv_begin is not None, PARTIAL=True)
        part_splits, split_base = partial.partials.num_splits, partial.split_base
    elif num_splits > 1:
        part_acc = torch.empty((num_tokens, num_q_heads, num_splits, head_dim), dtype=torch.float32,
                               device=query.device)
        part_ml = torch.empty((num_tokens, num_q_heads, num_splits, 2), dtype=torch.float32, device=query.device)
    else:
        part_acc = part_ml = out  # unused
    pdl = pdl_args(query)
    qk_scale, window, soft_cap, flags = variant.kernel_args()
    sinks = variant.sinks if variant.sinks is not None else launch.seq_lens  # (unread without HAS_SINKS)
    _paged_attention_kernel[grid](
        query, key_cache, value_cache, out, part_acc, part_ml,
        launch.query_start_loc, launch.seq_lens, launch.block_table,
        launch.seq_order if ordered else launch.seq_lens, sinks,
        kv.k_scale, kv.v_scale,
        partial.kv_begin if partial is not None and partial.kv_begin is not None else launch.seq_lens,
        qk_scale, num_seqs, num_q_heads, part_tok_base, window, soft_cap, part_splits, split_base,
        query.stride(0), query.stride(1), out.stride(0), out.stride(1),
        key_cache.stride(0), key_cache.stride(1), key_cache.stride(2),
        value_cache.stride(0), value_cache.stride(1), value_cache.stride(2),
        launch.block_table.stride(0),
        HEAD_DIM=head_dim, BLOCK_D=block_d, GROUP=group, BLOCK_M=block_m, BLOCK_Q=block_q,
        BLOCK_N=tiles["block_n"], BLOCK_SIZE=block_size, NUM_SPLITS=num_splits, ONE_TILE_PER_SEQ=one_tile,
        ORDERED=ordered, IEEE=is_fp32, DOT_F32=is_interpreted(_paged_attention_kernel) and not is_fp32,
        num_warps=tiles["num_warps"], num_stages=tiles["num_stages"], **pdl, **flags, KV_FP8=kv.fp8, **cascade,
        CAUSAL_SPLIT=bool(tiles.get("causal_split")) and not flags["HAS_WINDOW"],
        HEAVY_FIRST=bool(tiles.get("heavy_first")) and not one_tile and not ordered,
    )
    if num_splits > 1 and partial is None:
        # rows of tokens no sequence owns (padding) come out as garbage, as with one split
        _split_kv_reduce_kernel[(num_tokens, num_q_heads)](
            part_acc, part_ml, out, sinks, out.stride(0), out.stride(1), num_q_heads, launch.tok_lo,
            HEAD_DIM=head_dim, BLOCK_D=block_d, NUM_SPLITS=num_splits,
            BLOCK_S=triton.next_power_of_2(num_splits), num_warps=4, HAS_SINKS=flags["HAS_SINKS"], **pdl,
        )
