"""Cascade (prefix-aware) attention: a step whose sequences all begin with the same KV blocks
reads those blocks once for the whole step, not once per sequence.

As vLLM V1's cascade attention (vllm/v1/attention/backends/flash_attn.py, `cascade_attention`)
and FlashInfer's MultiLevelCascadeAttention, in three launches of the paged-attention kernel
(kernels/paged_attention.py), all of which write unnormalised partial results into one buffer:

* the prefix: every query of the step against the common prefix's keys, as one prefill-style
  "sequence" (many queries, one KV sequence, no causal mask: each query sits after the prefix),
  split over the keys so the launch fills the GPU;
* the suffix: the usual paged attention of each sequence over its own keys, from the end of the
  prefix on (split-KV for a decode batch where it pays, as without cascade);
* the merge: the split-KV reduce, which combines each (query, head)'s partials by their
  log-sum-exps, the prefix's with its own.

The result equals paged_attention's up to the order of the fp32 sums. Not for a sliding window
or attention sinks (vLLM neither): a layer with one runs the plain path.

The runner decides per step whether it pays (workers/cascade_attn.py) and builds the
CascadePrefix. A pure-decode step runs in a decode CUDA graph captured with cascade (the prefix's
length and block-table row are device inputs, its split counts fixed per graph size); a step with
prompt chunks runs in the piecewise CUDA graphs, whose attention is eager.
"""
from __future__ import annotations

from contextlib import nullcontext
from dataclasses import dataclass

import torch
import triton

from ipc import envs
from kernels.jit import runs_triton, sm_count
from kernels.kv_quant import dequantize_ref
from kernels.paged_attention import (FP8_DTYPE, PartialLaunch, Partials, _attention_launch, _KVCaches, _Launch,
                                     _paged_attention_kernel, _Variant, choose_num_kv_splits, query_rows,
                                     side_stream, soft_cap)

MIN_PREFIX_SPLIT_KEYS = 256   # the least of the prefix's keys worth a split of its own
MAX_PREFIX_SPLITS = 16
PREFIX_PROGRAMS_PER_SM = 4    # what the prefix launch's splits aim for (512 decodes of Qwen3-0.6B over
                              # 2,048 keys on an H200: 4 splits 163 us, 2 splits 268, 8 splits 168)


@dataclass(frozen=True, slots=True)
class CascadePrefix:
    """A step's common prefix: the first `length` keys of every sequence lie in the same KV
    blocks, and every query of the step sees all of them (length <= each sequence's tokens
    computed before the step). Device tensors only, none read on the host, so a decode CUDA
    graph captures the launches once over static buffers that each step refills
    (workers/decode_graphs.py); only the split counts are fixed."""
    query_start_loc: torch.Tensor   # int32 [2]: [0, T]: the prefix launch's one sequence is every query
    length: torch.Tensor            # int32 [1]: the prefix's keys, a multiple of the block size (the
                                    # prefix launch's seq_lens, the suffix's first key)
    block_table: torch.Tensor       # int32 [1, >= length // block_size]: the shared blocks (row 0's)
    prefix_splits: int              # KV splits of the prefix launch
    suffix_splits: int              # ... of the suffix launch(es)
    # the prefix launch on a side stream beside the suffix's (CUDA; a captured graph holds them as two
    # branches), the merge after both: the prefix's few compute-bound programs and the suffix's many
    # bandwidth-bound ones share the SMs, where one after the other each launch's tail idles them
    # (LOOM_CASCADE_BESIDE=1: an A/B, off until bench.cascade's rows say it pays)
    beside: bool = False


def choose_prefix_splits(num_tokens: int, group: int, num_kv_heads: int, length: int,
                         device: torch.device) -> int:
    """Split the prefix's keys until the prefix launch has about PREFIX_PROGRAMS_PER_SM
    programs per SM (its programs: query tiles x KV heads; 512 decodes of Qwen3-0.6B are
    16 x 8 = 128 on 132 SMs, each over the whole prefix: 4 splits), with at least
    MIN_PREFIX_SPLIT_KEYS keys per split. LOOM_CASCADE_PREFIX_SPLITS forces a count (A/B).
    A power of two, so few variants compile."""
    forced = envs.LOOM_CASCADE_PREFIX_SPLITS
    if forced:
        return max(1, int(forced))
    programs = triton.cdiv(num_tokens, max(1, query_rows(group, num_tokens) // group)) * num_kv_heads
    want = min(triton.cdiv(PREFIX_PROGRAMS_PER_SM * sm_count(device), programs),
               length // MIN_PREFIX_SPLIT_KEYS, MAX_PREFIX_SPLITS)
    return 1 if want < 2 else 1 << (want.bit_length() - 1)


def choose_suffix_splits(num_seqs: int, num_kv_heads: int, max_query_len: int, max_suffix_len: int,
                         device: torch.device) -> int:
    """The suffix's split-KV: a decode batch's usual choice over its own keys (mostly 1: the
    batches that cascade are large); a batch with prompt chunks, 1 (its two launches must
    write the same splits)."""
    if max_query_len > 1:
        return 1
    return choose_num_kv_splits(num_seqs, num_kv_heads, 1, max_suffix_len, device)


def cascade_attention(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                      query_start_loc: torch.Tensor, seq_lens: torch.Tensor, block_table: torch.Tensor,
                      scale: float, max_query_len: int, prefix: CascadePrefix, num_decodes: int = 0,
                      seq_order: torch.Tensor | None = None, out: torch.Tensor | None = None,
                      logits_soft_cap: float | None = None, k_scale: torch.Tensor | None = None,
                      v_scale: torch.Tensor | None = None) -> torch.Tensor:
    """paged_attention's result (same arguments; no window or sinks) computed as prefix +
    suffix + merge (Triton). prefix: the step's CascadePrefix."""
    if not runs_triton(_paged_attention_kernel, query):
        ref = cascade_attention_ref(query, key_cache, value_cache, query_start_loc, seq_lens, block_table, scale,
                                    int(prefix.length[0]), logits_soft_cap, k_scale, v_scale)
        return ref if out is None else out.copy_(ref)
    num_tokens, num_q_heads, head_dim = query.shape
    assert key_cache.dtype in (query.dtype, FP8_DTYPE) and key_cache.stride(-1) == 1
    if out is None:
        out = torch.empty_like(query)
    num_seqs = seq_lens.shape[0]
    if num_tokens == 0 or num_seqs == 0:
        return out
    if query.stride(-1) != 1:
        query = query.contiguous()
    kv = _KVCaches.of(key_cache, value_cache, k_scale, v_scale)
    variant = _Variant(scale, None, logits_soft_cap, None)
    partials = Partials.empty(num_tokens, num_q_heads, prefix.prefix_splits + prefix.suffix_splits, head_dim,
                              query.device)
    # (max_seq_len 0: a partial launch's splits are given, and its tiles never the long-prefill ones)
    everyone = _Launch(prefix.query_start_loc, prefix.length, prefix.block_table, num_tokens, 0, num_tokens)
    main = torch.cuda.current_stream(query.device) if prefix.beside and query.is_cuda else None
    side = side_stream(query.device) if main is not None else None
    if side is not None:
        side.wait_stream(main)   # (the KV-cache writes first)
    with torch.cuda.stream(side) if side is not None else nullcontext():
        _attention_launch(query, kv, out, everyone, variant, 0, None,
                          PartialLaunch(partials, 0, prefix.prefix_splits, causal=False))
    own = PartialLaunch(partials, prefix.prefix_splits, prefix.suffix_splits, kv_begin=prefix.length)
    nd = int(num_decodes)
    if 0 < nd < num_seqs and max_query_len > 1:   # decodes with decode tiles, the prompt chunks apart
        launches = [_Launch(query_start_loc[:nd + 1], seq_lens[:nd], block_table[:nd], 1, 0, nd, seq_order),
                    _Launch(query_start_loc[nd:], seq_lens[nd:], block_table[nd:], max_query_len, nd, num_tokens)]
    else:
        pure_decode = max_query_len == 1 or nd == num_seqs
        launches = [_Launch(query_start_loc, seq_lens, block_table, max(1, max_query_len), 0, num_tokens,
                            seq_order if pure_decode else None)]
    for launch in launches:
        _attention_launch(query, kv, out, launch, variant, 0, None, own)
    if side is not None:
        main.wait_stream(side)
    partials.reduce_into(out, num_tokens)
    return out


# --------------------------------------------------------------------------
# torch reference
# --------------------------------------------------------------------------

def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, visible: torch.Tensor, scale: float,
            cap: float | None) -> tuple[torch.Tensor, torch.Tensor]:
    """q [Q, Hkv, g, D], k/v [S, Hkv, D] fp32, visible [Q, S] -> (the attention output
    [Q, Hkv, g, D], its natural log-sum-exp [Q, Hkv, g]: -inf, and output 0, where a query sees
    no key)."""
    scores = soft_cap(torch.einsum("qkgd,skd->qkgs", q, k) * scale, cap)
    scores = scores.masked_fill(~visible[:, None, None, :], float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)
    probs = torch.exp(scores - lse.masked_fill(lse == float("-inf"), 0.0)[..., None])
    return torch.einsum("qkgs,skd->qkgd", probs, v), lse


def merge_attn_states(o1: torch.Tensor, lse1: torch.Tensor, o2: torch.Tensor, lse2: torch.Tensor) -> torch.Tensor:
    """Two normalised attention outputs over disjoint keys, merged by their log-sum-exps (vLLM's
    merge_attn_states): the attention over the union of the keys."""
    m = torch.maximum(lse1, lse2)
    m = m.masked_fill(m == float("-inf"), 0.0)
    w1, w2 = torch.exp(lse1 - m), torch.exp(lse2 - m)
    total = (w1 + w2).masked_fill(w1 + w2 == 0, 1.0)
    return (o1 * w1[..., None] + o2 * w2[..., None]) / total[..., None]


def cascade_attention_ref(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                          query_start_loc: torch.Tensor, seq_lens: torch.Tensor, block_table: torch.Tensor,
                          scale: float, prefix_len: int, logits_soft_cap: float | None = None,
                          k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None) -> torch.Tensor:
    """The same attention as paged_attention_ref, as cascade computes it: every query against the
    first prefix_len keys of sequence 0's block table (which every sequence shares), each
    sequence's queries against its own keys from prefix_len on (causal), merged by log-sum-exp."""
    num_blocks, block_size, num_kv_heads, head_dim = key_cache.shape
    num_tokens = query.shape[0]
    q = query.float().view(num_tokens, num_kv_heads, -1, head_dim)
    shared = block_table[0, :prefix_len // block_size].long()
    k = dequantize_ref(key_cache[shared].flatten(0, 1), k_scale)
    v = dequantize_ref(value_cache[shared].flatten(0, 1), v_scale)
    o1, lse1 = _attend(q, k, v, torch.ones((num_tokens, prefix_len), dtype=torch.bool, device=query.device),
                       scale, logits_soft_cap)
    o2 = torch.zeros_like(o1)
    lse2 = torch.full_like(lse1, float("-inf"))
    for i in range(seq_lens.shape[0]):
        lo, hi, seq_len = int(query_start_loc[i]), int(query_start_loc[i + 1]), int(seq_lens[i])
        if hi == lo:
            continue
        blocks = block_table[i, prefix_len // block_size:-(-seq_len // block_size)].long()
        k = dequantize_ref(key_cache[blocks].flatten(0, 1)[:seq_len - prefix_len], k_scale)
        v = dequantize_ref(value_cache[blocks].flatten(0, 1)[:seq_len - prefix_len], v_scale)
        q_pos = torch.arange(seq_len - (hi - lo), seq_len, device=query.device)
        k_pos = torch.arange(prefix_len, seq_len, device=query.device)
        o2[lo:hi], lse2[lo:hi] = _attend(q[lo:hi], k, v, k_pos[None, :] <= q_pos[:, None], scale, logits_soft_cap)
    return merge_attn_states(o1, lse1, o2, lse2).flatten(1, 2).to(query.dtype)
