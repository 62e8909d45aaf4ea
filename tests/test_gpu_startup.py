"""Start-up on the GPU (issue 49): a phase's Triton kernels compiled ahead in parallel by a dry
run (workers/compile_ahead.py): the real run compiles nothing more, its results are exact, and
a value out of a skipped kernel that indexes a torch op in the dry run is a valid index."""
from __future__ import annotations

import os
import random

import pytest
import torch
import triton
import triton.language as tl

from workers.compile_ahead import compile_ahead, run_compiled_ahead, threads

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


@triton.jit
def _scaled_index(x_ptr, out_ptr, n, SCALE: tl.constexpr, MOD: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(x_ptr + offs, mask=offs < n, other=0)
    tl.store(out_ptr + offs, (x * SCALE) % MOD, mask=offs < n)


def _phase(x: torch.Tensor, table: torch.Tensor, scales: list[int]) -> list[torch.Tensor]:
    out = []
    for scale in scales:
        idx = torch.empty_like(x)   # the dry run leaves it as allocated: zeroed, a valid index
        _scaled_index[(triton.cdiv(x.numel(), 128),)](x, idx, x.numel(), SCALE=scale, MOD=table.numel(), BLOCK=128)
        out.append(table[idx] * 2)  # a gather: an out-of-range index would be a device assert
    return out


def test_compiled_ahead_the_real_run_compiles_nothing(tmp_path, monkeypatch):
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("LOOM_COMPILE_THREADS", "4")
    device = torch.device("cuda", torch.cuda.current_device())
    assert threads(device) == 4
    scales = random.sample(range(3, 10_000), 6)   # variants no earlier run compiled
    x = torch.arange(1000, device=device, dtype=torch.int64)
    table = torch.randn(97, device=device)
    kernels = _scaled_index.device_caches[device.index][0]
    before = len(kernels)
    compile_ahead(lambda: _phase(x, table, scales), device, "test")
    assert len(kernels) == before + len(scales)
    on_disk = sorted(os.listdir(tmp_path))
    assert len(on_disk) >= len(scales)
    got = run_compiled_ahead(lambda: _phase(x, table, scales), device, "test")   # a second dry run: all cached
    assert len(kernels) == before + len(scales) and sorted(os.listdir(tmp_path)) == on_disk
    for scale, g in zip(scales, got):
        torch.testing.assert_close(g, table[(x * scale) % table.numel()] * 2, rtol=0, atol=0)
