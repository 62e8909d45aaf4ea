"""One-shot all-gather over symmetric memory: the logits of a small decode batch.

Under tensor parallelism the lm_head is split by vocabulary, and every rank needs all the
logits (each samples the same tokens from the same seeds). NCCL's all-gather of one row of
Llama-3.1-8B's logits (2 x 128 KB) takes ~10 us in a CUDA graph. Here the lm_head writes its
part straight into a buffer in symmetric memory, and one kernel, launched under PDL, reads
every rank's part over NVLink into the whole row:

1. each program (a row, BLOCK columns of every part) tells the peers that this rank's part is
   written and waits for theirs (`peer_barrier`, the flags of kernels/allreduce_norm.py);
2. it copies the columns from every rank's buffer into the output, in rank order, and drops
   the padding past the vocabulary.

There is no closing barrier: a rank writes its buffer again only at the next step's lm_head,
after the layers' all-reduces, each of which every peer enters only once it has finished
this gather.

`all_gather_ref` is the torch reference.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.allreduce_norm import peer_barrier
from kernels.jit import pdl_args, pdl_wait

BLOCK = 2048  # columns per program: 32 programs per row of a 64K-column part


def all_gather_ref(parts: list[torch.Tensor], n_out: int) -> torch.Tensor:
    """parts: every rank's [rows, part], in rank order -> [rows, n_out], side by side, the
    columns past n_out (the vocabulary's padding) dropped."""
    return torch.cat(parts, dim=-1)[:, :n_out].contiguous()


@triton.jit
def _all_gather_kernel(buf_ptrs, flag_ptrs, out_ptr, part, n_out, rank,
                       WORLD: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr):
    """buf_ptrs / flag_ptrs: int64 [WORLD], the address of every rank's [rows, part] buffer
    and of its flags (int32 [programs, WORLD])."""
    row = tl.program_id(0)
    block = tl.program_id(1)
    pdl_wait(PDL)  # this rank's part is written; the next kernel may launch
    peer_barrier(flag_ptrs, row * tl.num_programs(1) + block, rank, WORLD)
    offs = block * BLOCK + tl.arange(0, BLOCK)
    mask = offs < part
    for r in tl.static_range(WORLD):
        src = tl.load(buf_ptrs + r).to(tl.pointer_type(out_ptr.dtype.element_ty))
        vals = tl.load(src + row.to(tl.int64) * part + offs, mask=mask)
        col = r * part + offs
        tl.store(out_ptr + row.to(tl.int64) * n_out + col, vals, mask=mask & (col < n_out))


def flag_cells(rows: int, part: int) -> int:
    """The flags (per rank and peer) a call over [rows, part] uses: one per program."""
    return rows * triton.cdiv(part, BLOCK)


def all_gather(buf_ptrs: torch.Tensor, flag_ptrs: torch.Tensor, rank: int, rows: int, part: int, n_out: int,
               like: torch.Tensor) -> torch.Tensor:
    """Every rank's [rows, part] buffer (buf_ptrs: their addresses, int64 [W] on the device)
    side by side -> a new [rows, n_out] tensor of like's dtype and device. flag_ptrs: every
    rank's int32 flags, at least flag_cells(rows, part) x W, zero between calls. Every rank
    of the group must make the same call."""
    world = buf_ptrs.numel()
    assert part * (world - 1) < n_out <= part * world
    out = torch.empty((rows, n_out), dtype=like.dtype, device=like.device)
    if rows == 0:
        return out
    _all_gather_kernel[(rows, triton.cdiv(part, BLOCK))](
        buf_ptrs, flag_ptrs, out, part, n_out, rank, WORLD=world, BLOCK=BLOCK, num_warps=8, **pdl_args(like))
    return out
