"""kernels/bitmask.py: the Triton kernel (interpreted on CPU) equals its torch reference and
xgrammar's own apply_token_bitmask_inplace."""
from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest
import torch

from kernels.bitmask import apply_bitmask, apply_bitmask_reference


@pytest.mark.parametrize("vocab", [37, 64, 1100])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_bitmask_kernel_matches_reference_and_xgrammar(vocab, dtype):
    import xgrammar as xgr
    g = torch.Generator().manual_seed(vocab)
    logits = torch.randn(5, vocab, generator=g).to(dtype)
    words = (vocab + 31) // 32
    bitmask = torch.randint(-2**31, 2**31 - 1, (3, words), generator=g, dtype=torch.int64).to(torch.int32)
    bitmask[1] = -1  # all allowed
    rows = torch.tensor([4, 0, 2], dtype=torch.int32)
    ours, ref, theirs = logits.clone(), logits.clone(), logits.clone()
    mask_rows = torch.tensor([0, 1, 2], dtype=torch.int32)
    apply_bitmask(ours, bitmask, rows, mask_rows)
    apply_bitmask_reference(ref, bitmask, rows.long(), mask_rows)
    full = torch.full((5, words), -1, dtype=torch.int32)   # xgrammar: bitmask row i masks logits row i
    full[rows.long()] = bitmask
    xgr.apply_token_bitmask_inplace(theirs, full, indices=rows.tolist())
    assert torch.equal(ours, ref)
    assert torch.equal(ours, theirs)
    assert torch.equal(ours[1], logits[1]) and torch.equal(ours[3], logits[3])   # unlisted rows untouched
    assert torch.equal(ours[0], logits[0])                                        # all bits set
    assert torch.isinf(ours[4]).any()


def test_rows_share_a_mask_row():
    logits = torch.randn(4, 100)
    bitmask = torch.tensor([[0b1011] + [0] * 3, [-1] * 4], dtype=torch.int32)
    ours, ref = logits.clone(), logits.clone()
    rows, mask_rows = torch.tensor([0, 2, 3], dtype=torch.int32), torch.tensor([0, 1, 0], dtype=torch.int32)
    apply_bitmask(ours, bitmask, rows, mask_rows)
    apply_bitmask_reference(ref, bitmask, rows, mask_rows)
    assert torch.equal(ours, ref)
    for r in (0, 3):
        assert torch.isfinite(ours[r]).nonzero().flatten().tolist() == [0, 1, 3]
    assert torch.equal(ours[1], logits[1]) and torch.equal(ours[2], logits[2])


def test_mask_row_minus_one_leaves_the_row():
    """A decode graph's head masks every row it samples; an unconstrained row has mask row -1."""
    logits = torch.randn(3, 70)
    bitmask = torch.tensor([[0b110, 0, 0]], dtype=torch.int32)
    ours, ref = logits.clone(), logits.clone()
    rows, mask_rows = torch.arange(3, dtype=torch.int32), torch.tensor([-1, 0, -1], dtype=torch.int32)
    apply_bitmask(ours, bitmask, rows, mask_rows)
    apply_bitmask_reference(ref, bitmask, rows, mask_rows)
    assert torch.equal(ours, ref)
    assert torch.equal(ours[0], logits[0]) and torch.equal(ours[2], logits[2])
    assert torch.isfinite(ours[1]).nonzero().flatten().tolist() == [1, 2]


def test_distinct_rows_round_trip():
    import numpy as np
    from engine_core.structured_output import _distinct_rows
    rng = np.random.default_rng(0)
    base = rng.integers(-2**31, 2**31 - 1, (3, 300), dtype=np.int64).astype(np.int32)
    bm = base[rng.integers(0, 3, 40)]
    bm[5, 1] ^= 1   # differs from its twin only outside the sampled words: must not be merged
    distinct, which = _distinct_rows(bm)
    assert which is None or np.array_equal(distinct[which], bm)
    bm[5, 1] ^= 1
    distinct, which = _distinct_rows(bm)
    assert len(distinct) == 3 and np.array_equal(distinct[which], bm)
