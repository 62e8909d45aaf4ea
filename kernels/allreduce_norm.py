"""One-shot all-reduce fused with the residual add and RMSNorm that follow it.

Under tensor parallelism every layer ends twice in a row-parallel linear (o_proj,
down_proj) whose partial products are summed over the ranks, and the sum goes straight
into the next RMSNorm together with the residual. Unfused that is two kernels per
all-reduce: the sum (torch's one-shot kernel over symmetric memory) and the add-norm,
which reads the sum again. Here each program (one per row, at most one per SM):

1. tells every peer that this rank's products are ready, and waits for theirs (a flag
   per (program, rank) in symmetric memory: `peer_barrier`, which kernels/all_gather.py
   shares). It waits for the whole kernel before it first (PDL), so one barrier covers
   every row of the buffer;
2. for each of its rows, reads the row from every rank's buffer over NVLink and sums in
   rank order (every rank gets the same bits), rounded to the activations' dtype as the
   unfused sum is;
3. adds the residual and normalises with kernels/rms_norm.py's roundings.

There is no closing barrier: the caller alternates between two buffers (`slot`), and
a peer writes a buffer again only two fused calls later, after the barrier of the call
in between, which this rank enters only once it has finished reading.

Like the other decode kernels it is launched under PDL (kernels/jit.py): it starts while the
linear before it finishes, and the next GEMV launches and loads its first weights while this
one waits for the peers (Llama-3.1-8B TP=2 batch-1 TPOT 2.755 -> 2.606 ms on 2xH200,
bench/RESULTS.md, session 14). Each rank has a GPU of its own. Two ranks sharing one GPU (a
test) could deadlock: the early GEMV's programs may take every SM the other rank still needs.

For a few rows (decode) the flags' round trip over NVLink before the data costs more than the
data: `lamport_add_rms_norm` pushes instead. Each rank stores its rows into every peer's inbox,
which holds -0.0's bits (the sentinel) wherever nothing has arrived, and each reader spins on its
own inbox until no element is the sentinel, then puts the sentinel back (TensorRT-LLM's
"Lamport" one-shot). Pushing large rows loses to pulling them (bench/RESULTS.md, session 26),
so workers/distributed.py takes it up to LOOM_LAMPORT_ALLREDUCE_MAX_ROWS rows.

`allreduce_add_rms_norm_ref` is the torch reference of both: the sum of the parts, then
fused_add_rms_norm_ref.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.jit import pdl_args, pdl_wait, sm_count
from kernels.rms_norm import fused_add_rms_norm_ref


def allreduce_add_rms_norm_ref(parts: list[torch.Tensor], residual: torch.Tensor, weight: torch.Tensor,
                               eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """parts: every rank's [M, H] product, in rank order -> (rms_norm(sum + residual) * weight,
    sum + residual), the sum rounded to the parts' dtype first."""
    total = parts[0].float()
    for p in parts[1:]:
        total = total + p.float()
    return fused_add_rms_norm_ref(total.to(parts[0].dtype), residual, weight, eps)


@triton.jit
def peer_barrier(flag_ptrs, cell, rank, WORLD: tl.constexpr):
    """Tell every peer that this rank's data for `cell` is ready, and wait until every peer has
    said the same (flag_ptrs: int64 [WORLD], the address of every rank's int32 [cells, WORLD]
    flags). Put = CAS 0 -> 1 on the peer's flag (it waits while the peer has not yet taken the
    last put), take = CAS 1 -> 0 on one's own: the flags reset themselves, also inside CUDA
    graphs, and any sequence of calls that every rank makes alike may share them."""
    for peer in tl.static_range(WORLD):
        if peer != rank:
            peer_flags = tl.load(flag_ptrs + peer).to(tl.pointer_type(tl.int32))
            while tl.atomic_cas(peer_flags + cell * WORLD + rank, 0, 1, sem="release", scope="sys") != 0:
                pass
    own_flags = tl.load(flag_ptrs + rank).to(tl.pointer_type(tl.int32))
    for peer in tl.static_range(WORLD):
        if peer != rank:
            while tl.atomic_cas(own_flags + cell * WORLD + peer, 1, 0, sem="acquire", scope="sys") != 1:
                pass


@triton.jit
def _add_norm_store(total, res_row, out_row, res_out_row, w, offs, mask, n_cols, eps):
    """One row's fp32 sum over the ranks -> rounded to the activations' dtype as the unfused sum
    is, plus the residual (stored: the new residual), normalised and scaled by w (stored), with
    kernels/rms_norm.py's roundings. res_row, out_row, res_out_row: the row's first elements."""
    summed = total.to(out_row.dtype.element_ty).to(tl.float32)
    res = tl.load(res_row + offs, mask=mask, other=0.0).to(tl.float32)
    x = (summed + res).to(res_out_row.dtype.element_ty)
    tl.store(res_out_row + offs, x, mask=mask)
    x = x.to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(x * x, 0) / n_cols + eps)
    normed = (x * rstd).to(out_row.dtype.element_ty).to(tl.float32)
    tl.store(out_row + offs, (normed * w).to(out_row.dtype.element_ty), mask=mask)


@triton.jit
def _allreduce_add_rms_norm_kernel(
    buf_ptrs, flag_ptrs, res_ptr, w_ptr, out_ptr, res_out_ptr,
    rows, n_cols, stride_r, rank, eps,
    WORLD: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr,
):
    """buf_ptrs / flag_ptrs: int64 [WORLD], the address of every rank's product buffer
    ([rows, n_cols], contiguous) and of its flags (int32 [programs, WORLD]). Program p takes
    rows p, p + programs, ..."""
    first = tl.program_id(0)
    pdl_wait(PDL)  # this rank's whole buffer is written; the next kernel may launch
    # so one barrier per program, whatever its rows, tells the peers that all of it is ready
    peer_barrier(flag_ptrs, first, rank, WORLD)

    offs = tl.arange(0, BLOCK)
    mask = offs < n_cols
    w = tl.load(w_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    for row in range(first, rows, tl.num_programs(0)):
        row = tl.cast(row, tl.int64)
        at = row * n_cols + offs
        total = tl.zeros([BLOCK], dtype=tl.float32)
        for r in tl.static_range(WORLD):
            part = tl.load(buf_ptrs + r).to(tl.pointer_type(out_ptr.dtype.element_ty))
            total += tl.load(part + at, mask=mask, other=0.0).to(tl.float32)
        _add_norm_store(total, res_ptr + row * stride_r, out_ptr + row * n_cols, res_out_ptr + row * n_cols,
                        w, offs, mask, n_cols, eps)


@triton.jit
def _lamport_add_rms_norm_kernel(
    part_ptr, inbox_ptrs, res_ptr, w_ptr, out_ptr, res_out_ptr,
    rows, n_cols, stride_r, src_stride, rank, eps,
    SENTINEL: tl.constexpr, WORLD: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr,
):
    """part_ptr: this rank's [rows, n_cols] product, seen as integers of its width (the bits are
    compared, not the values). inbox_ptrs: int64 [WORLD], every rank's inbox, the same integers:
    the part of rank r sits src_stride * r elements in, [rows, n_cols]; an element that still
    holds SENTINEL (-0.0's bits) has not arrived. Program p takes rows p, p + programs, ..."""
    first = tl.program_id(0)
    pdl_wait(PDL)
    bits = part_ptr.dtype.element_ty
    offs = tl.arange(0, BLOCK)
    mask = offs < n_cols
    w = tl.load(w_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    inbox = tl.load(inbox_ptrs + rank).to(tl.pointer_type(bits))
    for row in range(first, rows, tl.num_programs(0)):
        row = tl.cast(row, tl.int64)
        at = row * n_cols + offs
        mine = tl.load(part_ptr + at, mask=mask, other=0)
        mine = tl.where(mine == SENTINEL, tl.zeros_like(mine), mine)  # -0.0 -> +0.0: never the sentinel
        for peer in tl.static_range(WORLD):
            if peer != rank:
                dst = tl.load(inbox_ptrs + peer).to(tl.pointer_type(bits))
                tl.store(dst + rank * src_stride + at, mine, mask=mask)
        total = tl.zeros([BLOCK], dtype=tl.float32)
        for r in tl.static_range(WORLD):  # rank order: every rank gets the same bits
            if r == rank:
                total += mine.to(out_ptr.dtype.element_ty, bitcast=True).to(tl.float32)
            else:
                src = inbox + r * src_stride + at
                got = tl.load(src, mask=mask, other=0, volatile=True)
                while tl.max((got == SENTINEL).to(tl.int32), 0) > 0:
                    got = tl.load(src, mask=mask, other=0, volatile=True)
                # empty again for this slot's call after next, which the peer reaches only
                # after this rank's next call has sent it that call's part
                tl.store(src, tl.full([BLOCK], SENTINEL, bits), mask=mask)
                total += got.to(out_ptr.dtype.element_ty, bitcast=True).to(tl.float32)
        _add_norm_store(total, res_ptr + row * stride_r, out_ptr + row * n_cols, res_out_ptr + row * n_cols,
                        w, offs, mask, n_cols, eps)


MAX_COLS = 16384  # a row is held in registers


def allreduce_add_rms_norm(buf_ptrs: torch.Tensor, flag_ptrs: torch.Tensor, rank: int, rows: int,
                           residual: torch.Tensor, weight: torch.Tensor, eps: float,
                           programs: int | None = None,
                           num_warps: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Sum every rank's [rows, H] buffer (buf_ptrs: their addresses, int64 [W] on the device),
    add residual [rows, H] and normalise by weight [H]: (normed, new residual), both new
    [rows, H] tensors. flag_ptrs: every rank's int32 flags, at least min(rows, programs) x W,
    zero between calls. Every rank of the group must make the same call.

    programs: at most one per SM by default. More rows than SMs then loop in the programs,
    each with one barrier: 256 rows of 8,192 took 19.4 us on 2xH200 where a program per row
    (two waves, a barrier each) took 22.7 (bench/RESULTS.md, session 22). num_warps: by the
    row's length by default; both are parameters for bench.allreduce_tp's sweep."""
    world = buf_ptrs.numel()
    h = weight.numel()
    assert h <= MAX_COLS and residual.shape == (rows, h) and residual.stride(-1) == 1
    out = torch.empty((rows, h), dtype=residual.dtype, device=residual.device)
    res_out = torch.empty_like(out)
    if rows == 0:
        return out, res_out
    block = triton.next_power_of_2(h)
    _allreduce_add_rms_norm_kernel[(min(rows, programs or sm_count(residual.device)),)](
        buf_ptrs, flag_ptrs, residual, weight, out, res_out, rows, h, residual.stride(0), rank, float(eps),
        WORLD=world, BLOCK=block, num_warps=num_warps or max(4, min(16, block // 512)), **pdl_args(residual))
    return out, res_out


INT_OF = {2: torch.int16, 4: torch.int32}  # the integers an inbox holds, by element size


def sentinel(dtype: torch.dtype) -> int:
    """The bits of -0.0 in `dtype`, read as INT_OF's integer: an inbox element not yet written."""
    return -(1 << (8 * dtype.itemsize - 1))


def lamport_add_rms_norm(part: torch.Tensor, inbox_ptrs: torch.Tensor, src_stride: int, rank: int,
                         residual: torch.Tensor, weight: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """allreduce_add_rms_norm without flags, for a few rows (Lamport's one-shot, as TensorRT-LLM's):
    each program stores its rows of this rank's product `part` [rows, H] into every peer's inbox,
    then waits on its own inbox until no element holds the sentinel, sums in rank order, and puts
    the sentinel back. A flag round trip over NVLink before the data is what it saves.

    The inboxes (inbox_ptrs: every rank's, int64 [W]; src_stride: elements between the parts of two
    senders) start full of sentinel(dtype). Calls must alternate between two inboxes as the pulled
    kernel's slots do: a peer writes an inbox again only after this rank's next call has sent it
    data, that is after this rank emptied it. A product element of -0.0 arrives as +0.0 (its sum
    is equal to the reference's, as tensors compare)."""
    rows, h = part.shape
    assert h <= MAX_COLS and residual.shape == (rows, h) and residual.stride(-1) == 1 and part.is_contiguous()
    out = torch.empty((rows, h), dtype=residual.dtype, device=residual.device)
    res_out = torch.empty_like(out)
    if rows == 0:
        return out, res_out
    block = triton.next_power_of_2(h)
    _lamport_add_rms_norm_kernel[(min(rows, sm_count(residual.device)),)](
        part.view(INT_OF[part.dtype.itemsize]), inbox_ptrs, residual, weight, out, res_out, rows, h,
        residual.stride(0), src_stride, rank, float(eps), SENTINEL=sentinel(part.dtype),
        WORLD=inbox_ptrs.numel(), BLOCK=block, num_warps=max(4, min(16, block // 512)), **pdl_args(residual))
    return out, res_out
