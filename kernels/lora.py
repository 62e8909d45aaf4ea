"""Multi-LoRA: the two batched products that add an adapter's delta to a base linear's output,
for a batch whose rows use different adapters (punica's shrink and expand, as vLLM's Triton
LoRA kernels).

    shrink   xa[t]          = x[t] @ A[slot[t]]^T            A: [slots, n_slices * R, K]
    expand   y[t, slice j] += xa[t, j*R:(j+1)*R] @ B[slot[t], slice j]^T     B: [slots, OUT, R]

`slot[t]` is token t's adapter slot on the device; -1 is the base model, for which neither
kernel loads a weight (a program whose rows are all -1 loads nothing but the slots). The
adapter's scale (lora_alpha / r, or / sqrt(r) with rsLoRA) is folded into B when it is loaded.

A fused projection (qkv_proj = [q; k; v], gate_up_proj = [gate; up]) is one shrink, whose
n_slices * R columns are the slices' A stacked, and one expand, in which output column o reads
the R columns of xa of its own slice (slice starts `slice_starts`): one launch each, whatever
the number of slices, and B holds only each slice's own rows.

From LOOM_LORA_SORTED_ROWS rows (16) to SORTED_ROWS_MAX (256: the decode batches) the sorted
kernels run: the rows are taken in adapter order, BLOCK_M rows of one adapter per program, and
each program runs tensor-core tile products against its adapter (SGMV over the sorted rows, as
vLLM's kernels; every program sorts the slots itself, so nothing runs before them). Below them
(and everywhere with LOOM_LORA_SORTED_ROWS=0, session 31's kernels) each program owns one row and
runs a GEMV against that row's adapter (BGMV, the shrink split over K), and above
ROW_PROGRAMS_MAX rows a program owns BLOCK_M tokens: a tile product when they share one adapter
(SGMV: a prefill chunk's rows), else each row's GEMV in turn. At 1-8 rows the expand usually runs
in the epilogue of the base linear's GEMV instead (kernels/gemv.py LoRAEpilogue), and at batch 1 the
shrink of a linear whose input is a norm's or SiLU's output runs in that op's kernel
(kernels/gemv.py lora_shrink_prologue). The slot tensor is
read on the device: nothing here depends on its values on the host, so a CUDA graph captures the
adapter index as an input, not a shape.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ipc import envs
from kernels.jit import is_interpreted, pdl_args, pdl_wait, runs_triton, sm_count, step_jit

MAX_SLICES = 3   # q/k/v


# ------------------------------------------------------------------ torch references

def lora_shrink_ref(x: torch.Tensor, a: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """x [T, K], a [S, N, K], slots [T] (-1: no adapter) -> xa [T, N] float32 (rows of -1 are 0)."""
    xa = torch.zeros((x.shape[0], a.shape[1]), dtype=torch.float32, device=x.device)
    for s in torch.unique(slots).tolist():
        if s < 0:
            continue
        rows = (slots == s).nonzero().flatten()
        xa[rows] = x.index_select(0, rows).float() @ a[s].float().t()
    return xa


def lora_expand_ref(y: torch.Tensor, xa: torch.Tensor, b: torch.Tensor, slots: torch.Tensor,
                    slice_starts: tuple[int, ...]) -> torch.Tensor:
    """y [T, OUT] += each slice's xa columns @ its B rows^T, in place (rows of slot -1 unchanged).
    b [S, OUT, R]; slice_starts: the first output column of each slice (slice_starts[0] == 0).
    xa may be lora_shrink's split partials [splits, T, N]: their sum is xa."""
    if xa.dim() == 3:
        xa = xa.sum(0)
    rank = b.shape[2]
    bounds = list(slice_starts) + [y.shape[1]]
    for s in torch.unique(slots).tolist():
        if s < 0:
            continue
        rows = (slots == s).nonzero().flatten()
        delta = torch.cat([xa.index_select(0, rows)[:, j * rank:(j + 1) * rank] @ b[s, o0:o1].float().t()
                           for j, (o0, o1) in enumerate(zip(bounds, bounds[1:]))], dim=1)
        y[rows] = (y.index_select(0, rows).float() + delta).to(y.dtype)
    return y


# ------------------------------------------------------------------ Triton kernels

@step_jit(ints=("T", "K_CHUNK"))
def _lora_shrink_kernel(x_ptr, a_ptr, slots_ptr, out_ptr, T, K, N, stride_xm, stride_as, stride_an, stride_om,
                        stride_os, K_CHUNK, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                        PRECISION: tl.constexpr, UPCAST: tl.constexpr, PDL: tl.constexpr):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    ks = tl.arange(0, BLOCK_K)
    cmask = cols < N
    if BLOCK_M == 1:   # decode-sized batches: one row per program (BGMV), its K split over grid axis 2
        pid_k = tl.program_id(2)
        # the row's slot (the step's input) and the chunk's first tile of its A (a weight) load before
        # the wait, under the tail of the kernel before; a base row's program loads no A
        s = tl.load(slots_ptr + pid_m)
        a_base = a_ptr + tl.maximum(s, 0).to(tl.int64) * stride_as
        k_start = pid_k * K_CHUNK
        k_end = tl.minimum(k_start + K_CHUNK, K)
        a_ptrs = a_base + cols[:, None] * stride_an + (k_start + ks)[None, :]
        a_first = tl.load(a_ptrs, mask=(cols < tl.where(s >= 0, N, 0))[:, None] & ((k_start + ks) < k_end)[None, :],
                          other=0.0)
        pdl_wait(PDL)   # (every program waits, also those of base rows that store nothing)
        if s >= 0:
            x_first = tl.load(x_ptr + pid_m * stride_xm + k_start + ks, mask=(k_start + ks) < k_end, other=0.0)
            acc1 = tl.sum(a_first.to(tl.float32) * x_first.to(tl.float32)[None, :], 1)
            for k0 in range(k_start + BLOCK_K, k_end, BLOCK_K):
                kk = k0 + ks
                xv = tl.load(x_ptr + pid_m * stride_xm + kk, mask=kk < k_end, other=0.0).to(tl.float32)
                av = tl.load(a_base + cols[:, None] * stride_an + kk[None, :],
                             mask=cmask[:, None] & (kk[None, :] < k_end), other=0.0).to(tl.float32)
                acc1 += tl.sum(av * xv[None, :], 1)
            tl.store(out_ptr + pid_k * stride_os + pid_m * stride_om + cols, acc1, mask=cmask)
        return
    pdl_wait(PDL)   # (first: every program waits, also those of base rows that store nothing)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rmask = rows < T
    slots = tl.load(slots_ptr + rows, mask=rmask, other=-1)
    hi = tl.max(slots, 0)
    lo = tl.min(tl.where(rmask, slots, hi), 0)
    if hi >= 0:
        if lo == hi:   # one adapter for every row: a tile product (SGMV)
            a_base = a_ptr + hi.to(tl.int64) * stride_as
            acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            for k0 in range(0, K, BLOCK_K):
                kk = k0 + ks
                xt = tl.load(x_ptr + rows[:, None] * stride_xm + kk[None, :],
                             mask=rmask[:, None] & (kk[None, :] < K), other=0.0)
                at = tl.load(a_base + cols[None, :] * stride_an + kk[:, None],
                             mask=cmask[None, :] & (kk[:, None] < K), other=0.0)
                if UPCAST:   # the interpreter's bf16 dot returns garbage
                    xt, at = xt.to(tl.float32), at.to(tl.float32)
                acc += tl.dot(xt, at, input_precision=PRECISION)
            tl.store(out_ptr + rows[:, None] * stride_om + cols[None, :], acc, mask=rmask[:, None] & cmask[None, :])
        else:          # rows of different adapters: each row its own GEMV (BGMV)
            for i in range(BLOCK_M):
                row = pid_m * BLOCK_M + i
                if row < T:
                    s = tl.load(slots_ptr + row)
                    if s >= 0:
                        a_base = a_ptr + s.to(tl.int64) * stride_as
                        acc1 = tl.zeros((BLOCK_N,), dtype=tl.float32)
                        for k0 in range(0, K, BLOCK_K):
                            kk = k0 + ks
                            xv = tl.load(x_ptr + row * stride_xm + kk, mask=kk < K, other=0.0).to(tl.float32)
                            av = tl.load(a_base + cols[:, None] * stride_an + kk[None, :],
                                         mask=cmask[:, None] & (kk[None, :] < K), other=0.0).to(tl.float32)
                            acc1 += tl.sum(av * xv[None, :], 1)
                        tl.store(out_ptr + row * stride_om + cols, acc1, mask=cmask)


@step_jit(ints=("T",))
def _lora_expand_kernel(y_ptr, xa_ptr, b_ptr, slots_ptr, T, OUT, R, stride_ym, stride_xam, stride_xas, stride_bs,
                        stride_bo, S1, S2, NUM_SLICES: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                        BLOCK_R: tl.constexpr, SPLITS: tl.constexpr, PRECISION: tl.constexpr,
                        UPCAST: tl.constexpr, PDL: tl.constexpr):
    pdl_wait(PDL)   # (first: every program waits, also those of base rows that store nothing)
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rs = tl.arange(0, BLOCK_R)
    cmask = cols < OUT
    rkmask = rs < R
    col_slice = (cols >= S1).to(tl.int32) + (cols >= S2).to(tl.int32)   # each output column's slice
    if BLOCK_M == 1:   # decode-sized batches: one row per program (BGMV)
        s = tl.load(slots_ptr + pid_m)
        if s >= 0:
            b_base = b_ptr + s.to(tl.int64) * stride_bs
            acc1 = tl.zeros((BLOCK_N,), dtype=tl.float32)
            for j in tl.static_range(NUM_SLICES):
                bv = tl.load(b_base + cols[:, None] * stride_bo + rs[None, :],
                             mask=(cmask & (col_slice == j))[:, None] & rkmask[None, :], other=0.0).to(tl.float32)
                xv = _xa_row(xa_ptr + pid_m * stride_xam + j * R + rs, rkmask, stride_xas, SPLITS)
                acc1 += tl.sum(bv * xv[None, :], 1)
            yp = y_ptr + pid_m * stride_ym + cols
            yv = tl.load(yp, mask=cmask, other=0.0)
            tl.store(yp, (yv.to(tl.float32) + acc1).to(yv.dtype), mask=cmask)
        return
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rmask = rows < T
    slots = tl.load(slots_ptr + rows, mask=rmask, other=-1)
    hi = tl.max(slots, 0)
    lo = tl.min(tl.where(rmask, slots, hi), 0)
    if hi >= 0:
        y_ptrs = y_ptr + rows[:, None] * stride_ym + cols[None, :]
        if lo == hi:   # one adapter: a tile product per slice (columns of other slices masked off)
            b_base = b_ptr + hi.to(tl.int64) * stride_bs
            acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            for j in tl.static_range(NUM_SLICES):
                bt = tl.load(b_base + cols[None, :] * stride_bo + rs[:, None],
                             mask=(cmask & (col_slice == j))[None, :] & rkmask[:, None], other=0.0)
                xat = tl.load(xa_ptr + rows[:, None] * stride_xam + j * R + rs[None, :],
                              mask=rmask[:, None] & rkmask[None, :], other=0.0)
                xat = xat.to(bt.dtype)   # (bf16 operands: the tensor cores, as vLLM's expand)
                if UPCAST:
                    xat, bt = xat.to(tl.float32), bt.to(tl.float32)
                acc += tl.dot(xat, bt, input_precision=PRECISION)
            mask = rmask[:, None] & cmask[None, :]
            y = tl.load(y_ptrs, mask=mask, other=0.0)
            tl.store(y_ptrs, (y.to(tl.float32) + acc).to(y.dtype), mask=mask)
        else:
            for i in range(BLOCK_M):
                row = pid_m * BLOCK_M + i
                if row < T:
                    s = tl.load(slots_ptr + row)
                    if s >= 0:
                        b_base = b_ptr + s.to(tl.int64) * stride_bs
                        acc1 = tl.zeros((BLOCK_N,), dtype=tl.float32)
                        for j in tl.static_range(NUM_SLICES):
                            bv = tl.load(b_base + cols[:, None] * stride_bo + rs[None, :],
                                         mask=(cmask & (col_slice == j))[:, None] & rkmask[None, :],
                                         other=0.0).to(tl.float32)
                            xv = tl.load(xa_ptr + row * stride_xam + j * R + rs, mask=rkmask, other=0.0)
                            acc1 += tl.sum(bv * xv[None, :], 1)
                        yp = y_ptr + row * stride_ym + cols
                        yv = tl.load(yp, mask=cmask, other=0.0)
                        tl.store(yp, (yv.to(tl.float32) + acc1).to(yv.dtype), mask=cmask)


@triton.jit
def _sorted_tile(slots_ptr, T, S, tile, BLOCK_M: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_S: tl.constexpr):
    """The step's rows sorted by adapter slot, as vLLM's Triton LoRA kernels sort them
    (token_indices_sorted_by_lora_ids), but computed in every program from the T slots themselves:
    no sort kernel, no host sync, a grid fixed by T and S (graph-capturable). Slot s's rows, in
    row order, fill ceil(count_s / BLOCK_M) tiles, the slots' tiles one after another; this returns
    program `tile`'s slot (S or more: past the last tile, nothing to do), and its BLOCK_M rows with
    their mask (a slot's last tile may be short; none past the last tile). The slots are read in
    chunks of BLOCK_T (a [BLOCK_M, BLOCK_T] search per chunk: with all T at once, 256 rows spilled
    the shrink's registers)."""
    t = tl.arange(0, BLOCK_T)
    counts = tl.zeros((BLOCK_S,), dtype=tl.int32)
    for t0 in range(0, T, BLOCK_T):
        sl = tl.load(slots_ptr + t0 + t, mask=t0 + t < T, other=-1)
        counts += tl.histogram(tl.where(sl >= 0, sl, S), BLOCK_S)   # (base rows and padding: bin S, no tiles)
    sidx = tl.arange(0, BLOCK_S)
    tiles = tl.where(sidx < S, (counts + BLOCK_M - 1) // BLOCK_M, 0)
    ends = tl.cumsum(tiles, 0)
    s = tl.sum((ends <= tile).to(tl.int32), 0)   # the first slot whose tiles end after `tile`
    m = tl.arange(0, BLOCK_M)
    rows = tl.zeros((BLOCK_M,), dtype=tl.int32)
    found = tl.zeros((BLOCK_M,), dtype=tl.int32)
    if s < S:   # (the grid's spare programs, past the last tile, skip the rows' search)
        # the tile's first row is slot s's (tile - first) * BLOCK_M-th; `before`: slot s's rows in
        # the chunks already read, less that
        first = tl.sum(tl.where(sidx == s, ends - tiles, 0), 0)
        before = (first - tile) * BLOCK_M
        for t0 in range(0, T, BLOCK_T):
            sel = tl.load(slots_ptr + t0 + t, mask=t0 + t < T, other=-1) == s
            pos = before + tl.cumsum(sel.to(tl.int32), 0) - 1   # each row's place in this tile
            hit = sel[None, :] & (pos[None, :] == m[:, None])   # [BLOCK_M, BLOCK_T]: row t0 + t is the m-th
            rows += tl.sum(tl.where(hit, t0 + t[None, :], 0), 1)
            found += tl.sum(hit.to(tl.int32), 1)
            before += tl.sum(sel.to(tl.int32), 0)
    return s, rows, found > 0


@step_jit(ints=("T", "K_CHUNK"))
def _lora_shrink_sorted_kernel(x_ptr, a_ptr, slots_ptr, out_ptr, T, K, N, stride_xm, stride_as, stride_an,
                               stride_om, stride_os, K_CHUNK, S, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                               BLOCK_K: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_S: tl.constexpr,
                               PRECISION: tl.constexpr, UPCAST: tl.constexpr, PDL: tl.constexpr):
    """Program (tile of one slot's rows, column block, K chunk): one tile product of the tile's x
    rows by A[slot] over the chunk (SGMV: A[s] is read once per tile of its rows, not once per
    row), stored as the chunk's partial at the rows' own places; base rows are never stored."""
    # (the slots are the step's input, written before the graph: read before the wait, so that
    # the sorting overlaps the tail of the kernel before)
    s, rows, rmask = _sorted_tile(slots_ptr, T, S, tl.program_id(0), BLOCK_M, BLOCK_T, BLOCK_S)
    pdl_wait(PDL)   # (every program waits, also those past the last tile)
    if s < S:
        pid_n = tl.program_id(1)
        pid_k = tl.program_id(2)
        cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        ks = tl.arange(0, BLOCK_K)
        cmask = cols < N
        a_base = a_ptr + s.to(tl.int64) * stride_as
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        k_end = tl.minimum((pid_k + 1) * K_CHUNK, K)
        for k0 in range(pid_k * K_CHUNK, k_end, BLOCK_K):
            kk = k0 + ks
            xt = tl.load(x_ptr + rows[:, None] * stride_xm + kk[None, :], mask=rmask[:, None] & (kk[None, :] < k_end),
                         other=0.0)
            at = tl.load(a_base + cols[None, :] * stride_an + kk[:, None],
                         mask=cmask[None, :] & (kk[:, None] < k_end), other=0.0)
            if UPCAST:   # the interpreter's bf16 dot returns garbage
                xt, at = xt.to(tl.float32), at.to(tl.float32)
            acc += tl.dot(xt, at, input_precision=PRECISION)
        tl.store(out_ptr + pid_k * stride_os + rows[:, None] * stride_om + cols[None, :], acc,
                 mask=rmask[:, None] & cmask[None, :])


@step_jit(ints=("T",))
def _lora_expand_sorted_kernel(y_ptr, xa_ptr, b_ptr, slots_ptr, T, OUT, R, S, stride_ym, stride_xam, stride_xas,
                               stride_bs, stride_bo, S1, S2, NUM_SLICES: tl.constexpr, BLOCK_M: tl.constexpr,
                               BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_T: tl.constexpr,
                               BLOCK_S: tl.constexpr, SPLITS: tl.constexpr, PRECISION: tl.constexpr,
                               UPCAST: tl.constexpr, PDL: tl.constexpr):
    """Program (tile of one slot's rows, column block): y[rows] += their xa @ B[slot]^T, a tile
    product per slice the columns meet; xa is the sum of the shrink's SPLITS partials, summed as
    they are read. Base rows unchanged."""
    s, rows, rmask = _sorted_tile(slots_ptr, T, S, tl.program_id(0), BLOCK_M, BLOCK_T, BLOCK_S)
    pdl_wait(PDL)
    if s < S:
        cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        rs = tl.arange(0, BLOCK_R)
        cmask = cols < OUT
        rkmask = rs < R
        col_slice = (cols >= S1).to(tl.int32) + (cols >= S2).to(tl.int32)
        b_base = b_ptr + s.to(tl.int64) * stride_bs
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for j in tl.static_range(NUM_SLICES):
            if tl.max(((col_slice == j) & cmask).to(tl.int32), 0) > 0:   # (a wide tile meets one slice)
                bt = tl.load(b_base + cols[None, :] * stride_bo + rs[:, None],
                             mask=(cmask & (col_slice == j))[None, :] & rkmask[:, None], other=0.0)
                xat_ptrs = xa_ptr + rows[:, None] * stride_xam + j * R + rs[None, :]
                xmask = rmask[:, None] & rkmask[None, :]
                xat = tl.load(xat_ptrs, mask=xmask, other=0.0)
                for sp in tl.static_range(1, SPLITS):
                    xat += tl.load(xat_ptrs + sp * stride_xas, mask=xmask, other=0.0)
                xat = xat.to(bt.dtype)   # (bf16 operands: the tensor cores, as vLLM's expand)
                if UPCAST:
                    xat, bt = xat.to(tl.float32), bt.to(tl.float32)
                acc += tl.dot(xat, bt, input_precision=PRECISION)
        mask = rmask[:, None] & cmask[None, :]
        y_ptrs = y_ptr + rows[:, None] * stride_ym + cols[None, :]
        y = tl.load(y_ptrs, mask=mask, other=0.0)
        tl.store(y_ptrs, (y.to(tl.float32) + acc).to(y.dtype), mask=mask)


@triton.jit
def _xa_row(ptrs, mask, stride_split, SPLITS: tl.constexpr):
    """A row's xa values: the sum of lora_shrink's SPLITS partials (one: xa itself)."""
    xv = tl.load(ptrs, mask=mask, other=0.0)
    for sp in tl.static_range(1, SPLITS):
        xv += tl.load(ptrs + sp * stride_split, mask=mask, other=0.0)
    return xv


def _pdl(t: torch.Tensor) -> dict:
    """Programmatic dependent launch (Hopper; LOOM_LORA_PDL, LOOM_PDL): the launch of a LoRA kernel
    overlaps the tail of the kernel before it, whose output it waits for before its first load."""
    return pdl_args(t) if envs.LOOM_LORA_PDL else {"PDL": False, "launch_pdl": False}


def _precision(t: torch.Tensor) -> str:
    # fp32 weights (tests, CPU oracle runs) multiply exactly; bf16/fp16 take the tensor cores as they are
    return "ieee" if t.dtype == torch.float32 else "tf32"


# Up to this many rows (decode batches, the decode graphs' sizes; from LOOM_LORA_SORTED_ROWS rows the
# sorted kernels take them) each program takes one row (BGMV): every row reads its own adapter, from
# L2 after the first; above it, programs take BLOCK_M rows and run tile products where their rows
# share an adapter (prefill segments).
ROW_PROGRAMS_MAX = 256


def _block_m(rows: int, block_m: int | None) -> int:
    return block_m if block_m is not None else (1 if rows <= ROW_PROGRAMS_MAX else 16)


def use_sorted(rows: int, sorted_rows: bool | None) -> bool:
    """Whether a batch of `rows` runs the sorted kernels (None: from LOOM_LORA_SORTED_ROWS rows to
    SORTED_ROWS_MAX, the decode batches). There the rows are taken in adapter order, BLOCK_M of one
    adapter per program, and each program runs tensor-core tile products against its adapter's A
    or B (SGMV, as vLLM's kernels): a per-row program (BGMV) reads its adapter once per row, 256
    times per linear at batch 256 (8 ms of shrink per step over 8 adapters, session 36)."""
    if sorted_rows is not None:
        return sorted_rows
    lo = envs.LOOM_LORA_SORTED_ROWS
    return 0 < lo <= rows <= SORTED_ROWS_MAX


# The sorted kernels' rows: each program sorts the step's slots itself, in a [BLOCK_M, rows] tile of
# registers, so they stop at the decode graphs' largest batch (prefill chunks keep their 16-row
# blocks: a request's tokens are consecutive rows of one adapter there already).
SORTED_ROWS_MAX = 256


def _sorted_launch(t: int, num_slots: int) -> tuple[int, int, dict]:
    """(rows per tile, tiles in the grid, the sort's constexprs) of a sorted launch over t rows:
    the slots' tiles are at most cdiv(t, BLOCK_M) + one short tile per slot that has rows."""
    block_m = 16 if t < 128 else 32
    tiles = triton.cdiv(t, block_m) + min(num_slots, t)
    return block_m, tiles, dict(BLOCK_T=min(64, max(16, triton.next_power_of_2(t))),
                                BLOCK_S=triton.next_power_of_2(num_slots + 1))


def _shrink_splits(k: int, block_k: int, programs: int, device: torch.device) -> int:
    """Programs per row block over K: ~2 programs per SM, each at least LOOM_LORA_SHRINK_K_BLOCKS K
    blocks (each program's K blocks are dependent loads from HBM: fewer per program, less latency,
    and more partials for the expand to sum)."""
    per = max(1, envs.LOOM_LORA_SHRINK_K_BLOCKS)
    return max(1, min(k // (per * block_k), triton.cdiv(2 * sm_count(device), max(programs, 1))))


def lora_shrink(x: torch.Tensor, a: torch.Tensor, slots: torch.Tensor, out: torch.Tensor | None = None,
                block_m: int | None = None, splits: int | None = 1,
                sorted_rows: bool | None = False) -> torch.Tensor:
    """As lora_shrink_ref: x [T, K] (rows may be strided), a [S, N, K] contiguous, slots [T] int32
    -> xa [T, N] float32 (into `out` when given; rows of slot -1 are left as they were).

    splits > 1 (None: chosen from the shape) splits K over that many programs per row (or sorted
    tile) and returns their partials [splits, T, N], which lora_expand sums as it reads them: a
    batch-1 shrink is otherwise one program walking all of K (q/k/v's 48 columns of K = 4,096).
    sorted_rows: the sorted kernel (use_sorted; None: by the batch size)."""
    if not runs_triton(_lora_shrink_kernel, x):
        ref = lora_shrink_ref(x, a, slots)
        return ref if out is None else out.copy_(ref)
    t, k = x.shape
    n = a.shape[1]
    sort = use_sorted(t, sorted_rows)
    block_n = min(64, max(16, triton.next_power_of_2(n)))
    block_k = min(128, max(16, triton.next_power_of_2(k)))
    n_tiles = triton.cdiv(n, block_n)
    if sort:
        block_m, row_tiles, sort_kw = _sorted_launch(t, a.shape[0])
        busy = triton.cdiv(t, block_m)   # (the tiles that have rows, when the slots fill them)
    else:
        block_m = _block_m(t, block_m)
        row_tiles = busy = triton.cdiv(t, block_m)
    if block_m != 1 and not sort:   # (prefill's 16-row blocks: enough programs without a split)
        splits = 1
    elif splits is None:
        splits = _shrink_splits(k, block_k, busy * n_tiles, x.device)
    k_chunk = triton.cdiv(triton.cdiv(k, splits), block_k) * block_k
    splits = triton.cdiv(k, k_chunk)
    if out is None:
        out = torch.empty((splits, t, n) if splits > 1 else (t, n), dtype=torch.float32, device=x.device)
    if t == 0:
        return out
    assert x.stride(1) == 1 and a.is_contiguous() and out.stride(-1) == 1
    kernel = _lora_shrink_sorted_kernel if sort else _lora_shrink_kernel
    # (the sorted kernel takes the same arguments, and the number of slots and the sort's sizes; its
    # chunks keep their 128-wide K blocks' count, in 64-wide tiles over 8 warps: at 128 x 4 warps its
    # [32 rows, 128] x [128, 64] tiles took 255 registers and spilled, ptxas for sm_90)
    extra = dict(S=a.shape[0], **sort_kw) if sort else {}
    kernel[(row_tiles, n_tiles, splits)](
        x, a, slots, out, t, k, n, x.stride(0), a.stride(0), a.stride(1), out.stride(-2),
        out.stride(0) if splits > 1 else 0, k_chunk, **extra,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=min(64, block_k) if sort else block_k, PRECISION=_precision(a),
        UPCAST=is_interpreted(kernel), num_warps=8 if sort else 4, **_pdl(x))
    return out


def lora_expand(y: torch.Tensor, xa: torch.Tensor, b: torch.Tensor, slots: torch.Tensor,
                slice_starts: tuple[int, ...], block_m: int | None = None,
                sorted_rows: bool | None = False) -> torch.Tensor:
    """As lora_expand_ref, in place into y [T, OUT] (rows may be strided; columns contiguous).
    sorted_rows: as lora_shrink's."""
    if not runs_triton(_lora_expand_kernel, y):
        return lora_expand_ref(y, xa, b, slots, slice_starts)
    t, n_out = y.shape
    if t == 0:
        return y
    assert len(slice_starts) <= MAX_SLICES and slice_starts[0] == 0
    assert y.stride(1) == 1 and xa.stride(-1) == 1 and b.is_contiguous()
    splits = xa.shape[0] if xa.dim() == 3 else 1
    rank = b.shape[2]
    starts = list(slice_starts[1:]) + [n_out] * (MAX_SLICES - len(slice_starts))
    block_r = max(16, triton.next_power_of_2(rank))
    if use_sorted(t, sorted_rows):
        block_m, row_tiles, sort_kw = _sorted_launch(t, b.shape[0])
        block_n = min(128, max(16, triton.next_power_of_2(n_out)))
        _lora_expand_sorted_kernel[(row_tiles, triton.cdiv(n_out, block_n))](
            y, xa, b, slots, t, n_out, rank, b.shape[0], y.stride(0), xa.stride(-2),
            xa.stride(0) if splits > 1 else 0, b.stride(0), b.stride(1), starts[0], starts[1],
            NUM_SLICES=len(slice_starts), BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_R=block_r, **sort_kw,
            SPLITS=splits, PRECISION=_precision(b), UPCAST=is_interpreted(_lora_expand_sorted_kernel),
            num_warps=4, **_pdl(y))
        return y
    block_m = _block_m(t, block_m)
    if splits > 1 and block_m != 1:   # (partials come from the one-row-per-program shrink only)
        xa, splits = xa.sum(0), 1
    # a row per program: wider column blocks, so that a base row's programs (which only read
    # their slot) stay few
    block_n = min(256 if block_m == 1 else 64, max(16, triton.next_power_of_2(n_out)))
    _lora_expand_kernel[(triton.cdiv(t, block_m), triton.cdiv(n_out, block_n))](
        y, xa, b, slots, t, n_out, rank, y.stride(0), xa.stride(-2), xa.stride(0) if splits > 1 else 0,
        b.stride(0), b.stride(1), starts[0], starts[1], NUM_SLICES=len(slice_starts), BLOCK_M=block_m,
        BLOCK_N=block_n, BLOCK_R=block_r, SPLITS=splits, PRECISION=_precision(b),
        UPCAST=is_interpreted(_lora_expand_kernel), num_warps=4, **_pdl(y))
    return y
