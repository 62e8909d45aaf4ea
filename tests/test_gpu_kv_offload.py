"""GPU check of the CPU KV tier (issue 50): pinned host slots and asynchronous copies on the
device's stream, with CUDA graphs and async scheduling (three steps in flight). The demo model's
prompt, pushed out of a small GPU cache by two others and re-sent, loads its blocks from the
host and gives the greedy tokens of the run without the tier; also with an FP8 KV cache.

    python3 -m pytest -q -p no:cacheprovider tests/test_gpu_kv_offload.py
"""
from __future__ import annotations

import random

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


def _run(model_dir: str, **options):
    from frontend import LLM, SamplingParams
    rng = random.Random(7)
    prompts = [[rng.randrange(3, 200) for _ in range(400)] for _ in range(3)]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    # 64 blocks of 16: two 424-token requests fit, the third evicts the first one's blocks
    with LLM(model_dir, max_model_len=512, num_gpu_blocks_override=64, max_num_seqs=1, **options) as llm:
        outs = [list(llm.generate([{"prompt_token_ids": p}], params, use_tqdm=False)[0].outputs[0].token_ids)
                for p in [*prompts, prompts[0]]]
        return outs, llm.stats.prefix_cache_hits


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "fp8"])
def test_cpu_tier_hit_equals_recompute_on_gpu(demo_model_dir, kv_cache_dtype):
    base, base_hits = _run(demo_model_dir, kv_cache_dtype=kv_cache_dtype)
    outs, hits = _run(demo_model_dir, kv_cache_dtype=kv_cache_dtype, kv_offloading_size=0.5)
    assert outs == base
    assert hits >= base_hits + 10 * 16   # most of the first prompt came back from the host
