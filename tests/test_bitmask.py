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
    apply_bitmask(ours, bitmask, rows)
    apply_bitmask_reference(ref, bitmask, rows.long())
    full = torch.full((5, words), -1, dtype=torch.int32)   # xgrammar: bitmask row i masks logits row i
    full[rows.long()] = bitmask
    xgr.apply_token_bitmask_inplace(theirs, full, indices=rows.tolist())
    assert torch.equal(ours, ref)
    assert torch.equal(ours, theirs)
    assert torch.equal(ours[1], logits[1]) and torch.equal(ours[3], logits[3])   # unlisted rows untouched
    assert torch.equal(ours[0], logits[0])                                        # all bits set
    assert torch.isinf(ours[4]).any()
