"""GPU-only checks of paged attention's long-prefill path (issue 49 item 3): the long tiles and the
causal split, compiled, at Qwen3-0.6B's and Llama-3.1-8B's heads, against the torch reference.

    python3 -m pytest -q -p no:cacheprovider tests/test_gpu_long_context.py
"""
from __future__ import annotations

import pytest
import torch

from bench.kernels_gpu import _paged_batch
from kernels import paged_attention as pa

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


@pytest.mark.parametrize("hq, hkv", [(16, 8), (32, 8)])
@pytest.mark.parametrize("tiles", [(128, 64, 8, 3), (128, 128, 8, 2), (64, 64, 4, 3)])
def test_long_prefill_tiles_match_reference(hq, hkv, tiles, monkeypatch):
    # chunks of 1,000 and 700 queries over 4,200 and 5,000 keys (long prefill), a whole 300-token prompt
    # and two decodes ahead of them at 6,000 keys: the mixed batch's second launch takes the long tiles
    monkeypatch.setattr(pa, "_long_prefill_setting", lambda: tiles)
    gen = torch.Generator(device="cuda").manual_seed(0)
    q_lens, seq_lens = [1, 1, 1000, 700, 300], [6000, 5999, 4200, 5000, 300]
    q, kc, vc, qsl, sl, bt = _paged_batch(q_lens, seq_lens, hq, hkv, 128, 16, torch.bfloat16, "cuda", gen)
    assert pa.tile_config(hq // hkv, 128, 1000, False, 1, 8.0, 6000)["block_m"] == tiles[0]
    ref = pa.paged_attention_ref(q, kc, vc, qsl, sl, bt, 128 ** -0.5).float()
    for nd in (0, 2):
        out = pa.paged_attention(q, kc, vc, qsl, sl, bt, 128 ** -0.5, max(q_lens), max(seq_lens), num_decodes=nd)
        torch.testing.assert_close(out.float(), ref, atol=2e-2, rtol=2e-2)
