"""Sliding-window KV trimming (--sliding-window-kv-trim): a model whose every attention layer is
local with window W frees each request's blocks behind the window (engine_core/kv_cache_manager.py).
The block arithmetic and the scheduler in-process; which models qualify, from the model's layers;
and greedy parity with HF through the whole engine (in-process), trimmed or not."""
from __future__ import annotations

import pytest

from engine_core.kv_cache_manager import KVCacheManager
from engine_core.request import RequestStatus
from engine_core.scheduler import Scheduler
from ipc.config import ConfigError, EngineConfig
from tests.test_scheduler import cfg, fake_step, req

ENGINE_IN_PROCESS = True   # outputs only: the engine in the test process (tests/conftest.py engine_in_process)


def _held(kv: KVCacheManager, rid: str) -> list[int]:
    """The indices (within the request) of the blocks it still holds."""
    return [i for i, b in enumerate(kv.req_blocks[rid]) if b is not None]


def test_blocks_behind_the_window_of_the_next_query_are_freed():
    """block 4, window 8: a chunk starting at position c sees keys from c - 7 on."""
    kv = KVCacheManager(16, 4, enable_caching=False, sliding_window=8)
    r = req("a", list(range(1, 41)))
    for c in range(0, 40, 8):   # chunks of 8
        r.num_computed_tokens = c
        assert kv.allocate_slots(r, 8) is not None
        first = max(c - 7, 0) // 4
        assert _held(kv, "a") == list(range(first, (c + 8) // 4)), c
        assert kv.pool.num_free_blocks == 16 - len(_held(kv, "a"))
    r.num_computed_tokens = 40
    for c in range(40, 47):     # decodes: one block in flight behind the window at most
        r.num_computed_tokens = c
        kv.allocate_slots(r, 1)
        assert _held(kv, "a")[0] == (c - 7) // 4 and len(_held(kv, "a")) <= 3
    assert kv.block_ids("a")[:8] == [0] * 8   # the trimmed places (never read by the kernels)
    kv.free(r)
    assert kv.pool.num_free_blocks == 16


def test_no_window_keeps_every_block():
    kv = KVCacheManager(16, 4, enable_caching=False)
    r = req("a", list(range(1, 41)))
    for c in range(0, 40, 8):
        r.num_computed_tokens = c
        kv.allocate_slots(r, 8)
    assert _held(kv, "a") == list(range(10))


def test_trimmed_blocks_stay_in_the_prefix_cache_and_hits_behind_the_window_are_not_taken():
    kv = KVCacheManager(16, 4, enable_caching=True, sliding_window=8)
    prompt = list(range(1, 33))
    a = req("a", prompt)
    for c in range(0, 32, 8):
        a.num_computed_tokens = c
        kv.allocate_slots(a, 8)
        kv.cache_blocks(a, c + 8)
    trimmed = [b for b in kv.pool.blocks if b.ref_cnt == 0 and b.block_hash is not None]
    assert len(trimmed) == len(kv.req_blocks["a"]) - len(_held(kv, "a")) > 0   # free, still cached
    kv.free(a)
    b = req("b", prompt + [99])
    hits = kv.get_computed_blocks(b)
    assert len(hits) == 8     # the whole cached prompt: the hash chain holds through trimmed blocks
    free_before = kv.pool.num_free_blocks
    assert kv.allocate_slots(b, 1, hits) is not None
    # its query at 32 sees keys from 25 on: blocks 6, 7 (hits, revived) and 8 (new); 0-5 not taken
    assert _held(kv, "b") == [6, 7, 8] and kv.block_ids("b")[:6] == [0] * 6
    assert kv.pool.num_free_blocks == free_before - 3
    assert all(h.ref_cnt == 0 for h in hits[:6])


def test_a_hit_needs_only_the_window_cached():
    """Blocks behind the window may be evicted: a prompt still hits up to the end of a run of
    cached blocks as long as the window (7 keys: 2 blocks) before its next query."""
    kv = KVCacheManager(12, 4, enable_caching=True, sliding_window=8)
    prompt = list(range(1, 33))
    a = req("a", prompt)
    for c in range(0, 32, 8):
        a.num_computed_tokens = c
        kv.allocate_slots(a, 8)
        kv.cache_blocks(a, c + 8)
    kv.free(a)
    taken = []
    while any(kv.pool.lookup(h) for h in a.block_hashes[:3]):   # the LRU evicts the oldest first
        taken += kv.pool.take_new(1)
    b = req("b", prompt + [99])
    hits = kv.get_computed_blocks(b)
    assert len(hits) == 8 and hits[:3] == [None] * 3 and all(hits[3:])
    assert kv.allocate_slots(b, 1, hits) is not None and _held(kv, "b") == [6, 7, 8]
    kv.free(b)
    kv.pool.free(taken)
    while kv.pool.lookup(a.block_hashes[7]):   # the window's last block evicted: no hit of 8 blocks
        kv.pool.take_new(1)
    assert len(kv.get_computed_blocks(req("c", prompt + [99]))) < 8


def _run(s: Scheduler, requests) -> None:
    for r in requests:
        s.add_request(r)
    for _ in range(500):
        if not s.has_unfinished():
            return
        fake_step(s)
    raise AssertionError("did not finish")


@pytest.mark.parametrize("caching", [False, True])
def test_long_requests_fit_without_preemption_only_when_trimmed(caching):
    """16 blocks of 4 tokens; three requests of 40 prompt + 8 output tokens in chunks of 8. With
    the window 8 each holds at most 5 blocks at once, so all three run together; keeping their
    whole context (12 blocks each) needs preemption."""
    def run(window):
        s = Scheduler(cfg(max_num_batched_tokens=8, enable_prefix_caching=caching), 16, kv_window=window)
        rs = [req(f"r{i}", [i + 1] * 40, max_tokens=8, ignore_eos=True) for i in range(3)]
        _run(s, rs)
        assert all(r.status == RequestStatus.FINISHED_LENGTH and len(r.output_token_ids) == 8 for r in rs)
        assert s.kv.pool.num_free_blocks == 16
        return sum(r.num_preemptions for r in rs)
    assert run(8) == 0
    assert run(None) > 0


def test_a_request_longer_than_the_cache_runs_when_trimmed():
    """6 blocks (24 tokens of KV) for a 40-token prompt: alone, with the window it runs; without,
    it can never fit and fails."""
    for window, ok in ((8, True), (None, False)):
        s = Scheduler(cfg(max_num_batched_tokens=8), 6, kv_window=window)
        r = req("long", list(range(1, 41)), max_tokens=8, ignore_eos=True)
        _run(s, [r])
        assert (r.status == RequestStatus.FINISHED_LENGTH and len(r.output_token_ids) == 8) == ok, window
        assert r.num_preemptions == 0 or not ok


def test_check_num_blocks_counts_the_trimmed_request():
    config = EngineConfig(model="unused", max_model_len=4096, max_num_batched_tokens=64, block_size=16)
    with pytest.raises(ConfigError, match="needs 256 blocks"):
        config.check_num_blocks(100)
    config.check_num_blocks(69, kv_window=1024)     # 1023 + 64 tokens: 68 blocks, one more misaligned
    with pytest.raises(ConfigError, match="needs 69 blocks"):
        config.check_num_blocks(68, kv_window=1024)


@pytest.mark.parametrize("arch,overrides,window", [
    ("mistral", {"sliding_window": 48}, 48),                          # every layer local
    ("qwen2", {"use_sliding_window": True, "sliding_window": 48, "max_window_layers": 0}, 48),
    ("qwen2", {"use_sliding_window": True, "sliding_window": 48, "max_window_layers": 1}, None),  # interleaved
    ("qwen3", {}, None),                                               # all global
])
def test_which_models_trim(model_factory, arch, overrides, window):
    import torch

    from workers.attention import model_sliding_window
    from workers.model_loader import load_model
    model = load_model(model_factory(arch, **overrides), torch.float32, "cpu")
    assert model_sliding_window(model) == window


def test_the_cpu_kv_budget_counts_trimmed_requests(model_factory):
    """CPU, no --kv-cache-memory-bytes: room for --max-num-seqs requests as they are held."""
    import torch

    from workers.kv_cache_memory import KVCacheMemory, KVCacheSpec
    from workers.model_loader import load_model, model_kv_shape
    model_dir = model_factory("mistral", sliding_window=8)
    model = load_model(model_dir, torch.float32, "cpu")
    spec = KVCacheSpec(*model_kv_shape(model.config), 4, torch.float32)

    def num_blocks(**kw):
        config = EngineConfig(model=model_dir, max_model_len=96, max_num_seqs=3, max_num_batched_tokens=16,
                              block_size=4, **kw)
        return KVCacheMemory(model, config, torch.device("cpu"), spec, "torch").determine_num_blocks()
    assert num_blocks() == 3 * 7          # 7 + 16 keys and queries: 6 blocks, one more misaligned
    assert num_blocks(sliding_window_kv_trim=False) == 3 * 24


def test_greedy_parity_with_hf_trimmed_or_not(model_factory):
    """A tiny Mistral with window 8 (block 4), prompts several windows long, two sharing a
    28-token prefix (hits, some behind the window), chunks of 16 tokens, 16 tokens decoded
    past the window. 10 blocks hold one whole request (24 blocks at --max-model-len 96) only
    trimmed, and not three at once: preemptions. Kept whole (more blocks): the same tokens."""
    import random

    from frontend import LLM, SamplingParams
    from tests.hf_oracle import hf_greedy
    model_dir = model_factory("mistral", sliding_window=8)
    rng = random.Random(0)
    prefix = [rng.randrange(3, 280) for _ in range(28)]
    prompts = [prefix + [rng.randrange(3, 280) for _ in range(n)] for n in (13, 6)]
    prompts += [[rng.randrange(3, 280) for _ in range(n)] for n in (45, 5)]

    def run(**options):
        with LLM(model_dir, block_size=4, max_model_len=96, max_num_seqs=3, max_num_batched_tokens=16,
                 **options) as llm:
            outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                                SamplingParams(temperature=0, max_tokens=16), use_tqdm=False)
            return [o.outputs[0].token_ids for o in outs], llm.stats, llm.config.eos_token_ids
    trimmed, stats, eos = run()
    assert stats.prefix_cache_hits > 0
    assert trimmed == [hf_greedy(model_dir, p, 16, eos) for p in prompts]
    preempted, stats, _ = run(num_gpu_blocks_override=10)
    assert preempted == trimmed and stats.num_preemptions > 0
    whole, stats, _ = run(sliding_window_kv_trim=False)
    assert whole == trimmed and stats.prefix_cache_hits > 0
    with pytest.raises(ConfigError, match="needs 24 blocks"):   # kept whole, 10 blocks are too few
        run(sliding_window_kv_trim=False, num_gpu_blocks_override=10)
