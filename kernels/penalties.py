"""Logit adjustments before sampling, for every row of a step in one launch:
logit_bias, repetition / presence / frequency penalties, min_tokens.

Semantics (vLLM's order; the Triton kernel and the torch reference agree):

  l   = logits[b, v] as float32, + logit_bias[b][v] where given (ids >= V ignored)
  c   = output_counts[slots[b], v]       (how often the request generated v so far)
  rep = repetition_penalty[b]: where v is in the request's prompt (prompt_mask) or
        c > 0, l = l / rep if l > 0 else l * rep
  l   = l - frequency_penalty[b] * c
  l   = l - presence_penalty[b]  where c > 0
  -inf at the row's banned ids (eos / stop tokens while fewer than min_tokens
        tokens were generated; ids >= V ignored)

The per-request state (counts, prompt mask) lives on the device, one row per
persistent-batch slot; this kernel only reads it. Sparse inputs (bias, bans) are
[B, N] id tensors padded with -1. The output is a new float32 [B, V] tensor.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.jit import runs_triton, sm_count, step_jit

_BLOCK = 1024
_MAX_CHUNKS = 64


# --------------------------------------------------------------------------
# torch reference
# --------------------------------------------------------------------------
def apply_penalties_ref(logits: torch.Tensor, slots: torch.Tensor, counts: torch.Tensor, prompt_mask: torch.Tensor,
                        repetition: torch.Tensor, presence: torch.Tensor, frequency: torch.Tensor,
                        bias_ids: torch.Tensor, bias_vals: torch.Tensor, ban_ids: torch.Tensor) -> torch.Tensor:
    bsz, vocab = logits.shape
    out = logits.float().clone()
    rows = torch.arange(bsz, device=logits.device)[:, None]
    ok = (bias_ids >= 0) & (bias_ids < vocab)
    out[rows.expand_as(bias_ids)[ok], bias_ids[ok].long()] += bias_vals[ok].float()
    cnt = counts[slots.long()]
    seen = (cnt > 0) | (prompt_mask[slots.long()] != 0)
    rep = repetition.float()[:, None]
    penalized = torch.where(out > 0, out / rep, out * rep)
    out = torch.where(seen, penalized, out)  # rep == 1 divides and multiplies by one: exact
    out = out - frequency.float()[:, None] * cnt.float()
    out = out - torch.where(cnt > 0, presence.float()[:, None], torch.zeros_like(out))
    ok = (ban_ids >= 0) & (ban_ids < vocab)
    out[rows.expand_as(ban_ids)[ok], ban_ids[ok].long()] = float("-inf")
    return out


# --------------------------------------------------------------------------
# Triton
# --------------------------------------------------------------------------
@triton.jit
def _penalize(l, cnt, in_prompt, rep, pres, freq):
    seen = (cnt > 0) | in_prompt
    l = tl.where(seen, tl.where(l > 0, tl.math.div_rn(l, rep), l * rep), l)  # exact no-op at rep == 1
    l = l - freq * cnt.to(tl.float32)
    return l - tl.where(cnt > 0, pres, 0.0)


@step_jit(ints=("num_bias", "num_ban", "chunk"),
          pointers=("slot_ptr", "rep_ptr", "pres_ptr", "freq_ptr", "bias_id_ptr", "bias_val_ptr", "ban_ptr"))
def _penalties_kernel(in_ptr, stride_in, out_ptr, slot_ptr, counts_ptr, mask_ptr, stride_state,
                      rep_ptr, pres_ptr, freq_ptr, bias_id_ptr, bias_val_ptr, num_bias, ban_ptr, num_ban,
                      vocab, chunk, BLOCK: tl.constexpr):
    """Program (row, c): the row's tokens [c * chunk, (c + 1) * chunk)."""
    row = tl.program_id(0).to(tl.int64)
    lo = tl.program_id(1) * chunk
    hi = tl.minimum(lo + chunk, vocab)
    rep = tl.load(rep_ptr + row).to(tl.float32)
    pres = tl.load(pres_ptr + row).to(tl.float32)
    freq = tl.load(freq_ptr + row).to(tl.float32)
    state = tl.load(slot_ptr + row).to(tl.int64) * stride_state
    in_row = in_ptr + row * stride_in
    out_row = out_ptr + row * vocab
    if (rep != 1.0) | (pres != 0.0) | (freq != 0.0):
        for start in range(lo, hi, BLOCK):
            offs = start + tl.arange(0, BLOCK)
            msk = offs < hi
            l = tl.load(in_row + offs, mask=msk, other=0.0).to(tl.float32)
            cnt = tl.load(counts_ptr + state + offs, mask=msk, other=0)
            in_prompt = tl.load(mask_ptr + state + offs, mask=msk, other=0) != 0
            tl.store(out_row + offs, _penalize(l, cnt, in_prompt, rep, pres, freq), mask=msk)
    else:
        for start in range(lo, hi, BLOCK):
            offs = start + tl.arange(0, BLOCK)
            msk = offs < hi
            tl.store(out_row + offs, tl.load(in_row + offs, mask=msk, other=0.0).to(tl.float32), mask=msk)
    if (num_bias > 0) | (num_ban > 0):
        tl.debug_barrier()  # the sparse writes below land after this program's dense ones
        for j in range(num_bias):
            v = tl.load(bias_id_ptr + row * num_bias + j).to(tl.int64)
            if (v >= lo) & (v < hi):
                l = tl.load(in_row + v).to(tl.float32) + tl.load(bias_val_ptr + row * num_bias + j).to(tl.float32)
                cnt = tl.load(counts_ptr + state + v)
                in_prompt = tl.load(mask_ptr + state + v) != 0
                tl.store(out_row + v, _penalize(l, cnt, in_prompt, rep, pres, freq))
        tl.debug_barrier()
        for j in range(num_ban):
            v = tl.load(ban_ptr + row * num_ban + j).to(tl.int64)
            if (v >= lo) & (v < hi):
                tl.store(out_row + v, float("-inf"))


def apply_penalties(logits: torch.Tensor, slots: torch.Tensor, counts: torch.Tensor, prompt_mask: torch.Tensor,
                    repetition: torch.Tensor, presence: torch.Tensor, frequency: torch.Tensor,
                    bias_ids: torch.Tensor, bias_vals: torch.Tensor, ban_ids: torch.Tensor,
                    num_chunks: int | None = None) -> torch.Tensor:
    """logits [B, V] (any float dtype) -> adjusted float32 [B, V]. slots [B] int: each row's
    row of counts (int32 [S, V]) and prompt_mask (uint8 [S, V]); repetition / presence /
    frequency [B] float32 (1, 0, 0: off); bias_ids / ban_ids int32 [B, N] padded with -1,
    bias_vals float32 like bias_ids. One launch, no host sync."""
    if not runs_triton(_penalties_kernel, logits):
        return apply_penalties_ref(logits, slots, counts, prompt_mask, repetition, presence, frequency,
                                   bias_ids, bias_vals, ban_ids)
    bsz, vocab = logits.shape
    out = torch.empty((bsz, vocab), dtype=torch.float32, device=logits.device)
    if bsz == 0:
        return out
    if logits.stride(-1) != 1:
        logits = logits.contiguous()
    assert counts.stride() == prompt_mask.stride() and counts.stride(-1) == 1 and counts.shape[-1] == vocab
    if num_chunks is None:  # about four programs per SM however small the batch
        num_chunks = triton.cdiv(4 * sm_count(logits.device), bsz)
    num_chunks = max(1, min(num_chunks, _MAX_CHUNKS, triton.cdiv(vocab, _BLOCK)))
    chunk = triton.cdiv(triton.cdiv(vocab, num_chunks), _BLOCK) * _BLOCK
    num_chunks = triton.cdiv(vocab, chunk)
    bias_ids, bias_vals, ban_ids = bias_ids.contiguous(), bias_vals.contiguous(), ban_ids.contiguous()
    _penalties_kernel[(bsz, num_chunks)](
        logits, logits.stride(0), out, slots.contiguous(), counts, prompt_mask, counts.stride(0),
        repetition.contiguous(), presence.contiguous(), frequency.contiguous(),
        bias_ids, bias_vals, bias_ids.shape[1], ban_ids, ban_ids.shape[1], vocab, chunk,
        BLOCK=_BLOCK, num_warps=4)
    return out
