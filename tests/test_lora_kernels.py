"""kernels/lora.py: the Triton shrink and expand vs their torch references, on batches mixing
adapters and the base model (slot -1), prefill segments and decode rows, and fused slices
(q/k/v, gate/up). Without CUDA the kernels run under the Triton interpreter (as in
tests/test_kernels.py: a private copy of the module decorated with TRITON_INTERPRET=1, or this
file again in a subprocess where triton was imported without it)."""
from __future__ import annotations

import importlib
import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

_ROOT = Path(__file__).resolve().parents[1]
HAS_CUDA = torch.cuda.is_available()


def _load_private(name: str = "lora"):
    spec = importlib.util.spec_from_file_location(f"_loom_test_kernels_{name}", _ROOT / "kernels" / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    return mod


if HAS_CUDA and os.environ.get("TRITON_INTERPRET", "0") != "1":
    MODE, lk = "cuda", importlib.import_module("kernels.lora")
    gv = importlib.import_module("kernels.gemv")
else:
    _prev = os.environ.get("TRITON_INTERPRET")
    os.environ["TRITON_INTERPRET"] = "1"
    try:
        import triton.language as _tl
        if type(_tl.sum).__name__ == "InterpretedFunction":
            MODE, lk = "interpret", _load_private()
            gv = _load_private("gemv")
        else:
            MODE, lk = "subprocess", None
    finally:
        if _prev is None:
            del os.environ["TRITON_INTERPRET"]
        else:
            os.environ["TRITON_INTERPRET"] = _prev
DEVICE = "cuda" if MODE == "cuda" else "cpu"


@pytest.fixture(autouse=True)
def _triton_mode(request, monkeypatch):
    if request.node.name == "test_in_fresh_interpreter":
        yield
        return
    if MODE == "subprocess":
        pytest.skip("triton was imported without TRITON_INTERPRET=1; see test_in_fresh_interpreter")
    if MODE == "interpret":
        monkeypatch.setenv("TRITON_INTERPRET", "1")
    yield


def test_in_fresh_interpreter():
    if MODE != "subprocess":
        pytest.skip("the kernels run in this process")
    assert not os.environ.get("_LOOM_LORA_KERNEL_CHILD")
    env = dict(os.environ, TRITON_INTERPRET="1", _LOOM_LORA_KERNEL_CHILD="1")
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(Path(__file__))],
                          cwd=_ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-3000:]


def _case(dtype, slots, k=40, rank=4, slices=(12, 6, 6), num_slots=3, seed=0):
    g = torch.Generator().manual_seed(seed)
    t = len(slots)
    x = torch.randn(t, k, generator=g).to(dtype)
    a = (torch.randn(num_slots, len(slices) * rank, k, generator=g) * 0.3).to(dtype)
    b = (torch.randn(num_slots, sum(slices), rank, generator=g) * 0.3).to(dtype)
    y = torch.randn(t, sum(slices), generator=g).to(dtype)
    starts = tuple(int(sum(slices[:j])) for j in range(len(slices)))
    dev = lambda v: v.to(DEVICE)   # noqa: E731
    return dev(x), dev(a), dev(b), dev(y), dev(torch.tensor(slots, dtype=torch.int32)), starts


# a prefill segment per adapter and the base in between (tile path), decode rows of mixed adapters
# (per-row path), a block that is all base (-1), and a block mixing -1 with an adapter
BATCHES = {
    "segments": [0] * 20 + [-1] * 16 + [2] * 17 + [1] * 3,
    "decode_mixed": [0, 2, -1, 1, 1, 0, -1, 2, 2],
    "all_base": [-1] * 18,
    "one_row": [1],
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("batch", list(BATCHES))
@pytest.mark.parametrize("slices", [(12, 6, 6), (10, 10), (7,)])
@pytest.mark.parametrize("block_m", [1, 16])   # one row per program (decode sizes), 16-row blocks (prefill)
def test_shrink_expand_match_reference(dtype, batch, slices, block_m):
    _check_against_reference(dtype, batch, slices, block_m=block_m)


def _check_against_reference(dtype, batch, slices, **kernel_kw):
    """The shrink and the expand (called with kernel_kw) against their references; base rows untouched.
    batch: a name in BATCHES, or the slots themselves."""
    x, a, b, y, slots, starts = _case(dtype, BATCHES[batch] if isinstance(batch, str) else batch, slices=slices)
    xa_ref = lk.lora_shrink_ref(x, a, slots)
    xa = lk.lora_shrink(x, a, slots, out=torch.zeros_like(xa_ref), **kernel_kw)
    tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=3e-2, rtol=3e-2)
    torch.testing.assert_close(xa, xa_ref, **tol)
    want = lk.lora_expand_ref(y.clone(), xa_ref, b, slots, starts)
    got = lk.lora_expand(y.clone(), xa_ref, b, slots, starts, **kernel_kw)
    torch.testing.assert_close(got.float(), want.float(), **tol)
    base = (slots < 0).cpu()
    assert torch.equal(got.cpu()[base], y.cpu()[base])   # the base rows are untouched


@pytest.mark.parametrize("splits", [None, 3])
@pytest.mark.parametrize("batch", ["decode_mixed", "one_row"])
def test_split_k_shrink_partials_sum_in_the_expand(batch, splits):
    # decode sizes split K over programs: the shrink's partials [splits, T, N] sum to xa, and the
    # expand sums them as it reads them (K = 200 so that 16-wide K blocks give several splits)
    x, a, b, y, slots, starts = _case(torch.float32, BATCHES[batch], k=200, slices=(12, 6, 6))
    xa = lk.lora_shrink(x, a, slots, block_m=1, splits=splits)
    base = (slots >= 0).cpu()
    if splits is not None:   # (3 asked: 2 K chunks of whole 128-wide blocks cover K = 200)
        assert xa.dim() == 3 and xa.shape[0] == 2
    whole = xa.sum(0) if xa.dim() == 3 else xa
    torch.testing.assert_close(whole.cpu()[base], lk.lora_shrink_ref(x, a, slots).cpu()[base], atol=1e-5, rtol=1e-5)
    want = lk.lora_expand_ref(y.clone(), lk.lora_shrink_ref(x, a, slots), b, slots, starts)
    got = lk.lora_expand(y.clone(), xa, b, slots, starts, block_m=1)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(lk.lora_expand_ref(y.clone(), xa, b, slots, starts), want, atol=1e-5, rtol=1e-5)


def test_reference_is_the_per_row_product():
    # the reference itself, against the plain formula row by row: y += (x A_s^T)_j B_s,j^T
    x, a, b, y, slots, starts = _case(torch.float32, [1, -1, 0, 2, 1], slices=(12, 6, 6))
    got = lk.lora_expand_ref(y.clone(), lk.lora_shrink_ref(x, a, slots), b, slots, starts)
    for t, s in enumerate(slots.tolist()):
        want = y[t].clone()
        if s >= 0:
            for j, (o0, o1) in enumerate([(0, 12), (12, 18), (18, 24)]):
                want[o0:o1] += b[s, o0:o1] @ (a[s, j * 4:(j + 1) * 4] @ x[t])
        torch.testing.assert_close(got[t], want, atol=1e-5, rtol=1e-5)


def test_strided_rows():
    # the linear's output may be a view with a row stride (a slice of a wider buffer)
    x, a, b, y, slots, starts = _case(torch.float32, BATCHES["decode_mixed"], slices=(10, 10))
    wide = torch.zeros(y.shape[0], 30, device=DEVICE)
    wide[:, 5:25] = y
    lk.lora_expand(wide[:, 5:25], lk.lora_shrink(x, a, slots, block_m=16), b, slots, starts, block_m=16)
    want = lk.lora_expand_ref(y.clone(), lk.lora_shrink_ref(x, a, slots), b, slots, starts)
    torch.testing.assert_close(wide[:, 5:25], want, atol=1e-5, rtol=1e-5)
    assert (wide[:, :5] == 0).all() and (wide[:, 25:] == 0).all()


def test_default_block_rows():
    assert lk._block_m(1, None) == 1 and lk._block_m(lk.ROW_PROGRAMS_MAX, None) == 1
    assert lk._block_m(lk.ROW_PROGRAMS_MAX + 1, None) == 16


@pytest.mark.parametrize("block_m", [1, 16])
def test_wide_output_slices_cross_column_blocks(block_m):
    # q/k/v-like slices wider than one column block, their boundaries inside blocks
    x, a, b, y, slots, starts = _case(torch.float32, [2, 0, -1, 1, 1], k=24, rank=3, slices=(300, 70, 70))
    xa = lk.lora_shrink_ref(x, a, slots)
    want = lk.lora_expand_ref(y.clone(), xa, b, slots, starts)
    got = lk.lora_expand(y.clone(), xa, b, slots, starts, block_m=block_m)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


# the sorted kernels' cases besides BATCHES: a decode graph's padded rows (-1 past the step's
# rows), every row on one slot (slots 0 and 2 empty), rows in adapter order already
SORTED_BATCHES = {**BATCHES, "graph_padded": [2, 0, 1, 2, 0, 1, 1] + [-1] * 25, "one_slot": [1] * 37,
                  "in_order": [0] * 5 + [1] * 33 + [2] * 2}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("batch", list(SORTED_BATCHES))
@pytest.mark.parametrize("slices", [(12, 6, 6), (7,)])
def test_sorted_kernels_match_reference(dtype, batch, slices):
    # rows taken in adapter order, a tile of one adapter's rows per program (short last tiles,
    # base rows in between, empty slots); the grid is fixed by the rows and slots alone
    _check_against_reference(dtype, SORTED_BATCHES[batch], slices, sorted_rows=True)


def test_sorted_round_robin_over_eight_slots():
    # the bench's decode batch scaled down: 256 rows, row i on slot i % 8 except every 5th on the
    # base: each slot's 25-27 rows span two 32-row tiles of other rows; split over K, partials
    # summed by the expand as it reads them
    slots_list = [-1 if i % 5 == 4 else i % 8 for i in range(256)]
    x, a, b, y, slots, starts = _case(torch.float32, slots_list, k=300, num_slots=8)
    xa = lk.lora_shrink(x, a, slots, splits=3, sorted_rows=True)
    assert xa.shape[0] == 3
    xa_ref = lk.lora_shrink_ref(x, a, slots)
    used = (slots >= 0).cpu()
    torch.testing.assert_close(xa.sum(0).cpu()[used], xa_ref.cpu()[used], atol=1e-4, rtol=1e-5)
    want = lk.lora_expand_ref(y.clone(), xa_ref, b, slots, starts)
    got = lk.lora_expand(y.clone(), xa, b, slots, starts, sorted_rows=True)
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-5)
    assert torch.equal(got.cpu()[~used], y.cpu()[~used])


def test_sorted_tiles_cover_every_row_once():
    # the sort itself, on the host: for every slot layout the grid's tiles hold each adapter row
    # exactly once and no base row (a program past the last tile stores nothing): the shrink
    # into a buffer of -7s leaves the base rows at -7 and writes every other row
    for slots_list in ([3] * 40, [3] * 32 + [0] * 16, [-1] * 9 + [0], [i % 4 for i in range(70)],
                       [1, 1, 0, 0, 3, 3, -1, 2]):
        x, a, b, y, slots, starts = _case(torch.float32, slots_list, num_slots=4)
        out = torch.full((len(slots_list), a.shape[1]), -7.0, device=DEVICE)
        lk.lora_shrink(x, a, slots, out=out, sorted_rows=True)
        base = (slots < 0).cpu()
        assert (out.cpu()[base] == -7).all()
        torch.testing.assert_close(out.cpu()[~base], lk.lora_shrink_ref(x, a, slots).cpu()[~base], atol=1e-5,
                                   rtol=1e-5)


def test_sorted_rows_setting(monkeypatch):
    monkeypatch.setenv("LOOM_LORA_SORTED_ROWS", "16")
    assert not lk.use_sorted(8, None) and lk.use_sorted(16, None) and lk.use_sorted(lk.SORTED_ROWS_MAX, None)
    assert not lk.use_sorted(lk.SORTED_ROWS_MAX + 1, None)   # (prefill: 16-row blocks)
    assert lk.use_sorted(1, True) and not lk.use_sorted(64, False)
    monkeypatch.setenv("LOOM_LORA_SORTED_ROWS", "0")
    assert not lk.use_sorted(64, None)


def test_one_k_block_per_shrink_program(monkeypatch):
    # LOOM_LORA_SHRINK_K_BLOCKS=1: a batch-1 shrink splits K = 1024 into 8 programs of one 128-wide
    # block each (sm_count is 4 on the CPU: 2 per SM), and the expand sums the 8 partials
    monkeypatch.setenv("LOOM_LORA_SHRINK_K_BLOCKS", "1")
    x, a, b, y, slots, starts = _case(torch.float32, BATCHES["one_row"], k=1024)
    xa = lk.lora_shrink(x, a, slots, block_m=1, splits=None)
    assert xa.dim() == 3 and xa.shape[0] == 8
    want = lk.lora_expand_ref(y.clone(), lk.lora_shrink_ref(x, a, slots), b, slots, starts)
    torch.testing.assert_close(lk.lora_expand(y.clone(), xa, b, slots, starts, block_m=1), want, atol=1e-4, rtol=1e-5)
    monkeypatch.setenv("LOOM_LORA_SHRINK_K_BLOCKS", "4")
    assert lk.lora_shrink(x, a, slots, block_m=1, splits=None).shape[0] == 2


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("batch", ["decode_mixed", "one_row"])
@pytest.mark.parametrize("prologue", ["none", "rms_norm"])
@pytest.mark.parametrize("splits", [1, 3])
def test_expand_in_the_gemv_epilogue(dtype, batch, prologue, splits):
    # the base GEMV plus each row's delta in its epilogue == the product, then the reference expand
    # (decode_mixed cut to gemv's own kernel's 8 rows)
    slots_list = BATCHES[batch][:8] if batch == "decode_mixed" else BATCHES[batch]
    x, a, b, y, slots, starts = _case(dtype, slots_list, k=64)
    g = torch.Generator().manual_seed(5)
    weight = (torch.randn(y.shape[1], x.shape[1], generator=g) * 0.2).to(dtype).to(DEVICE)
    norm_w = (torch.rand(x.shape[1], generator=g) + 0.5).to(dtype).to(DEVICE)
    xa = lk.lora_shrink(x, a, slots, block_m=1, splits=splits)
    tiles = dict(block_n=8, block_k=32, num_warps=4, num_stages=1)
    kw = dict(prologue=prologue, norm_weight=norm_w, eps=1e-6) if prologue != "none" else {}
    base = gv.gemv(x, weight, tiles=tiles, **kw)[0]
    got = gv.gemv(x, weight, tiles=tiles, lora=gv.LoRAEpilogue(xa, b, slots, starts), **kw)[0]
    want = lk.lora_expand_ref(base.clone(), xa, b, slots, starts)
    tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=3e-2, rtol=3e-2)
    torch.testing.assert_close(got.float(), want.float(), **tol)
    rows = (slots < 0).cpu()
    assert torch.equal(got.cpu()[rows], base.cpu()[rows])   # base rows: the product alone
    assert not torch.allclose(got.float(), base.float())    # (the delta is there)


def test_gemv_lora_fallback_past_its_rows():
    # 9 rows: gemv's own kernel takes 8; the product runs elsewhere and the expand after it
    x, a, b, y, slots, starts = _case(torch.float32, BATCHES["decode_mixed"], k=64)
    weight = (torch.randn(y.shape[1], x.shape[1], generator=torch.Generator().manual_seed(5)) * 0.2).to(DEVICE)
    xa = lk.lora_shrink(x, a, slots, block_m=1, splits=1)
    got = gv.gemv(x, weight, lora=gv.LoRAEpilogue(xa, b, slots, starts))[0]
    want = lk.lora_expand_ref(torch.nn.functional.linear(x, weight), xa, b, slots, starts)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("prologue", ["none", "rms_norm", "add_rms_norm", "silu_mul"])
@pytest.mark.parametrize("slot", [1, -1])
@pytest.mark.parametrize("k_chunk", [None, 32])   # (32: K split over 3 programs, partials summed by the GEMV)
def test_shrink_with_the_prologue_fused(dtype, prologue, slot, k_chunk):
    # batch 1: one kernel builds the linear's input (norm or SiLU), writes it (and the new
    # residual) and multiplies it by the row's adapter A: as the prologue's reference, then the
    # reference shrink; then the GEMV on that input with the expand in its epilogue, as the base
    # product plus the reference expand. Slot -1: the input and residual still, no delta.
    k = 96
    x, a, b, y, slots, starts = _case(dtype, [slot], k=k)
    g = torch.Generator().manual_seed(7)
    x_arg = (torch.randn(1, 2 * k, generator=g).to(dtype).to(DEVICE) if prologue == "silu_mul" else x)
    residual = torch.randn(1, k, generator=g).to(dtype).to(DEVICE)
    norm_w = (torch.rand(k, generator=g) + 0.5).to(dtype).to(DEVICE)
    kw = {}
    if prologue in ("rms_norm", "add_rms_norm"):
        kw = dict(norm_weight=norm_w, eps=1e-6, residual=residual if prologue == "add_rms_norm" else None)
    want_in, want_res = gv._prologue(x_arg, prologue, kw.get("residual"), norm_w, 1e-6, gv._REF_OPS)
    xa, x_in, new_res = gv.lora_shrink_prologue(x_arg, a, slots, prologue, k_chunk=k_chunk, **kw)
    assert xa.dim() == (3 if k_chunk else 2)
    tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=3e-2, rtol=3e-2)
    torch.testing.assert_close(x_in.float(), want_in.float(), **tol)
    if prologue == "add_rms_norm":
        torch.testing.assert_close(new_res.float(), want_res.float(), **tol)
    else:
        assert new_res is None
    if slot >= 0:
        torch.testing.assert_close(xa.sum(0) if k_chunk else xa, lk.lora_shrink_ref(x_in, a, slots), **tol)
    weight = (torch.randn(y.shape[1], k, generator=g) * 0.2).to(dtype).to(DEVICE)
    tiles = dict(block_n=8, block_k=32, num_warps=4, num_stages=1)
    base = gv.gemv(x_in, weight, tiles=tiles)[0]
    got = gv.gemv(x_in, weight, tiles=tiles, lora=gv.LoRAEpilogue(xa, b, slots, starts))[0]
    want = lk.lora_expand_ref(base.clone(), lk.lora_shrink_ref(x_in, a, slots), b, slots, starts)
    torch.testing.assert_close(got.float(), want.float(), **tol)
    assert torch.equal(got, base) == (slot < 0)
