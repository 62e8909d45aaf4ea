"""The CPU tier of the KV cache (--kv-offloading-size): blocks evicted from a small GPU cache are
kept in host memory, a prompt re-sent after its blocks left the GPU loads them back (prefix-cache
hits, no recompute) with the same greedy tokens as without the tier, and the budget holds."""
from __future__ import annotations

import random

import pytest

from engine_core.kv_offload import CPUTier
from ipc.config import ConfigError, EngineConfig

BS = 4


def _prompts():
    rng = random.Random(5)
    a = [rng.randrange(3, 250) for _ in range(30)]
    others = [[rng.randrange(3, 250) for _ in range(30)] for _ in range(3)]
    return a, others


def _run(model_dir, multiprocess=False, **options):
    from frontend import LLM, SamplingParams
    a, others = _prompts()
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    # 24 blocks of 4: one 36-token request at a time fits, the others evict a's blocks
    with LLM(model_dir, multiprocess=multiprocess, max_model_len=64, block_size=BS, num_gpu_blocks_override=24,
             max_num_seqs=1, **options) as llm:
        outs = []
        for p in [a, *others, a]:
            outs.append(list(llm.generate([{"prompt_token_ids": p}], params, use_tqdm=False)[0].outputs[0].token_ids))
        if multiprocess:
            return outs, None, {"hits": llm.stats.prefix_cache_hits}
        engine = llm.client.engine
        host = engine.executor.runner.cpu_tier
        return outs, engine.scheduler.kv.pool.cpu_tier, {"hits": llm.stats.prefix_cache_hits,
                                                         "host_bytes": host.nbytes() if host is not None else 0}


def test_cpu_tier_hit_matches_recompute(model_factory):
    model = model_factory("qwen3")
    base, none_tier, base_info = _run(model)
    assert none_tier is None
    outs, tier, info = _run(model, kv_offloading_size=0.001)
    assert outs == base                        # greedy tokens equal after loading from the CPU tier
    assert tier.num_stored > 0 and tier.num_loaded >= 7   # a's 7 full prompt blocks came back from the host
    assert len(tier) <= tier.num_slots
    assert 0 < info["host_bytes"] <= 0.001 * 2 ** 30   # the host budget, exactly slots x block bytes
    assert base_info["hits"] == 0 and info["hits"] >= 7 * BS   # the prefix-cache hits are the tier's


def test_cpu_tier_with_tensor_parallel_worker_processes(model_factory):
    """The engine and two tensor-parallel workers in their own processes, each rank storing and
    loading its own heads: the re-sent prompt (from the tier) gives its first (computed) tokens."""
    outs, _, info = _run(model_factory("qwen3"), multiprocess=True, tensor_parallel_size=2, kv_offloading_size=0.001)
    assert outs[-1] == outs[0] and info["hits"] >= 7 * BS


def test_tier_lru_never_exceeds_its_slots():
    tier = CPUTier(3)
    for i in range(10):
        tier.store(bytes([i]), i)
        assert len(tier) <= 3
    assert [tier.lookup(bytes([i])) is not None for i in range(10)] == [False] * 7 + [True] * 3
    x = tier.take_transfers()
    assert len(x.store_blocks) == 10 and set(x.store_slots) == {0, 1, 2}
    tier.pin([bytes([7])])
    tier.load(bytes([7]), 50)
    tier.store(bytes([42]), 42)   # evicts the least recent that is not being loaded: 8
    assert tier.lookup(bytes([7])) is not None and tier.lookup(bytes([8])) is None
    tier.clear()
    assert len(tier) == 0 and tier.take_transfers() is None


def test_offload_flags_checked():
    with pytest.raises(ConfigError, match="kv-offloading-size"):
        EngineConfig(model="x", kv_offloading_size=0, max_model_len=64, max_num_batched_tokens=64).check()
    with pytest.raises(ConfigError, match="needs --kv-offloading-size"):
        EngineConfig(model="x", kv_offloading_backend="native", max_model_len=64, max_num_batched_tokens=64).check()


def test_copy_runs():
    from workers.kv_offload import _runs
    assert _runs([4, 5, 6, 9, 10, 2], [0, 1, 2, 3, 4, 7]) == [(4, 0, 3), (9, 3, 2), (2, 7, 1)]
    assert _runs([], []) == []
    from workers.kv_offload import _by_slot
    # a prompt's slots, evicted tail first, go down along it: in slot order, one run; a slot stored
    # twice in a step keeps its later store last
    assert _by_slot([10, 11, 12], [7, 6, 5]) == ([12, 11, 10], [5, 6, 7])
    assert _by_slot([1, 2, 3], [4, 3, 4]) == ([2, 1, 3], [3, 4, 4])


def test_sleep_level_1_keeps_the_tier_level_2_drops_it(model_factory):
    from frontend import LLM, SamplingParams
    a, others = _prompts()
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    with LLM(model_factory("qwen3"), multiprocess=False, max_model_len=64, block_size=BS, num_gpu_blocks_override=24,
             max_num_seqs=1, enable_sleep_mode=True, kv_offloading_size=0.001) as llm:
        def gen(p):
            return list(llm.generate([{"prompt_token_ids": p}], params, use_tqdm=False)[0].outputs[0].token_ids)
        first = gen(a)
        for p in others:   # a's blocks go to the tier
            gen(p)
        tier = llm.client.engine.scheduler.kv.pool.cpu_tier
        for level, kept in ((1, True), (2, False)):
            llm.sleep(level)
            llm.wake_up()
            hits = llm.stats.prefix_cache_hits
            assert gen(a) == first
            assert (llm.stats.prefix_cache_hits - hits >= 7 * BS) == kept, level
            if level == 1:   # a's blocks back in the tier for level 2
                for p in others:
                    gen(p)
        assert len(tier) == 0   # dropped at level 2 (and a's run alone evicted nothing since)


def test_scattered_blocks_copy_through_staging():
    """Blocks scattered over the GPU cache (runs of one) and over the tier: stored then loaded back
    through the staged path (more than 8 runs, more than a chunk) they come back exactly."""
    import random

    import torch

    from workers import kv_offload
    from workers.kv_offload import HostKVTier
    from ipc.messages import KVTransfers
    rng = random.Random(0)
    kv = [(torch.randn(700, 4, 2, 8), torch.randn(700, 4, 2, 8)) for _ in range(2)]
    tier = HostKVTier(600, kv)
    blocks = rng.sample(range(700), 300)          # > _CHUNK_BLOCKS, hundreds of runs
    slots = list(range(40, 190)) + rng.sample(range(200, 600), 150)
    assert len(kv_offload._runs(blocks, slots)) > kv_offload._DIRECT_RUNS
    tier.apply(KVTransfers(blocks, slots, [], []), kv)
    for (k, v), (hk, hv) in zip(kv, tier.host):
        assert torch.equal(hk[slots], k[blocks]) and torch.equal(hv[slots], v[blocks])
    want = [(k[blocks].clone(), v[blocks].clone()) for k, v in kv]
    dest = rng.sample(range(700), 300)
    tier.apply(KVTransfers([], [], slots, dest), kv)
    for (k, v), (wk, wv) in zip(kv, want):
        assert torch.equal(k[dest], wk) and torch.equal(v[dest], wv)


def test_rehit_computes_its_last_block_and_loads_in_few_copies(model_factory):
    """bench/kv_offload.py's TTFT case scaled down: a prompt pushed out of the GPU cache by two
    others (tail first, so its tier slots go down along the prefix) and re-sent computes only its
    last block, and its loads take a run of host slots per copy, not one copy per block and
    layer's keys or values (the 32k re-hit's 127k copies: 1.2 s on the H200)."""
    from frontend import LLM, SamplingParams
    rng = random.Random(3)
    n = 48 * BS
    prompts = [[rng.randrange(3, 250) for _ in range(n)] for _ in range(3)]
    one = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    with LLM(model_factory("qwen3"), multiprocess=False, max_model_len=n + 16, block_size=BS,
             num_gpu_blocks_override=2 * 48 + 4, kv_offloading_size=0.01) as llm:
        for p in prompts:
            llm.generate([{"prompt_token_ids": p}], one, use_tqdm=False)
        engine = llm.client.engine
        tier, host = engine.scheduler.kv.pool.cpu_tier, engine.executor.runner.cpu_tier
        loaded, copies = tier.num_loaded, host.num_host_copies
        out = llm.generate([{"prompt_token_ids": prompts[0]}], one, use_tqdm=False)[0]
        num_tensors = sum(len(kv) for kv in engine.executor.runner.kv_caches)
    assert out.num_cached_tokens == n - BS   # every full block but the last (a token is left to compute)
    assert tier.num_loaded - loaded >= 40    # most of them from the tier
    assert host.num_host_copies - copies <= 4 * num_tensors   # a run or two of stores and of loads, per tensor


def check_loads_follow_stores(device: str, block_shape: tuple = (2, 1, 4)) -> None:
    """One step's transfers over three chunks each way: loads over blocks that the step stores first
    (evicted to make room) and of slots that it stores first (stored and re-hit in one step) give
    what all the stores, then all the loads, would. (tests/test_gpu_kv_offload_stream.py: on CUDA.)"""
    import torch

    from ipc.messages import KVTransfers
    from workers.kv_offload import HostKVTier
    rng = random.Random(1)
    kv = [tuple(torch.randn(1500, *block_shape, device=device) for _ in "kv") for _ in range(2)]
    tier = HostKVTier(1500, kv)
    for host_kv in tier.host:
        for t in host_kv:
            t.copy_(torch.randn_like(t))
    store_blocks = rng.sample(range(1500), 700)
    store_slots = rng.sample(range(1500), 700)
    # loads: over 300 of the stored blocks and 300 others; from 250 stored slots and 350 untouched
    load_blocks = rng.sample(store_blocks, 300) + rng.sample(sorted(set(range(1500)) - set(store_blocks)), 300)
    load_slots = rng.sample(store_slots, 250) + rng.sample(sorted(set(range(1500)) - set(store_slots)), 350)
    rng.shuffle(load_slots)
    want = []
    for dev_kv, host_kv in zip(kv, tier.host):
        for dev, host in zip(dev_kv, host_kv):
            d, h = dev.cpu().clone(), host.clone()
            h[store_slots] = d[store_blocks]
            d[load_blocks] = h[load_slots]
            want.append((d, h))
    tier.apply(KVTransfers(store_blocks, store_slots, load_slots, load_blocks), kv)
    if device == "cuda":
        tier.wait_forward()
        torch.cuda.synchronize()
    got = [(dev.cpu(), host) for dev_kv, host_kv in zip(kv, tier.host) for dev, host in zip(dev_kv, host_kv)]
    for (d, h), (wd, wh) in zip(got, want):
        assert torch.equal(d, wd) and torch.equal(h, wh)


def test_loads_follow_the_stores_they_depend_on():
    """A step's loads of a layer go after that layer's stores (on CUDA the two directions run on two
    streams; on CPU in the order the streams are issued)."""
    check_loads_follow_stores("cpu")


def test_copies_go_layer_by_layer_with_an_event_each():
    """apply() records each layer's copies, which wait_layer() consumes once (a piecewise forward
    waits there, layer by layer) and wait_forward() forgets (it waits for all of them)."""
    import torch

    from ipc.messages import KVTransfers
    from workers.kv_offload import HostKVTier
    kv = [tuple(torch.randn(40, 2, 1, 4) for _ in "kv") for _ in range(3)]
    tier = HostKVTier(40, kv)
    tier.wait_layer(kv[0])   # a forward before any copies
    tier.apply(KVTransfers([1, 2], [5, 6], [5], [9]), kv)
    assert set(tier._layers) == {id(k) for k, _ in kv}
    for k, v in kv:
        tier.wait_layer((k, v))
        assert torch.equal(k[9], k[1]) and torch.equal(v[9], v[1])   # slot 5 took block 1, then went to block 9
    assert not tier._layers
    tier.apply(KVTransfers([3], [7], [], []), kv)
    tier.wait_forward()
    assert not tier._layers
    tier.apply(KVTransfers([3], [7], [], []), kv)
    tier.wait_layer((kv[0][0][:1], kv[0][1][:1]))   # a cache it does not know: it waits for every layer
    assert not tier._layers
