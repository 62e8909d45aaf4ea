"""The vocab-parallel embedding lookup of one rank, in one kernel.

Under tensor parallelism each rank holds the rows [start, start + part) of the embedding
table. A token whose id lies in another rank's rows gets a zero row here, so that the sum
over the ranks is the whole lookup. In torch that is seven small kernels (the shift, three
comparisons, two masked fills and the gather), each costing a small kernel's fixed ~2-3 us
(bench/RESULTS.md, session 7) on a batch-1 decode step's critical path; this kernel is one,
launched under PDL, and it can write straight into the all-reduce's symmetric buffer
(workers/distributed.py, all_reduce_written).

`vocab_parallel_embedding_ref` is the torch reference.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from kernels.jit import pdl_args, pdl_wait, runs_triton, step_jit


def vocab_parallel_embedding_ref(ids: torch.Tensor, weight: torch.Tensor, start: int) -> torch.Tensor:
    """ids [T] -> [T, H]: weight[id - start] where that row is this rank's, zeros elsewhere."""
    local = ids - start
    outside = (local < 0) | (local >= weight.shape[0])
    out = F.embedding(local.masked_fill(outside, 0), weight)
    return out.masked_fill_(outside.unsqueeze(-1), 0.0)


@step_jit(pointers=("ids_ptr",))
def _vocab_parallel_embedding_kernel(ids_ptr, w_ptr, out_ptr, start, part, n_cols,
                                     BLOCK: tl.constexpr, PDL: tl.constexpr):
    """One program per (token, BLOCK columns); the ids come from the step's input buffer (any
    alignment), so their pointer is not specialized."""
    token = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n_cols
    pdl_wait(PDL)  # the ids may be the kernel before's output
    local = tl.load(ids_ptr + token).to(tl.int64) - start
    mine = (local >= 0) & (local < part)
    readable = tl.where(mine, n_cols, 0)  # another rank's id: read nothing, store zeros
    row = tl.load(w_ptr + local * n_cols + offs, mask=offs < readable, other=0.0)
    tl.store(out_ptr + token * n_cols + offs, row, mask=mask)


def vocab_parallel_embedding(ids: torch.Tensor, weight: torch.Tensor, start: int,
                             out: torch.Tensor | None = None) -> torch.Tensor:
    """ids [T] -> [T, H] as the reference, into `out` ([T, H], contiguous) when given."""
    ids = ids.reshape(-1)
    rows, cols = ids.numel(), weight.shape[1]
    if not runs_triton(_vocab_parallel_embedding_kernel, weight):
        ref = vocab_parallel_embedding_ref(ids, weight, start)
        return ref if out is None else out.copy_(ref)
    assert weight.is_contiguous() and (out is None or (out.shape == (rows, cols) and out.is_contiguous()))
    if out is None:
        out = torch.empty((rows, cols), dtype=weight.dtype, device=weight.device)
    if rows == 0:
        return out
    block = min(1024, triton.next_power_of_2(cols))
    _vocab_parallel_embedding_kernel[(rows, triton.cdiv(cols, block))](
        ids, weight, out, start, weight.shape[0], cols, BLOCK=block, num_warps=4, **pdl_args(weight))
    return out
