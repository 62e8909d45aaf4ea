"""Grammar bitmask: logits[rows[j], t] = -inf where bit t of bitmask[mask_rows[j]] is 0.

The bitmask is xgrammar's packed layout: int32 words, token t is bit t % 32 of
word t // 32 (1 = allowed). One launch for every constrained row of a step,
whatever their number; rows not listed are left as they are. Tokens past the
bitmask's width (none, when it covers the logits' vocabulary) are masked. Rows in
the same grammar state share one bitmask row (mask_rows), so a step sends each
distinct mask once. A mask row of -1 leaves its logits row as it is (an unconstrained
row of a decode graph's head, which masks every row it samples).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.jit import runs_triton, step_jit

_BLOCK = 1024


@step_jit(ints=("vocab", "logits_stride", "words"), pointers=("logits", "bitmask", "rows", "mask_rows"))
def _apply_bitmask_kernel(logits, logits_stride, bitmask, words, rows, mask_rows, vocab, BLOCK: tl.constexpr):
    j = tl.program_id(0)
    t = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    row = tl.load(rows + j).to(tl.int64)
    mask_row = tl.load(mask_rows + j).to(tl.int64)
    in_vocab = (t < vocab) & (t * 0 + mask_row >= 0)   # (as a vector: the interpreter refuses a scalar mask)
    word = tl.load(bitmask + mask_row * words + t // 32, mask=in_vocab & (t // 32 < words), other=0)
    allowed = ((word >> (t % 32)) & 1) != 0
    tl.store(logits + row * logits_stride + t, float("-inf"), mask=in_vocab & ~allowed)


def apply_bitmask_reference(logits: torch.Tensor, bitmask: torch.Tensor, rows: torch.Tensor,
                            mask_rows: torch.Tensor) -> None:
    vocab = logits.shape[-1]
    t = torch.arange(vocab, device=logits.device)
    words = bitmask.shape[-1]
    keep = mask_rows >= 0
    rows, mask_rows = rows[keep], mask_rows[keep]
    word = bitmask.long()[mask_rows.long()][:, (t // 32).clamp(max=words - 1)]
    allowed = ((word >> (t % 32)) & 1).bool() & (t // 32 < words)
    sub = logits.index_select(0, rows.long())
    logits.index_copy_(0, rows.long(), sub.masked_fill(~allowed, float("-inf")))


def apply_bitmask(logits: torch.Tensor, bitmask: torch.Tensor, rows: torch.Tensor,
                  mask_rows: torch.Tensor) -> None:
    """In place: mask logits[rows[j]] by bitmask[mask_rows[j]] (-1: not masked). logits [B, V]
    (row-major rows), bitmask int32 [M, ceil(V / 32)], rows and mask_rows int [R], all on logits' device.
    Never syncs: it runs inside a decode graph's head."""
    if not rows.numel():
        return
    if not runs_triton(_apply_bitmask_kernel, logits) or logits.stride(-1) != 1:
        apply_bitmask_reference(logits, bitmask, rows, mask_rows)
        return
    vocab = logits.shape[-1]
    grid = (rows.numel(), triton.cdiv(vocab, _BLOCK))
    _apply_bitmask_kernel[grid](logits, logits.stride(0), bitmask.contiguous(), bitmask.shape[-1], rows, mask_rows,
                                vocab, BLOCK=_BLOCK)
