"""GPU check of the CPU KV tier's side stream (issue 50): the tier's copies run on a stream of
their own, ordered against the compute stream by events only (no host sync), and greedy output
after tier hits equals recomputation under a batched, async-scheduled load whose steps store and
load while the model runs.

    python3 -m pytest -q -p no:cacheprovider tests/test_gpu_kv_offload_stream.py
"""
from __future__ import annotations

import random

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


def test_side_stream_copies_are_ordered_by_events():
    """Store blocks, overwrite them on the compute stream (after wait_forward), load them back into
    other blocks: the loaded blocks hold the values from before the overwrite."""
    from ipc.messages import KVTransfers
    from workers.kv_offload import HostKVTier
    dev = torch.device("cuda")
    kv = [(torch.randn(32, 16, 8, 128, device=dev), torch.randn(32, 16, 8, 128, device=dev)) for _ in range(4)]
    want = [(k[:8].clone(), v[:8].clone()) for k, v in kv]
    tier = HostKVTier(16, kv)
    assert torch.cuda.current_stream() not in (tier.store_stream, tier.load_stream)
    assert tier.store_stream is not None and tier.load_stream is not None
    tier.apply(KVTransfers(list(range(8)), list(range(8, 16)), [], []), kv)
    tier.wait_forward()
    for k, v in kv:   # the "forward" writes over the stored blocks
        k[:8].fill_(0)
        v[:8].fill_(0)
    tier.apply(KVTransfers([], [], list(range(8, 16)), list(range(20, 28))), kv)
    tier.wait_forward()
    for (k, v), (wk, wv) in zip(kv, want):
        assert torch.equal(k[20:28], wk) and torch.equal(v[20:28], wv)
        assert not k[:8].any()


def test_loads_follow_the_stores_they_depend_on_across_streams():
    """Stores (D2H) and loads (H2D) on their two streams, each chunk of loads after the chunks of
    stores it depends on: what all the stores, then all the loads, would give (blocks of
    Llama-3.1-8B's shape, so the chunks take long enough to race)."""
    from tests.test_kv_offload import check_loads_follow_stores
    check_loads_follow_stores("cuda", (16, 8, 128))


def test_layer_waits_let_each_layer_be_written_after_its_own_copies():
    """A step's copies over 8 layers of Llama-3.1-8B-sized blocks, then, layer by layer on the compute
    stream, wait_layer and write over the blocks that layer stored (as a piecewise forward's piece
    writes the layer's new keys): the tier holds the values from before the writes, the loaded
    blocks the tier's."""
    from ipc.messages import KVTransfers
    from workers.kv_offload import HostKVTier
    dev = torch.device("cuda")
    kv = [tuple(torch.randn(1200, 16, 8, 128, device=dev, dtype=torch.bfloat16) for _ in "kv") for _ in range(8)]
    tier = HostKVTier(1200, kv)
    for host_kv in tier.host:
        for t in host_kv:
            t.copy_(torch.randn(t.shape, dtype=t.dtype))
    rng = random.Random(3)
    store_blocks, store_slots = rng.sample(range(1200), 500), rng.sample(range(600), 500)
    load_blocks, load_slots = rng.sample(store_blocks, 400), rng.sample(range(600, 1200), 400)
    want_host = [tuple(t[store_blocks].cpu() for t in dev_kv) for dev_kv in kv]
    want_loaded = [tuple(t[load_slots] for t in host_kv) for host_kv in tier.host]
    torch.cuda.synchronize()
    tier.apply(KVTransfers(store_blocks, store_slots, load_slots, load_blocks), kv)
    rows = torch.tensor(sorted(set(store_blocks) - set(load_blocks)), device=dev)
    for dev_kv in kv:
        tier.wait_layer(dev_kv)
        for t in dev_kv:   # the piece writes this layer's new keys and values over evicted blocks
            t.index_fill_(0, rows, 0)
    torch.cuda.synchronize()
    for dev_kv, host_kv, stored, loaded in zip(kv, tier.host, want_host, want_loaded):
        for t, h, s, ld in zip(dev_kv, host_kv, stored, loaded):
            assert torch.equal(h[store_slots], s)
            assert torch.equal(t[load_blocks].cpu(), ld)


def _batched(model_dir: str, **options):
    from frontend import LLM, SamplingParams
    rng = random.Random(11)
    prompts = [[rng.randrange(3, 200) for _ in range(300)] for _ in range(6)]
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    # 80 blocks of 16: three requests at a time fit, each round evicts the previous round's prefixes
    with LLM(model_dir, max_model_len=512, num_gpu_blocks_override=80, max_num_seqs=3, **options) as llm:
        outs = []
        for _ in range(3):
            outs += [list(o.outputs[0].token_ids) for o in
                     llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)]
        return outs, llm.stats.prefix_cache_hits


def test_tier_hits_on_side_stream_equal_recompute(demo_model_dir):
    base, base_hits = _batched(demo_model_dir)
    outs, hits = _batched(demo_model_dir, kv_offloading_size=0.5)
    assert outs == base
    assert hits > base_hits   # the tier served blocks the GPU cache had lost
