"""Identical output under every schedule: prefix caching on, every prompt chunked,
a KV cache so small that requests are preempted and resumed, and overlapped (async)
scheduling on and off. Greedy and seeded, against an ample synchronous run."""
from __future__ import annotations

import random

import pytest

from frontend import LLM, SamplingParams

ENGINE_IN_PROCESS = True   # outputs only: the engine in the test process (tests/conftest.py engine_in_process)

MAX_NEW = 10


def _workload(vocab: int) -> list[list[int]]:
    rng = random.Random(1)
    shared = [rng.randrange(3, vocab - 16) for _ in range(21)]
    prompts = [shared + [rng.randrange(3, vocab - 16) for _ in range(k)] for k in (1, 5, 11)]
    prompts += [[rng.randrange(3, vocab - 16) for _ in range(k)] for k in (2, 19, 33, 7)]
    return prompts


def _run(model_dir: str, prompts, params, **options):
    llm = LLM(model_dir, max_model_len=64, block_size=4, **options)
    try:
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        return [o.outputs[0].token_ids for o in outs], llm.stats
    finally:
        llm.shutdown()


@pytest.fixture(scope="module")
def setup(model_factory):
    model_dir = model_factory("qwen3")
    prompts = _workload(300)
    greedy = [SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True)] * len(prompts)
    seeded = [SamplingParams(temperature=0.9, top_p=0.9, seed=100 + i, max_tokens=MAX_NEW, ignore_eos=True)
              for i in range(len(prompts))]
    params = greedy + seeded
    ample, _ = _run(model_dir, prompts + prompts, params, enable_prefix_caching=False, async_scheduling=False)
    return model_dir, prompts + prompts, params, ample


@pytest.mark.parametrize("name,options", [
    # max_num_seqs=2: later prompts are admitted after the shared prefix is cached, whatever the timing
    ("prefix_caching", dict(enable_prefix_caching=True, max_num_seqs=2)),
    ("chunked", dict(max_num_batched_tokens=8, max_num_seqs=4)),
    ("preempted", dict(num_gpu_blocks_override=20, max_num_seqs=8)),
    ("async", dict(async_scheduling=True)),
    ("sync_chunked_preempted", dict(async_scheduling=False, num_gpu_blocks_override=20,
                                    max_num_batched_tokens=8, max_num_seqs=4)),
    # three steps in flight, as on a GPU: a request preempted with two steps out comes back
    ("three_in_flight_chunked_preempted", dict(num_gpu_blocks_override=20, max_num_batched_tokens=8,
                                               max_num_seqs=4)),
    # the decode graphs' staging, input kernel and head, run uncaptured (the GPU's path): batches of
    # 3 run padded in the size-4 graph; greedy-only steps sample in the head, the others after it
    ("decode_graphs_three_in_flight_preempted", dict(num_gpu_blocks_override=20, max_num_batched_tokens=8,
                                                     max_num_seqs=3)),
])
def test_same_output_under_schedule(setup, name, options, monkeypatch):
    model_dir, prompts, params, ample = setup
    if "three_in_flight" in name:
        monkeypatch.setenv("LOOM_STEPS_IN_FLIGHT", "3")
    if name.startswith("decode_graphs"):
        monkeypatch.setenv("LOOM_DECODE_GRAPHS_ON_CPU", "1")
    got, stats = _run(model_dir, prompts, params, **options)
    assert got == ample
    if name == "prefix_caching":
        assert stats.prefix_cache_hits > 0
    if "preempted" in name:
        assert stats.num_preemptions > 0


def test_prefix_hits_counted_exactly(model_factory):
    """Hits are the full blocks of the shared prefix, as the hash chain predicts."""
    model_dir = model_factory("qwen3")
    bs, shared = 4, list(range(40, 63))          # 23 tokens: 5 full blocks
    llm = LLM(model_dir, max_model_len=64, block_size=bs)
    try:
        params = SamplingParams(temperature=0, max_tokens=3)
        first = llm.generate({"prompt_token_ids": shared + [5]}, params, use_tqdm=False)[0]
        assert first.num_cached_tokens == 0
        q0, h0 = llm.stats.prefix_cache_queries, llm.stats.prefix_cache_hits
        suffixes = [[7], [8, 9, 10], [11] * 6]
        outs = llm.generate([{"prompt_token_ids": shared + s} for s in suffixes], params, use_tqdm=False)
        expected = [(len(shared) // bs) * bs] * len(suffixes)
        assert [o.num_cached_tokens for o in outs] == expected
        assert llm.stats.prefix_cache_hits - h0 == sum(expected)
        assert llm.stats.prefix_cache_queries - q0 == sum(len(shared) + len(s) for s in suffixes)
        # after a reset nothing is found
        assert llm.reset_prefix_cache() is True
        again = llm.generate({"prompt_token_ids": shared + [7]}, params, use_tqdm=False)[0]
        assert again.num_cached_tokens == 0
    finally:
        llm.shutdown()


def test_decode_graph_head_samples_as_eager_steps(model_factory, monkeypatch):
    """Seeded temperature and min-p rows sampled by the decode graphs' head (uncaptured on the
    CPU) draw what eager steps draw, with the previous step's tokens fed on the device."""
    model_dir = model_factory("qwen3")
    prompts = _workload(300)[:5]
    params = [SamplingParams(temperature=0.8, seed=7 + i, min_p=0.05 * (i % 2), max_tokens=MAX_NEW, ignore_eos=True)
              for i in range(len(prompts))]
    eager, _ = _run(model_dir, prompts, params, max_num_seqs=3)
    monkeypatch.setenv("LOOM_DECODE_GRAPHS_ON_CPU", "1")
    monkeypatch.setenv("LOOM_STEPS_IN_FLIGHT", "3")
    graphs, _ = _run(model_dir, prompts, params, max_num_seqs=3)
    assert graphs == eager


def test_penalty_head_samples_as_eager_steps(model_factory, monkeypatch):
    """Seeded top-p rows with repetition / presence / frequency penalties (some without) sampled
    by the decode graphs' penalty head (uncaptured on the CPU; the counts recorded after it) draw
    what eager steps draw, and with LOOM_PENALTY_HEAD_GRAPHS=0 (the eager sampler after the model
    graph) too."""
    model_dir = model_factory("qwen3")
    prompts = _workload(300)[:4]
    pens = [dict(repetition_penalty=1.3, presence_penalty=0.5), dict(frequency_penalty=0.7), {},
            dict(repetition_penalty=0.8, top_p=0.5)]
    params = [SamplingParams(temperature=0.9, seed=3 + i, max_tokens=MAX_NEW, ignore_eos=True,
                             **{"top_p": 0.8, **pens[i]}) for i in range(len(prompts))]
    eager, _ = _run(model_dir, prompts, params, max_num_seqs=3)
    monkeypatch.setenv("LOOM_DECODE_GRAPHS_ON_CPU", "1")
    monkeypatch.setenv("LOOM_STEPS_IN_FLIGHT", "3")
    monkeypatch.setenv("LOOM_PENALTY_HEAD_GRAPHS", "1")
    graphs, _ = _run(model_dir, prompts, params, max_num_seqs=3)
    assert graphs == eager
    monkeypatch.setenv("LOOM_PENALTY_HEAD_GRAPHS", "0")
    assert _run(model_dir, prompts, params, max_num_seqs=3)[0] == eager


def test_penalty_head_applies_the_penalties(model_factory, monkeypatch):
    """Greedy rows with strong penalties in the decode graphs (every step a penalty-head step after
    the prefill) draw what eager steps draw, and the penalties change those draws: a head that
    skipped them (e.g. replaying the plain or grammar head) fails here whatever the seeds."""
    model_dir = model_factory("qwen3")
    prompts = _workload(300)[:3]
    pen = dict(repetition_penalty=2.0, presence_penalty=2.0, frequency_penalty=2.0)
    params = [SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True, **pen)] * len(prompts)
    plain = [SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True)] * len(prompts)
    eager, _ = _run(model_dir, prompts, params, max_num_seqs=3)
    assert eager != _run(model_dir, prompts, plain, max_num_seqs=3)[0]
    monkeypatch.setenv("LOOM_PENALTY_HEAD_GRAPHS", "1")
    monkeypatch.setenv("LOOM_DECODE_GRAPHS_ON_CPU", "1")
    assert _run(model_dir, prompts, params, max_num_seqs=3)[0] == eager
