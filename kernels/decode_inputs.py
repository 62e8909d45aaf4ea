"""The first kernel of a decode CUDA graph: the step's input tokens and block table.

The host stages a decode step in one copy (workers/decode_graphs.py). Two of
its inputs are not final there:
- a row's input token may be the previous step's sampled token, which is still
  on the device (feed_src[row] >= 0: take tokens[feed_src[row]]; -1: the
  staged token);
- the block table comes as `width` columns per row, packed, and the graph's
  attention reads a table of fixed row stride: each row's first `width` entries
  are copied there (the entries past them are never read: a sequence's blocks
  all lie within its first ceil(seq_len / block_size) columns).
`width` is read on the device, so one captured graph serves every step.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.jit import runs_triton


def decode_inputs_ref(staged_ids: torch.Tensor, feed_src: torch.Tensor, tokens: torch.Tensor,
                      packed_table: torch.Tensor, width: torch.Tensor, ids_out: torch.Tensor,
                      table_out: torch.Tensor) -> None:
    fed = feed_src >= 0
    ids_out.copy_(torch.where(fed, tokens[feed_src.clamp(min=0)], staged_ids))
    w = int(width[0])
    rows = ids_out.shape[0]
    table_out[:rows, :w] = packed_table[:rows * w].view(rows, w)


@triton.jit
def _decode_inputs_kernel(staged_ids_ptr, feed_src_ptr, tokens_ptr, packed_ptr, width_ptr, ids_out_ptr,
                          table_out_ptr, table_stride, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    src = tl.load(feed_src_ptr + row)
    token = tl.load(staged_ids_ptr + row)
    if src >= 0:
        token = tl.load(tokens_ptr + src)
    tl.store(ids_out_ptr + row, token)
    width = tl.load(width_ptr)
    for start in range(0, width, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        mask = offs < width
        tl.store(table_out_ptr + row * table_stride + offs, tl.load(packed_ptr + row * width + offs, mask=mask),
                 mask=mask)


def decode_inputs(staged_ids: torch.Tensor, feed_src: torch.Tensor, tokens: torch.Tensor,
                  packed_table: torch.Tensor, width: torch.Tensor, ids_out: torch.Tensor,
                  table_out: torch.Tensor) -> None:
    """staged_ids, feed_src [B] int64; tokens [>= max feed_src + 1] int64 (the previous step's);
    packed_table int32 [>= B * width] (row-major [B, width]); width int32 [1]; writes
    ids_out [B] int64 and table_out[:B, :width] (int32, unit column stride)."""
    if not runs_triton(_decode_inputs_kernel, staged_ids):
        decode_inputs_ref(staged_ids, feed_src, tokens, packed_table, width, ids_out, table_out)
        return
    rows = ids_out.shape[0]
    if rows:
        _decode_inputs_kernel[(rows,)](staged_ids, feed_src, tokens, packed_table, width, ids_out, table_out,
                                       table_out.stride(0), BLOCK=256, num_warps=1)
