"""Mixture-of-experts: top-k routing and the experts' gated MLPs, torch references.

    out[t] = sum over j < k of  w[t, j] * (down_e(act(gate_e(x_t), up_e(x_t))) + b2_e),  e = ids[t, j]

Layout (vLLM's): every expert's gate and up are stacked as w13 [E, 2I, H], **gate rows first,
then up rows** (with its optional bias w13_bias [E, 2I] in the same order), and its down as
w2 [E, H, I] (optional bias w2_bias [E, H], added before the routing weight scales the expert's
output, as HF's gpt-oss does). One layout for every model: gpt-oss's checkpoint interleaves
gate and up (gate_up_proj[..., 0::2] is the gate, [..., 1::2] the up), and its loader
de-interleaves at load (`deinterleave_gate_up`) so the kernels never see the interleaved form.
An id of -1 names an expert that another rank holds (expert parallelism, workers/models/moe.py):
it contributes nothing, in the references and in the kernel.

Activations, act(gate, up):
  "silu"      SwiGLU, silu(gate) * up (Qwen-MoE, Mixtral);
  "swigluoai" gpt-oss's clamped SwiGLU (transformers' GptOssExperts._apply_gate):
              gate = min(gate, 7.0); up = clamp(up, -7.0, 7.0);
              (up + 1) * gate * sigmoid(1.702 * gate).

The references: fused_moe_ref gathers the tokens routed to each chosen expert (it reads which
experts were chosen: a host sync), fused_moe_dense_ref runs every expert on every token
(sync-free). The Triton grouped-GEMM kernel is their fast equal."""
from __future__ import annotations

import functools
import json
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from ipc import envs
from kernels.jit import pdl_args, pdl_wait, runs_triton, step_jit

# gpt-oss's clamped SwiGLU constants (its config's swiglu_alpha / swiglu_limit, fixed in vLLM too)
SWIGLUOAI_ALPHA = 1.702
SWIGLUOAI_LIMIT = 7.0
ACTIVATIONS = ("silu", "swigluoai")


def select_experts(router_logits: torch.Tensor, top_k: int, renormalize: bool,
                   scoring: str = "softmax") -> tuple[torch.Tensor, torch.Tensor]:
    """router_logits [T, E] -> (topk_weights [T, k] float32, topk_ids [T, k] int64).
    scoring: "softmax" over all experts, or "sigmoid" per expert; renormalize: the k chosen
    weights are scaled to sum to 1 (Mixtral always; Qwen's `norm_topk_prob`). The scores are
    taken in float32, as HF does, so near-ties pick the same experts."""
    logits = router_logits.float()
    if scoring == "softmax":
        scores = logits.softmax(dim=-1)
    elif scoring == "sigmoid":
        scores = logits.sigmoid()
    else:
        raise ValueError(f"select_experts: unknown scoring {scoring!r} (softmax, sigmoid)")
    weights, ids = torch.topk(scores, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids


@triton.jit
def _fused_topk_kernel(logits_ptr, weights_ptr, ids_ptr, num_experts, stride_l, TOP_K: tl.constexpr,
                       K_POW2: tl.constexpr, BLOCK_E: tl.constexpr, SIGMOID: tl.constexpr,
                       RENORMALIZE: tl.constexpr, PDL: tl.constexpr):
    """One token: scores in fp32 (softmax over the experts or per-expert sigmoid), then TOP_K
    rounds of (max, its lowest index), descending as torch.topk returns them. Under PDL it
    launches during the router's GEMV and lets the experts' up kernel launch during it."""
    pdl_wait(PDL)   # the logits: the router's output
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK_E)
    mask = offs < num_experts
    x = tl.load(logits_ptr + row * stride_l + offs, mask=mask, other=-float("inf")).to(tl.float32)
    if SIGMOID:
        scores = 1.0 / (1.0 + tl.exp(-x))
    else:
        p = tl.exp(x - tl.max(x, axis=0))
        scores = p / tl.sum(p, axis=0)
    scores = tl.where(mask, scores, -1.0)   # below every real score
    slots = tl.arange(0, K_POW2)
    top_w = tl.zeros((K_POW2,), dtype=tl.float32)
    top_i = tl.zeros((K_POW2,), dtype=tl.int64)
    for j in tl.static_range(TOP_K):
        best = tl.max(scores, axis=0)
        idx = tl.min(tl.where(scores == best, offs, BLOCK_E), axis=0)
        top_w = tl.where(slots == j, best, top_w)
        top_i = tl.where(slots == j, idx.to(tl.int64), top_i)
        scores = tl.where(offs == idx, -2.0, scores)
    if RENORMALIZE:
        top_w = top_w / tl.sum(top_w, axis=0)
    tl.store(weights_ptr + row * TOP_K + slots, top_w, mask=slots < TOP_K)
    tl.store(ids_ptr + row * TOP_K + slots, top_i, mask=slots < TOP_K)


def fused_topk(router_logits: torch.Tensor, top_k: int, renormalize: bool,
               scoring: str = "softmax") -> tuple[torch.Tensor, torch.Tensor]:
    """select_experts in one kernel (vLLM's fused_topk): a decode layer's routing is one launch
    instead of five (cast, softmax, topk, sum, divide). select_experts where Triton does not run."""
    if scoring not in ("softmax", "sigmoid"):
        raise ValueError(f"select_experts: unknown scoring {scoring!r} (softmax, sigmoid)")
    if not runs_triton(_fused_topk_kernel, router_logits):
        return select_experts(router_logits, top_k, renormalize, scoring)
    t, e = router_logits.shape
    weights = torch.empty((t, top_k), dtype=torch.float32, device=router_logits.device)
    ids = torch.empty((t, top_k), dtype=torch.int64, device=router_logits.device)
    if t:
        logits = router_logits if router_logits.stride(-1) == 1 else router_logits.contiguous()
        block_e = triton.next_power_of_2(e)
        _fused_topk_kernel[(t,)](logits, weights, ids, e, logits.stride(0), TOP_K=top_k,
                                 K_POW2=triton.next_power_of_2(top_k), BLOCK_E=block_e,
                                 SIGMOID=scoring == "sigmoid", RENORMALIZE=renormalize,
                                 num_warps=1 if block_e <= 128 else 2, **pdl_args(logits))
    return weights, ids


def check_activation(activation: str) -> None:
    if activation not in ACTIVATIONS:
        raise ValueError(f"fused_moe: unknown activation {activation!r} ({', '.join(ACTIVATIONS)})")


def moe_act_ref(gate_up: torch.Tensor, activation: str = "silu") -> torch.Tensor:
    """gate_up [..., 2I] (gate first) -> act(gate, up) [..., I] in gate_up's dtype."""
    gate, up = gate_up.chunk(2, dim=-1)
    if activation == "silu":
        return F.silu(gate) * up
    check_activation(activation)
    gate = gate.clamp(max=SWIGLUOAI_LIMIT)
    up = up.clamp(min=-SWIGLUOAI_LIMIT, max=SWIGLUOAI_LIMIT)
    return (up + 1) * (gate * torch.sigmoid(gate * SWIGLUOAI_ALPHA))


def deinterleave_gate_up(t: torch.Tensor, dim: int) -> torch.Tensor:
    """gpt-oss's interleaved gate/up (gate at even, up at odd indices of `dim`) -> [gate; up]
    along `dim`, the layout w13 and w13_bias use."""
    idx = torch.arange(t.shape[dim], device=t.device)
    return t.index_select(dim, torch.cat([idx[0::2], idx[1::2]]))


def _expert_mlp(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, e: int, w13_bias, w2_bias,
                activation: str) -> torch.Tensor:
    """Expert e on x [n, H] -> [n, H]."""
    gate_up = F.linear(x, w13[e], None if w13_bias is None else w13_bias[e])
    return F.linear(moe_act_ref(gate_up, activation), w2[e], None if w2_bias is None else w2_bias[e])


def fused_moe_ref(hidden: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
                  topk_ids: torch.Tensor, *, w13_bias: torch.Tensor | None = None,
                  w2_bias: torch.Tensor | None = None, activation: str = "silu") -> torch.Tensor:
    """hidden [T, H], w13 [E, 2I, H], w2 [E, H, I], topk_weights / topk_ids [T, k] -> [T, H];
    optional biases w13_bias [E, 2I], w2_bias [E, H]; activation "silu" or "swigluoai".
    The routed sum is accumulated in float32 and returned in hidden's dtype. An expert that
    no token chose costs nothing; the loop reads which experts were chosen (a host sync: the
    reference is for correctness, not for CUDA graphs). An id of -1 (an expert that is not on
    this rank, under expert parallelism) adds nothing, in every implementation here."""
    check_activation(activation)
    t, h = hidden.shape
    out = torch.zeros((t, h), dtype=torch.float32, device=hidden.device)
    if t == 0:
        return out.to(hidden.dtype)
    flat_ids = topk_ids.reshape(-1)
    flat_w = topk_weights.reshape(-1).float()
    token_of = torch.arange(t, device=hidden.device).repeat_interleave(topk_ids.shape[1])
    for e in flat_ids.unique().tolist():
        if e < 0:  # an expert on another rank (expert parallelism): adds nothing here
            continue
        pick = (flat_ids == e).nonzero(as_tuple=True)[0]
        tokens = token_of[pick]
        y = _expert_mlp(hidden[tokens], w13, w2, e, w13_bias, w2_bias, activation)
        out.index_add_(0, tokens, y.float() * flat_w[pick, None])
    return out.to(hidden.dtype)


def fused_moe_dense_ref(hidden: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
                        topk_ids: torch.Tensor, *, w13_bias: torch.Tensor | None = None,
                        w2_bias: torch.Tensor | None = None, activation: str = "silu") -> torch.Tensor:
    """fused_moe_ref's result with no host sync: every expert runs on every token, weighted by
    its routing weight (0 where the token did not choose it). E / k times the routed FLOPs: the
    CPU path under capture-like conditions and an oracle, not a fast path."""
    check_activation(activation)
    t, h = hidden.shape
    # dense[t, e]: the routing weight of expert e for token t (0: not chosen)
    dense = torch.zeros((t, w13.shape[0]), dtype=torch.float32, device=hidden.device)
    mine = topk_ids >= 0  # id -1: an expert on another rank
    dense.scatter_add_(1, topk_ids.clamp(min=0), topk_weights.float() * mine)
    out = torch.zeros((t, h), dtype=torch.float32, device=hidden.device)
    for e in range(w13.shape[0]):
        out += _expert_mlp(hidden, w13, w2, e, w13_bias, w2_bias, activation).float() * dense[:, e:e + 1]
    return out.to(hidden.dtype)


# ----------------------------------------------------------------------------- Triton kernel
# vLLM's design (vllm/model_executor/layers/fused_moe/fused_moe.py):
#
# 1. moe_align_block_size: the T*k (token, choice) pairs, numbered i = t*k + j, are sorted by
#    expert and each expert's run is padded to a multiple of BLOCK_SIZE_M with the sentinel T*k,
#    so every BLOCK_SIZE_M block of `sorted_token_ids` belongs to one expert (`expert_ids`).
#    The buffers are sized for the worst case (every non-empty expert padded by BLOCK_SIZE_M - 1)
#    and the real length `num_tokens_post_padded` stays on the device: no host sync, so a CUDA
#    graph captures it, and the grid's blocks past the real length return at once.
# 2. One grouped GEMM for gate/up with the activation fused: a program's tile is
#    BLOCK_SIZE_N // 2 gate columns and the same up columns (w13 rows n and I + n), so its
#    registers are those of a BLOCK_SIZE_N tile of an unfused GEMM and vLLM's tile sizes carry
#    over; it writes act(gate, up) [T*k, I] directly.
# 3. One grouped GEMM for down, with the bias and the routing weight applied in its epilogue,
#    into [T*k, H] in the model dtype; then the top-k sum, out = cache.view(T, k, H).sum(1)
#    (fp32 accumulation, one rounding). The sum stays a reduction after the GEMM, as in vLLM
#    (moe_sum), rather than fp32 atomics in the epilogue: atomics would make the result depend
#    on the order programs finish (no run-to-run or graph-to-eager bit equality) and need a
#    zeroed fp32 output; the extra pass over [T, k, H] is ~1/E of the weight bytes at decode.
#
# A choice with expert id -1 (an expert that is not on this rank, under expert parallelism)
# adds nothing: its pairs are sorted into an extra bucket whose blocks have expert id -1, which
# the gate/up GEMM skips and the down GEMM writes as zeros.

# moe_align_block_size runs as one Triton program up to this many pairs (decode: one launch in
# every layer of a CUDA graph), and above it as three launches over 64-pair chunks (count per
# chunk, prefix per expert over the chunks, scatter), where one program's serial passes would
# cost more. Both give the stable order of moe_align_block_size_ref (torch ops, the oracle).
ALIGN_MAX_PAIRS_ONE_PROGRAM = 256
_ALIGN_CHUNK = 64      # pairs per loop step / per program
_ALIGN_FILL = 1024     # padding slots per store


def max_num_tokens_padded(num_pairs: int, num_experts: int, block_m: int) -> int:
    """Worst-case length of sorted_token_ids: every non-empty bucket (the experts and the -1
    bucket) padded by block_m - 1, rounded up to whole blocks."""
    worst = num_pairs + min(num_pairs, num_experts + 1) * (block_m - 1)
    return triton.cdiv(worst, block_m) * block_m


@triton.jit
def _load_buckets(ids_ptr, offs, numel, NUM_EXPERTS: tl.constexpr, BUCKETS_POW2: tl.constexpr):
    """The pairs' buckets (expert id; NUM_EXPERTS for id -1) as a one-hot [len(offs), BUCKETS_POW2]
    (all zero past numel)."""
    ids = tl.load(ids_ptr + offs, mask=offs < numel, other=BUCKETS_POW2).to(tl.int32)
    ids = tl.where(ids < 0, NUM_EXPERTS, ids)
    return (ids[:, None] == tl.arange(0, BUCKETS_POW2)[None, :]).to(tl.int32)


@triton.jit
def _padded_runs(counts, BLOCK_M: tl.constexpr):
    """Per-bucket pair counts -> (start, end) of each bucket's run padded to whole blocks."""
    padded = (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    ends = tl.cumsum(padded, axis=0)
    return ends - padded, ends


@triton.jit
def _store_block_experts(expert_ids_ptr, ends, first, num_blocks, step, NUM_EXPERTS: tl.constexpr,
                         BLOCK_M: tl.constexpr, CHUNK: tl.constexpr):
    """expert_ids[b] for b = first, first + step, ... (CHUNK at a time): the number of runs that
    end at or before the block's first slot, -1 for the id -1 bucket and past the last run."""
    for b0 in range(first, num_blocks, step):
        blocks = b0 + tl.arange(0, CHUNK)
        owner = tl.sum((ends[None, :] <= blocks[:, None] * BLOCK_M).to(tl.int32), axis=1)
        tl.store(expert_ids_ptr + blocks, tl.where(owner >= NUM_EXPERTS, -1, owner), mask=blocks < num_blocks)


@triton.jit
def _fill_padding(sorted_ptr, first, max_padded, step, numel, FILL: tl.constexpr):
    for p0 in range(first, max_padded, step):
        slots = p0 + tl.arange(0, FILL)
        tl.store(sorted_ptr + slots, tl.zeros((FILL,), dtype=tl.int32) + numel, mask=slots < max_padded)


@step_jit(ints=("numel", "max_padded"))
def _moe_align_kernel(ids_ptr, sorted_ptr, expert_ids_ptr, num_post_ptr, numel, max_padded,
                      NUM_EXPERTS: tl.constexpr, BUCKETS_POW2: tl.constexpr, BLOCK_M: tl.constexpr,
                      CHUNK: tl.constexpr, FILL: tl.constexpr):
    """One program: counts per bucket (experts 0..E-1, bucket E for id -1), padded run starts,
    the expert of every block, then each pair's slot (its bucket's start + its rank among the
    bucket's earlier pairs: a stable sort)."""
    counts = tl.zeros((BUCKETS_POW2,), dtype=tl.int32)
    for start in range(0, numel, CHUNK):
        counts += tl.sum(_load_buckets(ids_ptr, start + tl.arange(0, CHUNK), numel, NUM_EXPERTS, BUCKETS_POW2),
                         axis=0)
    starts, ends = _padded_runs(counts, BLOCK_M)
    tl.store(num_post_ptr, tl.sum(ends - starts, axis=0))
    _store_block_experts(expert_ids_ptr, ends, 0, max_padded // BLOCK_M, CHUNK, NUM_EXPERTS, BLOCK_M, CHUNK)
    _fill_padding(sorted_ptr, 0, max_padded, FILL, numel, FILL)
    tl.debug_barrier()  # the padding fill above lands before the pairs below overwrite it
    seen = tl.zeros((BUCKETS_POW2,), dtype=tl.int32)
    for start in range(0, numel, CHUNK):
        offs = start + tl.arange(0, CHUNK)
        onehot = _load_buckets(ids_ptr, offs, numel, NUM_EXPERTS, BUCKETS_POW2)
        # slot of pair i = start of its bucket + pairs of the bucket before this chunk + before i in it
        slot = tl.sum(onehot * (starts[None, :] + seen[None, :] + tl.cumsum(onehot, axis=0) - 1), axis=1)
        tl.store(sorted_ptr + slot, offs, mask=offs < numel)
        seen += tl.sum(onehot, axis=0)


@step_jit(ints=("numel", "max_padded"))
def _moe_align_count_kernel(ids_ptr, counts_ptr, sorted_ptr, numel, max_padded, NUM_EXPERTS: tl.constexpr,
                            BUCKETS_POW2: tl.constexpr, CHUNK: tl.constexpr, FILL: tl.constexpr):
    """Program c: chunk c's pairs per bucket -> counts[c, :]; and its share of the padding fill
    (done before the scatter kernel writes the pairs)."""
    pid, n_prog = tl.program_id(0), tl.num_programs(0)
    onehot = _load_buckets(ids_ptr, pid * CHUNK + tl.arange(0, CHUNK), numel, NUM_EXPERTS, BUCKETS_POW2)
    tl.store(counts_ptr + pid * BUCKETS_POW2 + tl.arange(0, BUCKETS_POW2), tl.sum(onehot, axis=0))
    _fill_padding(sorted_ptr, pid * FILL, max_padded, n_prog * FILL, numel, FILL)


@step_jit(ints=("num_chunks",))
def _moe_align_scan_kernel(counts_ptr, offsets_ptr, totals_ptr, num_chunks, BUCKETS_POW2: tl.constexpr,
                           SCAN: tl.constexpr):
    """Program e: bucket e's exclusive prefix sum over the chunks -> offsets[c, e]; its total."""
    e = tl.program_id(0)
    running = tl.zeros((SCAN,), dtype=tl.int32)   # the count before this block of chunks, broadcast
    for c0 in range(0, num_chunks, SCAN):
        chunks = c0 + tl.arange(0, SCAN)
        x = tl.load(counts_ptr + chunks * BUCKETS_POW2 + e, mask=chunks < num_chunks, other=0)
        tl.store(offsets_ptr + chunks * BUCKETS_POW2 + e, running + tl.cumsum(x, axis=0) - x,
                 mask=chunks < num_chunks)
        running += tl.sum(x, axis=0)
    tl.store(totals_ptr + e, tl.max(running, axis=0))


@step_jit(ints=("numel", "max_padded"))
def _moe_align_scatter_kernel(ids_ptr, offsets_ptr, totals_ptr, sorted_ptr, expert_ids_ptr, num_post_ptr,
                              numel, max_padded, NUM_EXPERTS: tl.constexpr, BUCKETS_POW2: tl.constexpr,
                              BLOCK_M: tl.constexpr, CHUNK: tl.constexpr):
    """Program c: the padded runs from the totals, its share of expert_ids, and chunk c's slots
    (bucket start + the bucket's pairs in earlier chunks + before it in this one)."""
    pid, n_prog = tl.program_id(0), tl.num_programs(0)
    buckets = tl.arange(0, BUCKETS_POW2)
    starts, ends = _padded_runs(tl.load(totals_ptr + buckets), BLOCK_M)
    if pid == 0:
        tl.store(num_post_ptr, tl.sum(ends - starts, axis=0))
    _store_block_experts(expert_ids_ptr, ends, pid * CHUNK, max_padded // BLOCK_M, n_prog * CHUNK, NUM_EXPERTS,
                         BLOCK_M, CHUNK)
    offs = pid * CHUNK + tl.arange(0, CHUNK)
    onehot = _load_buckets(ids_ptr, offs, numel, NUM_EXPERTS, BUCKETS_POW2)
    before = tl.load(offsets_ptr + pid * BUCKETS_POW2 + buckets)
    slot = tl.sum(onehot * (starts[None, :] + before[None, :] + tl.cumsum(onehot, axis=0) - 1), axis=1)
    tl.store(sorted_ptr + slot, offs, mask=offs < numel)


def moe_align_block_size_ref(topk_ids: torch.Tensor, block_m: int, num_experts: int,
                             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """moe_align_block_size from torch ops (a stable sort), the kernels' oracle."""
    flat = topk_ids.reshape(-1)
    dev, numel = flat.device, flat.numel()
    max_padded = max_num_tokens_padded(numel, num_experts, block_m)
    ids = torch.where(flat < 0, num_experts, flat).long()
    counts = torch.zeros(num_experts + 1, dtype=torch.int64, device=dev)
    counts.scatter_add_(0, ids, torch.ones_like(ids))
    padded = (counts + block_m - 1) // block_m * block_m
    ends = padded.cumsum(0)
    order = torch.argsort(ids, stable=True)
    sorted_e = ids[order]
    rank = torch.arange(numel, device=dev) - (counts.cumsum(0) - counts)[sorted_e]
    sorted_ids = torch.full((max_padded,), numel, dtype=torch.int32, device=dev)
    sorted_ids.scatter_(0, (ends - padded)[sorted_e] + rank, order.to(torch.int32))
    block_starts = torch.arange(0, max_padded, block_m, device=dev)
    owner = torch.searchsorted(ends, block_starts, right=True)
    expert_ids = torch.where(owner >= num_experts, -1, owner).to(torch.int32)
    return sorted_ids, expert_ids, ends[-1:].to(torch.int32)


def moe_align_block_size(topk_ids: torch.Tensor, block_m: int, num_experts: int,
                         ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """topk_ids [T, k] -> (sorted_token_ids [P] int32, expert_ids [P / block_m] int32,
    num_tokens_post_padded [1] int32), P = max_num_tokens_padded(T*k, E, block_m).
    sorted_token_ids lists the pairs i = t*k + j expert by expert (id -1 last), in pair order
    within an expert, each expert's run padded with T*k to whole blocks; slots past
    num_tokens_post_padded are padding too, and their blocks' expert id is -1."""
    flat = topk_ids.reshape(-1)
    numel, dev = flat.numel(), flat.device
    if not runs_triton(_moe_align_kernel, flat):
        return moe_align_block_size_ref(topk_ids, block_m, num_experts)
    max_padded = max_num_tokens_padded(numel, num_experts, block_m)
    sorted_ids = torch.empty(max_padded, dtype=torch.int32, device=dev)
    expert_ids = torch.empty(max_padded // block_m, dtype=torch.int32, device=dev)
    num_post = torch.empty(1, dtype=torch.int32, device=dev)
    buckets = triton.next_power_of_2(num_experts + 1)
    shape = dict(NUM_EXPERTS=num_experts, BUCKETS_POW2=buckets)
    if numel <= ALIGN_MAX_PAIRS_ONE_PROGRAM:
        # a decode batch's few pairs in one narrow step ([16, E] one-hots, not [64, E])
        chunk = min(_ALIGN_CHUNK, max(16, triton.next_power_of_2(numel)))
        _moe_align_kernel[(1,)](flat, sorted_ids, expert_ids, num_post, numel, max_padded, **shape,
                                BLOCK_M=block_m, CHUNK=chunk, FILL=_ALIGN_FILL, num_warps=4)
        return sorted_ids, expert_ids, num_post
    chunks = triton.cdiv(numel, _ALIGN_CHUNK)
    counts = torch.empty((chunks, buckets), dtype=torch.int32, device=dev)
    offsets = torch.empty_like(counts)
    totals = torch.empty(buckets, dtype=torch.int32, device=dev)
    _moe_align_count_kernel[(chunks,)](flat, counts, sorted_ids, numel, max_padded, **shape, CHUNK=_ALIGN_CHUNK,
                                       FILL=_ALIGN_FILL, num_warps=4)
    _moe_align_scan_kernel[(buckets,)](counts, offsets, totals, chunks, BUCKETS_POW2=buckets,
                                       SCAN=min(1024, triton.next_power_of_2(chunks)), num_warps=4)
    _moe_align_scatter_kernel[(chunks,)](flat, offsets, totals, sorted_ids, expert_ids, num_post, numel, max_padded,
                                         **shape, BLOCK_M=block_m, CHUNK=_ALIGN_CHUNK, num_warps=4)
    return sorted_ids, expert_ids, num_post


@step_jit(ints=("EM", "num_valid"))
def _fused_moe_gemm_kernel(a_ptr, b_ptr, c_ptr, bias_ptr, topk_weights_ptr, sorted_ids_ptr, expert_ids_ptr,
                           num_post_ptr, N, K, EM, num_valid, stride_am, stride_be, stride_bn, stride_cm,
                           stride_bias_e,
                           A_ROW_DIV: tl.constexpr, GATED: tl.constexpr, ACTIVATION: tl.constexpr,
                           HAS_BIAS: tl.constexpr, MUL_ROUTED_WEIGHT: tl.constexpr, EVEN_K: tl.constexpr,
                           DOT_PRECISION: tl.constexpr,
                           BLOCK_SIZE_M: tl.constexpr, BLOCK_SIZE_N: tl.constexpr, BLOCK_SIZE_K: tl.constexpr,
                           GROUP_SIZE_M: tl.constexpr):
    """C[pair] = epilogue(A[pair // A_ROW_DIV] @ B[expert]^T) for the pairs of one BLOCK_SIZE_M
    block of sorted_ids (one expert) and one tile of N. B [E, N', K] with K contiguous (w13 or
    w2). GATED (gate/up): N = I output columns, the tile's up columns sit N rows below its gate
    columns in B, and the epilogue is the activation (ACTIVATION 0 SwiGLU, 1 swigluoai).
    DOT_PRECISION "ieee" for fp32 inputs: full precision (not TF32), as the reference.
    An expert id of -1: GATED skips the block, else it is written as zeros."""
    TILE_N: tl.constexpr = BLOCK_SIZE_N // 2 if GATED else BLOCK_SIZE_N
    pid = tl.program_id(0)
    num_pid_m = tl.cdiv(EM, BLOCK_SIZE_M)
    num_pid_n = tl.cdiv(N, TILE_N)
    # grouped ordering: GROUP_SIZE_M row blocks share their B tiles in L2
    num_pid_in_group = GROUP_SIZE_M * num_pid_n
    first_pid_m = (pid // num_pid_in_group) * GROUP_SIZE_M
    group_size_m = min(num_pid_m - first_pid_m, GROUP_SIZE_M)
    pid_m = first_pid_m + ((pid % num_pid_in_group) % group_size_m)
    pid_n = (pid % num_pid_in_group) // group_size_m
    if pid_m * BLOCK_SIZE_M >= tl.load(num_post_ptr):
        return
    offs_pair = tl.load(sorted_ids_ptr + pid_m * BLOCK_SIZE_M + tl.arange(0, BLOCK_SIZE_M)).to(tl.int64)
    pair_mask = offs_pair < num_valid
    expert = tl.load(expert_ids_ptr + pid_m).to(tl.int64)
    offs_cn = pid_n * TILE_N + tl.arange(0, TILE_N)
    c_ptrs = c_ptr + offs_pair[:, None] * stride_cm + offs_cn[None, :]
    c_mask = pair_mask[:, None] & (offs_cn[None, :] < N)
    if expert == -1:
        if not GATED:
            tl.store(c_ptrs, tl.zeros((BLOCK_SIZE_M, TILE_N), dtype=c_ptr.dtype.element_ty), mask=c_mask)
        return
    # B's rows wrap modulo N (in range, so the loads need no N mask; the store masks them)
    offs_bn = (pid_n * TILE_N + tl.arange(0, TILE_N).to(tl.int64)) % N
    offs_k = tl.arange(0, BLOCK_SIZE_K)
    a_ptrs = a_ptr + (offs_pair[:, None] // A_ROW_DIV) * stride_am + offs_k[None, :]
    b_ptrs = b_ptr + expert * stride_be + offs_bn[None, :] * stride_bn + offs_k[:, None]
    acc = tl.zeros((BLOCK_SIZE_M, TILE_N), dtype=tl.float32)
    if GATED:
        acc_up = tl.zeros((BLOCK_SIZE_M, TILE_N), dtype=tl.float32)
    for kb in range(0, tl.cdiv(K, BLOCK_SIZE_K)):
        if EVEN_K:
            a = tl.load(a_ptrs, mask=pair_mask[:, None], other=0.0)
            b = tl.load(b_ptrs)
        else:
            k_left = K - kb * BLOCK_SIZE_K
            a = tl.load(a_ptrs, mask=pair_mask[:, None] & (offs_k[None, :] < k_left), other=0.0)
            b = tl.load(b_ptrs, mask=offs_k[:, None] < k_left, other=0.0)
        acc = tl.dot(a, b, acc=acc, input_precision=DOT_PRECISION)
        if GATED:
            if EVEN_K:
                b_up = tl.load(b_ptrs + N * stride_bn)
            else:
                b_up = tl.load(b_ptrs + N * stride_bn, mask=offs_k[:, None] < k_left, other=0.0)
            acc_up = tl.dot(a, b_up, acc=acc_up, input_precision=DOT_PRECISION)
        a_ptrs += BLOCK_SIZE_K
        b_ptrs += BLOCK_SIZE_K
    out_ty = c_ptr.dtype.element_ty
    if HAS_BIAS:
        bias_ptrs = bias_ptr + expert * stride_bias_e + offs_bn
        acc += tl.load(bias_ptrs).to(tl.float32)[None, :]
        if GATED:
            acc_up += tl.load(bias_ptrs + N).to(tl.float32)[None, :]
    if GATED:
        # the reference's roundings: gate and up in the model dtype (its matmul's output), and
        # SiLU's result rounded before the product (kernels/activation.py)
        gate = acc.to(out_ty).to(tl.float32)
        up = acc_up.to(out_ty).to(tl.float32)
        if ACTIVATION == 0:
            act = (gate / (1.0 + tl.exp(-gate))).to(out_ty).to(tl.float32)
            acc = act * up
        else:
            gate = tl.minimum(gate, 7.0)                    # SWIGLUOAI_LIMIT
            up = tl.minimum(tl.maximum(up, -7.0), 7.0)
            acc = (up + 1.0) * (gate / (1.0 + tl.exp(-1.702 * gate)))   # SWIGLUOAI_ALPHA
    if MUL_ROUTED_WEIGHT:
        acc = acc.to(out_ty).to(tl.float32)  # the reference rounds the expert's output, then weights it
        acc = acc * tl.load(topk_weights_ptr + offs_pair, mask=pair_mask, other=0.0).to(tl.float32)[:, None]
    tl.store(c_ptrs, acc.to(out_ty), mask=c_mask)


# ----------------------------------------------------------------------------- small-batch GEMV path
# At a decode batch of a few tokens each chosen expert sees one token (rarely two): the grouped
# GEMM pads every expert's one row to a BLOCK_SIZE_M block (16x the MMA work, and the dot's
# shared-memory staging on the path of every weight byte) and needs the alignment launch and the
# top-k sum launch. The GEMV path reads the chosen experts' rows straight from HBM into registers
# with no sort, no padding and no extra launch: two kernels per layer (three with the router).
#
# 1. up: one program per (pair i = t*k + j, tile of BLOCK_N intermediate columns): the tile's gate
#    rows and up rows of expert ids[i] times token t's hidden row, act(gate, up) -> act[i].
# 2. down: one program per (token t, tile of BLOCK_N hidden columns): for each of its k pairs,
#    expert ids[t, j]'s down rows times act[t*k + j], bias, rounded to the model dtype (the
#    reference's rounding), times the routing weight, summed over j in fp32 and stored once.
#    The top-k sum stays inside the program: no atomics (deterministic, graph equal to eager),
#    no zeroed fp32 buffer, no moe_sum launch.
# Occupancy comes from narrow N tiles (H200 batch-1 GEMVs win with 4-8 rows x 2048-column tiles,
# kernels/gemv_tiles.json), not from splitting K: the activation needs a row's whole gate/up sum
# and the down sum needs no second pass, so neither kernel takes a split-K reduction.
# Products accumulate per k lane ([BLOCK_N, BLOCK_K]) and are summed over k once after the loop.


@dataclass(frozen=True)
class MoeGemvConfig:
    """Tiles of the small-batch GEMV path: the up kernel's BLOCK_N intermediate columns (each of
    gate and up) by BLOCK_K hidden columns; the down kernel's BLOCK_N hidden columns by BLOCK_K
    intermediate columns of each of a token's k experts at top-8 (top-k below 8 takes 8 / k
    times as many, so that one step loads the same bytes: Mixtral's top-2 would otherwise read
    its 14,336-wide rows 4 KB per step); each kernel's warps."""
    # the H200's best of bench/moe_decode.py's variants at Qwen3-30B-A3B's layer (session 35): 25.2 /
    # 43.0 / 76.7 us at 1 / 2 / 4 tokens, against 28.7 / 52.2 / 96.1 with 4,2048,4,256,8
    UP_BLOCK_N: int = 2
    UP_BLOCK_K: int = 2048
    DOWN_BLOCK_N: int = 2
    DOWN_BLOCK_K: int = 256
    num_warps: int = 4

    def fitted(self, hidden: int, intermediate: int, top_k: int = 8) -> "MoeGemvConfig":
        """The down K tile scaled to top_k, and K tiles no wider than the (power-of-two rounded)
        K they walk."""
        down_k = self.DOWN_BLOCK_K * max(1, 8 // triton.next_power_of_2(top_k))
        return MoeGemvConfig(self.UP_BLOCK_N, min(self.UP_BLOCK_K, triton.next_power_of_2(hidden)),
                             self.DOWN_BLOCK_N, min(down_k, triton.next_power_of_2(intermediate)),
                             self.num_warps)

    @classmethod
    def parse(cls, text: str) -> "MoeGemvConfig":
        """"UP_BLOCK_N,UP_BLOCK_K,DOWN_BLOCK_N,DOWN_BLOCK_K,num_warps" (LOOM_MOE_GEMV_TILES)."""
        parts = [int(p) for p in text.split(",")]
        if len(parts) != 5 or any(p < 1 or p & (p - 1) for p in parts):
            raise ValueError(f"LOOM_MOE_GEMV_TILES={text!r}: want five powers of two "
                             "(UP_BLOCK_N,UP_BLOCK_K,DOWN_BLOCK_N,DOWN_BLOCK_K,num_warps)")
        return cls(*parts)


_gemv_max_tokens: int | None = None   # LOOM_MOE_GEMV_MAX_TOKENS, read at the first call
_gemv_tiles: MoeGemvConfig | None = None   # LOOM_MOE_GEMV_TILES, read at the first call


def default_gemv_config() -> MoeGemvConfig:
    """The GEMV path's tiles: LOOM_MOE_GEMV_TILES, else MoeGemvConfig's defaults."""
    global _gemv_tiles
    if _gemv_tiles is None:
        text = envs.LOOM_MOE_GEMV_TILES
        _gemv_tiles = MoeGemvConfig.parse(text) if text else MoeGemvConfig()
    return _gemv_tiles


def gemv_max_tokens() -> int:
    """Up to this many tokens fused_moe takes the GEMV path (LOOM_MOE_GEMV_MAX_TOKENS, 0: never)."""
    global _gemv_max_tokens
    if _gemv_max_tokens is None:
        _gemv_max_tokens = envs.LOOM_MOE_GEMV_MAX_TOKENS
    return _gemv_max_tokens


def set_gemv_max_tokens(n: int | None) -> int | None:
    """Override LOOM_MOE_GEMV_MAX_TOKENS (tests, A/B runs; None: read it again); returns the
    setting it replaces."""
    global _gemv_max_tokens
    before, _gemv_max_tokens = _gemv_max_tokens, n
    return before


@triton.jit
def _act(gate, up, ACTIVATION: tl.constexpr, out_ptr):
    """act(gate, up) in fp32 from fp32 sums, with the reference's roundings in out_ptr's dtype
    (see the grouped GEMM)."""
    out_ty = out_ptr.dtype.element_ty
    gate = gate.to(out_ty).to(tl.float32)
    up = up.to(out_ty).to(tl.float32)
    if ACTIVATION == 0:
        out = (gate / (1.0 + tl.exp(-gate))).to(out_ty).to(tl.float32) * up
    else:
        gate = tl.minimum(gate, 7.0)                    # SWIGLUOAI_LIMIT
        up = tl.minimum(tl.maximum(up, -7.0), 7.0)
        out = (up + 1.0) * (gate / (1.0 + tl.exp(-1.702 * gate)))   # SWIGLUOAI_ALPHA
    return out


@triton.jit
def _moe_gemv_up_kernel(x_ptr, w_ptr, bias_ptr, ids_ptr, act_ptr, N, K, stride_x, stride_we, stride_wn,
                        stride_bias_e, stride_act,
                        TOP_K: tl.constexpr, ACTIVATION: tl.constexpr, HAS_BIAS: tl.constexpr,
                        BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PDL: tl.constexpr):
    """act[i, n] = act(w13[e, n] . x[i // TOP_K], w13[e, N + n] . x[i // TOP_K]), e = ids[i], for
    the program's BLOCK_N columns n; nothing for e = -1 (another rank's expert)."""
    pair = tl.program_id(0)
    pdl_wait(PDL)   # the ids are the router's output
    expert = tl.load(ids_ptr + pair).to(tl.int64)
    if expert < 0:
        return
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < N
    offs_k = tl.arange(0, BLOCK_K)
    gate_rows = w_ptr + expert * stride_we + offs_n.to(tl.int64)[:, None] * stride_wn
    up_rows = gate_rows + N * stride_wn
    x_row = x_ptr + (pair // TOP_K).to(tl.int64) * stride_x
    acc_gate = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    acc_up = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        kk = k0 + offs_k
        k_ok = kk < K
        x = tl.load(x_row + kk, mask=k_ok, other=0.0).to(tl.float32)[None, :]
        mask = n_ok[:, None] & k_ok[None, :]
        acc_gate += tl.load(gate_rows + kk[None, :], mask=mask, other=0.0).to(tl.float32) * x
        acc_up += tl.load(up_rows + kk[None, :], mask=mask, other=0.0).to(tl.float32) * x
    gate = tl.sum(acc_gate, 1)
    up = tl.sum(acc_up, 1)
    if HAS_BIAS:
        gate += tl.load(bias_ptr + expert * stride_bias_e + offs_n, mask=n_ok, other=0.0).to(tl.float32)
        up += tl.load(bias_ptr + expert * stride_bias_e + N + offs_n, mask=n_ok, other=0.0).to(tl.float32)
    tl.store(act_ptr + pair.to(tl.int64) * stride_act + offs_n,
             _act(gate, up, ACTIVATION, act_ptr).to(act_ptr.dtype.element_ty), mask=n_ok)


@triton.jit
def _moe_gemv_down_kernel(act_ptr, w_ptr, bias_ptr, ids_ptr, weights_ptr, out_ptr, N, K, stride_act, stride_we,
                          stride_wn, stride_bias_e, stride_out,
                          TOP_K: tl.constexpr, K_POW2: tl.constexpr, HAS_BIAS: tl.constexpr,
                          BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PDL: tl.constexpr):
    """out[t, n] = sum over j of weights[t, j] * round(w2[e, n] . act[t*TOP_K + j] + b2[e, n]),
    e = ids[t, j] (skipped when -1), for the program's BLOCK_N columns n; fp32 sum, one rounding.
    The token's k experts are one [K_POW2, BLOCK_N, BLOCK_K] tile, so all their loads issue at
    once and one reduction follows (a loop over j reduced after each expert's loads: eight
    serial memory round trips). "This rank's expert" masks rows (dims 0-1), never K, so the
    loads along K stay vectorized, and another rank's expert reads nothing."""
    t = tl.program_id(0).to(tl.int64)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < N
    offs_k = tl.arange(0, BLOCK_K)
    offs_j = tl.arange(0, K_POW2)
    pair = t * TOP_K + offs_j
    # Under PDL this kernel starts while the up kernel runs. The ids and routing weights are the
    # router's (complete before the up kernel let this one launch) and the weights constant, so
    # the first weight tile loads before the wait; act, the up kernel's output, only after it.
    expert = tl.load(ids_ptr + pair, mask=offs_j < TOP_K, other=-1).to(tl.int64)
    mine = expert >= 0
    route_w = tl.load(weights_ptr + pair, mask=mine, other=0.0).to(tl.float32)
    rows = w_ptr + tl.maximum(expert, 0)[:, None, None] * stride_we + offs_n.to(tl.int64)[None, :, None] * stride_wn
    rows_ok = mine[:, None, None] & n_ok[None, :, None]
    act_rows = act_ptr + pair[:, None] * stride_act
    w_first = tl.load(rows + offs_k[None, None, :], mask=rows_ok & (offs_k < K)[None, None, :], other=0.0)
    pdl_wait(PDL)
    # another rank's pair: its act row was never written (masked off: garbage may be NaN)
    a = tl.load(act_rows + offs_k[None, :], mask=mine[:, None] & (offs_k < K)[None, :], other=0.0)
    acc = w_first.to(tl.float32) * a.to(tl.float32)[:, None, :]
    for k0 in range(BLOCK_K, K, BLOCK_K):
        kk = k0 + offs_k
        w = tl.load(rows + kk[None, None, :], mask=rows_ok & (kk < K)[None, None, :], other=0.0)
        a = tl.load(act_rows + kk[None, :], mask=mine[:, None] & (kk < K)[None, :], other=0.0)
        acc += w.to(tl.float32) * a.to(tl.float32)[:, None, :]
    y = tl.sum(acc, 2)    # [K_POW2, BLOCK_N]
    if HAS_BIAS:
        y += tl.load(bias_ptr + tl.maximum(expert, 0)[:, None] * stride_bias_e + offs_n[None, :],
                     mask=mine[:, None] & n_ok[None, :], other=0.0).to(tl.float32)
    out_ty = out_ptr.dtype.element_ty
    total = tl.sum(y.to(out_ty).to(tl.float32) * route_w[:, None], 0)
    tl.store(out_ptr + t * stride_out + offs_n, total.to(out_ty), mask=n_ok)


def fused_moe_gemv(hidden: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
                   topk_ids: torch.Tensor, *, w13_bias: torch.Tensor | None = None,
                   w2_bias: torch.Tensor | None = None, activation: str = "silu",
                   config: MoeGemvConfig | None = None) -> torch.Tensor:
    """fused_moe_ref's result by the small-batch GEMV path (two launches, no alignment, no host
    sync); any token count is correct, a few tokens are what it is fast at."""
    check_activation(activation)
    t, h = hidden.shape
    k = topk_ids.shape[1]
    inter = w13.shape[1] // 2
    if t == 0:
        return hidden.new_zeros((0, h))
    assert w13.stride(2) == 1 and w2.stride(2) == 1, "fused_moe_gemv: K must be contiguous"
    cfg = (config or default_gemv_config()).fitted(h, inter, k)
    x = hidden if hidden.stride(1) == 1 else hidden.contiguous()
    ids = topk_ids.reshape(-1).contiguous()
    weights = topk_weights.reshape(-1).float().contiguous()
    act = torch.empty((t * k, inter), dtype=hidden.dtype, device=hidden.device)
    pdl = pdl_args(hidden)
    _moe_gemv_up_kernel[(t * k, triton.cdiv(inter, cfg.UP_BLOCK_N))](
        x, w13, w13 if w13_bias is None else w13_bias, ids, act, inter, h, x.stride(0), w13.stride(0),
        w13.stride(1), 0 if w13_bias is None else w13_bias.stride(0), act.stride(0),
        TOP_K=k, ACTIVATION=ACTIVATIONS.index(activation), HAS_BIAS=w13_bias is not None,
        BLOCK_N=cfg.UP_BLOCK_N, BLOCK_K=cfg.UP_BLOCK_K, num_warps=cfg.num_warps, **pdl)
    out = torch.empty((t, h), dtype=hidden.dtype, device=hidden.device)
    _moe_gemv_down_kernel[(t, triton.cdiv(h, cfg.DOWN_BLOCK_N))](
        act, w2, w2 if w2_bias is None else w2_bias, ids, weights, out, h, inter, act.stride(0), w2.stride(0),
        w2.stride(1), 0 if w2_bias is None else w2_bias.stride(0), out.stride(0),
        TOP_K=k, K_POW2=triton.next_power_of_2(k), HAS_BIAS=w2_bias is not None, BLOCK_N=cfg.DOWN_BLOCK_N,
        BLOCK_K=cfg.DOWN_BLOCK_K,
        num_warps=cfg.num_warps, **pdl)
    return out


# ----------------------------------------------------------------------------- tile configs
CONFIG_DIR = Path(__file__).with_name("fused_moe_configs")


@dataclass(frozen=True)
class MoeTileConfig:
    """One tile configuration of both grouped GEMMs (vLLM's JSON keys). BLOCK_SIZE_N is the
    tile's width in the GEMM's output columns before the activation (gate/up: half gate,
    half up), so a tile of either GEMM holds BLOCK_SIZE_M x BLOCK_SIZE_N accumulators."""
    BLOCK_SIZE_M: int
    BLOCK_SIZE_N: int
    BLOCK_SIZE_K: int
    GROUP_SIZE_M: int
    num_warps: int
    num_stages: int

    def to_json(self) -> dict:
        return asdict(self)


# Untuned shapes. Decode-sized batches (a few tokens per expert) are weight-bandwidth bound:
# 16-row blocks waste the least on padding and narrow tiles spread the weights over every SM.
# Prefill-sized ones are compute bound: 64 x 128 tiles reuse each loaded tile across more
# rows, and grouped ordering keeps an expert's weight tiles in L2 across its row blocks.
DECODE_CONFIG = MoeTileConfig(BLOCK_SIZE_M=16, BLOCK_SIZE_N=64, BLOCK_SIZE_K=128, GROUP_SIZE_M=1,
                              num_warps=4, num_stages=3)
PREFILL_CONFIG = MoeTileConfig(BLOCK_SIZE_M=64, BLOCK_SIZE_N=128, BLOCK_SIZE_K=64, GROUP_SIZE_M=8,
                               num_warps=4, num_stages=3)
DECODE_TOKENS_PER_EXPERT = 16


def vllm_default_config(num_tokens: int, num_experts: int) -> MoeTileConfig:
    """vLLM's get_default_config for bf16 when no tuned file exists (the baseline of issue 45's
    "tuned >= 1.15x the default at 512 tokens"): 16 x 32 x 64 tiles up to E tokens, else
    64 x 64 x 32 with GROUP_SIZE_M 8; Triton's default 4 warps and 3 stages."""
    if num_tokens <= num_experts:
        return MoeTileConfig(BLOCK_SIZE_M=16, BLOCK_SIZE_N=32, BLOCK_SIZE_K=64, GROUP_SIZE_M=1, num_warps=4,
                             num_stages=3)
    return MoeTileConfig(BLOCK_SIZE_M=64, BLOCK_SIZE_N=64, BLOCK_SIZE_K=32, GROUP_SIZE_M=8, num_warps=4,
                         num_stages=3)


def default_config(num_tokens: int, num_experts: int, top_k: int) -> MoeTileConfig:
    """The untuned choice by the mean tokens per expert (T * k / E)."""
    return DECODE_CONFIG if num_tokens * top_k <= DECODE_TOKENS_PER_EXPERT * num_experts else PREFILL_CONFIG


def dtype_name(dtype: torch.dtype) -> str:
    return {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}[dtype]


def device_name(device: torch.device) -> str:
    """vLLM's spelling of the GPU in config file names: "NVIDIA_H200"."""
    return torch.cuda.get_device_name(device).replace(" ", "_")


def config_file_name(num_experts: int, intermediate: int, dtype: torch.dtype, device: str) -> str:
    """vLLM's key (E experts, N the intermediate size per rank), with the dtype always named."""
    return f"E={num_experts},N={intermediate},device_name={device},dtype={dtype_name(dtype)}.json"


@functools.lru_cache(maxsize=None)
def load_configs(file_name: str) -> dict[int, MoeTileConfig] | None:
    """A tuned file: token count -> config (bench/tune_moe.py writes them), or None."""
    path = CONFIG_DIR / file_name
    if not path.exists():
        return None
    return {int(m): MoeTileConfig(**cfg) for m, cfg in json.loads(path.read_text()).items()}


@functools.lru_cache(maxsize=4096)  # every MoE layer of every step asks: answer from a dict
def get_config(num_tokens: int, num_experts: int, intermediate: int, top_k: int, dtype: torch.dtype,
               device: torch.device) -> MoeTileConfig:
    """The tuned config of the nearest token count for this GPU and shape, else the default."""
    if device.type == "cuda":
        tuned = load_configs(config_file_name(num_experts, intermediate, dtype, device_name(device)))
        if tuned:
            return nearest_config(tuned, num_tokens)
    return default_config(num_tokens, num_experts, top_k)


def nearest_config(tuned: dict[int, MoeTileConfig], num_tokens: int) -> MoeTileConfig:
    """The config of the tuned token count nearest num_tokens (the smaller one on a tie)."""
    return tuned[min(sorted(tuned), key=lambda m: abs(m - num_tokens))]


# ----------------------------------------------------------------------------- entry point
def fused_moe(hidden: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
              topk_ids: torch.Tensor, *, w13_bias: torch.Tensor | None = None, w2_bias: torch.Tensor | None = None,
              activation: str = "silu", config: MoeTileConfig | None = None,
              gemv: MoeGemvConfig | None = None) -> torch.Tensor:
    """fused_moe_ref's result from the Triton kernels (its torch reference where Triton does not
    run). No host sync: CUDA graphs capture it. Up to gemv_max_tokens() tokens (a decode batch)
    it takes the GEMV path, else the grouped GEMMs; the choice depends on the token count only,
    which a CUDA graph fixes. config: the grouped GEMMs with this tile config (tuning); gemv:
    the GEMV path with these tiles (A/B runs)."""
    check_activation(activation)
    if not runs_triton(_fused_moe_gemm_kernel, hidden):
        return fused_moe_ref(hidden, w13, w2, topk_weights, topk_ids, w13_bias=w13_bias, w2_bias=w2_bias,
                             activation=activation)
    t, h = hidden.shape
    if gemv is not None or (config is None and t <= gemv_max_tokens()):
        return fused_moe_gemv(hidden, w13, w2, topk_weights, topk_ids, w13_bias=w13_bias, w2_bias=w2_bias,
                              activation=activation, config=gemv)
    num_experts, two_i, _ = w13.shape
    k = topk_ids.shape[1]
    if t == 0:
        return hidden.new_zeros((0, h))
    cfg = config or get_config(t, num_experts, two_i // 2, k, hidden.dtype, hidden.device)
    sorted_ids, expert_ids, num_post = moe_align_block_size(topk_ids, cfg.BLOCK_SIZE_M, num_experts)
    routing = (sorted_ids, expert_ids, num_post, t * k)
    act = torch.empty((t * k, two_i // 2), dtype=hidden.dtype, device=hidden.device)
    _grouped_gemm(hidden.contiguous(), w13, act, w13_bias, None, routing, cfg, a_row_div=k, activation=activation)
    out = torch.empty((t * k, h), dtype=hidden.dtype, device=hidden.device)
    _grouped_gemm(act, w2, out, w2_bias, topk_weights.reshape(-1).float().contiguous(), routing, cfg,
                  a_row_div=1, activation=None)
    return out.view(t, k, h).sum(dim=1)


def _grouped_gemm(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor, bias: torch.Tensor | None,
                  topk_weights: torch.Tensor | None, routing: tuple, cfg: MoeTileConfig, *, a_row_div: int,
                  activation: str | None) -> None:
    """One launch of _fused_moe_gemm_kernel: gate/up with `activation` fused (b = w13), or down
    with the routing weights (b = w2, activation None)."""
    sorted_ids, expert_ids, num_post, num_valid = routing
    assert b.stride(2) == 1 and a.stride(1) == 1, "fused_moe: K must be contiguous"
    gated = activation is not None
    n, kdim = (b.shape[1] // 2 if gated else b.shape[1]), b.shape[2]
    tile_n = cfg.BLOCK_SIZE_N // 2 if gated else cfg.BLOCK_SIZE_N
    em = sorted_ids.numel()
    grid = (triton.cdiv(em, cfg.BLOCK_SIZE_M) * triton.cdiv(n, tile_n),)
    _fused_moe_gemm_kernel[grid](
        a, b, c, b if bias is None else bias, c if topk_weights is None else topk_weights, sorted_ids, expert_ids,
        num_post, n, kdim, em, num_valid, a.stride(0), b.stride(0), b.stride(1), c.stride(0),
        0 if bias is None else bias.stride(0),
        A_ROW_DIV=a_row_div, GATED=gated, ACTIVATION=ACTIVATIONS.index(activation or "silu"),
        HAS_BIAS=bias is not None, MUL_ROUTED_WEIGHT=topk_weights is not None,
        EVEN_K=kdim % cfg.BLOCK_SIZE_K == 0, DOT_PRECISION="ieee" if a.dtype == torch.float32 else "tf32",
        BLOCK_SIZE_M=cfg.BLOCK_SIZE_M, BLOCK_SIZE_N=cfg.BLOCK_SIZE_N, BLOCK_SIZE_K=cfg.BLOCK_SIZE_K,
        GROUP_SIZE_M=cfg.GROUP_SIZE_M, num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
