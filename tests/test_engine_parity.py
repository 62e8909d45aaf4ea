"""Greedy generation through the whole engine (LLM -> engine core -> worker) matches
HF transformers token for token, in float32 on CPU."""
from __future__ import annotations

import random

import pytest

from frontend import LLM, SamplingParams
from frontend.entrypoints.llm import longest_first
from tests.hf_oracle import hf_greedy
from tests.tiny_models import make_tiny_model

ENGINE_IN_PROCESS = True   # outputs only: the engine in the test process (tests/conftest.py engine_in_process)

MAX_NEW = 12


def _prompts(vocab: int, n: int = 5, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    lengths = [3, 17, 9, 30, 1, 24, 5][:n]
    return [[rng.randrange(3, vocab - 16) for _ in range(k)] for k in lengths]


def check_parity(model_dir: str, prompts: list[list[int]], max_new: int = MAX_NEW, **options) -> LLM:
    """Greedy tokens of an engine built with `options` equal HF's, up to max_new or EOS."""
    llm = LLM(model_dir, **options)
    try:
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                            SamplingParams(temperature=0, max_tokens=max_new), use_tqdm=False)
        eos = llm.config.eos_token_ids
        for p, o in zip(prompts, outs):
            ref = hf_greedy(model_dir, p, max_new, eos)
            assert o.outputs[0].token_ids == ref, f"{model_dir}: prompt of {len(p)} tokens diverged"
            assert o.prompt_token_ids == p
            assert o.outputs[0].finish_reason == ("stop" if len(ref) < max_new else "length")
    finally:
        llm.shutdown()
    return llm


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3", "mistral"])
def test_greedy_matches_hf(model_factory, arch):
    # max_num_seqs=2: the later prompts join the batch while earlier ones are decoding.
    model_dir = model_factory(arch)
    check_parity(model_dir, _prompts(300), block_size=4, max_num_seqs=2, max_model_len=128)


def test_llama3_rope_scaling(model_factory):
    model_dir = model_factory("llama", rope_scaling=(("rope_type", "llama3"), ("factor", 8.0),
                                                     ("low_freq_factor", 1.0), ("high_freq_factor", 4.0),
                                                     ("original_max_position_embeddings", 64)))
    check_parity(model_dir, _prompts(300, 3), block_size=8, max_model_len=256)


# YaRN and LongRoPE past original_max_position_embeddings (16): every prompt is longer, so that HF
# uses the scaled (LongRoPE: long) frequencies from its first forward on, as our one cache does
LONG_CONTEXT_ROPE = {
    "yarn": (("rope_type", "yarn"), ("factor", 4.0), ("original_max_position_embeddings", 16)),
    "longrope": (("rope_type", "longrope"), ("original_max_position_embeddings", 16),
                 ("short_factor", (1.0,) * 8), ("long_factor", (1.0, 1.5, 2.0, 3.0, 4.0, 6.0, 8.0, 12.0))),
}


@pytest.mark.parametrize("rope", list(LONG_CONTEXT_ROPE))
def test_long_context_rope_scaling(model_factory, rope):
    model_dir = model_factory("llama", rope_scaling=LONG_CONTEXT_ROPE[rope])
    rng = random.Random(1)
    prompts = [[rng.randrange(3, 284) for _ in range(n)] for n in (17, 29, 40)]
    check_parity(model_dir, prompts, block_size=8, max_num_seqs=2, max_model_len=128)


def test_triton_path_matches_hf(model_factory):
    """The whole engine on the Triton kernels (run by the interpreter on CPU) still matches HF."""
    model_dir = model_factory("qwen3")
    # 6 tokens (each step ~0.5 s in the interpreter): prefills, decodes, and the third prompt
    # joining the batch when the first finishes, as with 12
    check_parity(model_dir, _prompts(300, 3), max_new=6, block_size=8, max_num_seqs=2, max_model_len=64,
                 attention_backend="triton")
    # the kernels are the process's choice (layers.use_kernels): the next in-process engine, on the
    # torch backend, runs the references again
    from workers.models import layers
    from kernels.rms_norm import rms_norm_ref
    check_parity(model_dir, _prompts(300, 1), block_size=8, max_model_len=64)
    assert layers.rms_norm is rms_norm_ref and layers.gemv is None


# window 8: every layer local (Mistral), interleaved by max_window_layers (Qwen2: layer 0 global,
# layer 1 local) and by layer_types (the other way round)
SLIDING = {
    "mistral_all_local": ("mistral", dict(sliding_window=8)),
    "qwen2_max_window_layers": ("qwen2", dict(use_sliding_window=True, sliding_window=8, max_window_layers=1)),
    "qwen2_layer_types": ("qwen2", dict(use_sliding_window=True, sliding_window=8,
                                        layer_types=["sliding_attention", "full_attention"])),
}


@pytest.mark.parametrize("name", SLIDING)
def test_sliding_window_matches_hf(tmp_path, name):
    """Prompts longer than the window (up to 33 + 12 tokens over a window of 8), chunked into
    8-token steps, three of them sharing a cached 21-token prefix, in a KV cache so small that
    requests are preempted: HF's greedy tokens, every one."""
    arch, overrides = SLIDING[name]
    model_dir = make_tiny_model(str(tmp_path), arch, **overrides)   # (a list: not a model_factory key)
    rng = random.Random(1)
    shared = [rng.randrange(3, 284) for _ in range(21)]
    prompts = [shared + [rng.randrange(3, 284) for _ in range(k)] for k in (1, 5, 11)]
    prompts += [[rng.randrange(3, 284) for _ in range(k)] for k in (19, 33, 7)]
    # every layer local: its blocks are trimmed to the window (at most 5 a request), so fewer preempt
    blocks = 10 if name == "mistral_all_local" else 20
    llm = check_parity(model_dir, prompts, block_size=4, max_model_len=64, max_num_batched_tokens=8,
                       max_num_seqs=4, num_gpu_blocks_override=blocks, enable_prefix_caching=True)
    assert llm.stats.prefix_cache_hits > 0 and llm.stats.num_preemptions > 0


def test_layer_sliding_window():
    """Per-layer windows from the config, as HF's modelling reads them."""
    from transformers import MistralConfig, Qwen2Config

    from workers.models.layers import layer_sliding_window
    windows = lambda cfg: [layer_sliding_window(cfg, i) for i in range(cfg.num_hidden_layers)]  # noqa: E731
    assert windows(MistralConfig(num_hidden_layers=2, sliding_window=16)) == [16, 16]
    assert windows(MistralConfig(num_hidden_layers=2, sliding_window=None)) == [None, None]
    assert windows(Qwen2Config(num_hidden_layers=3, sliding_window=16)) == [None] * 3   # use_sliding_window off
    assert windows(Qwen2Config(num_hidden_layers=3, sliding_window=16, use_sliding_window=True,
                               max_window_layers=1)) == [None, 16, 16]
    assert windows(Qwen2Config(num_hidden_layers=3, sliding_window=16, use_sliding_window=True,
                               layer_types=["sliding_attention", "full_attention", "sliding_attention"])) \
        == [16, None, 16]


def test_longest_first_order():
    assert longest_first([5, 9, 3, 452, 7, 9]) == [3, 1, 5, 4, 0, 2]   # ties keep their order
    assert longest_first([]) == []


def test_a_batch_sent_longest_first_answers_in_order(model_factory):
    """The engine gets one call's requests longest max_tokens first, one at a time here
    (max_num_seqs=1); each answer is still its own prompt's, in the order given."""
    model_dir = model_factory("qwen3")
    prompts = _prompts(300, n=4, seed=3)
    budgets = [3, 11, 6, 9]
    llm = LLM(model_dir, max_num_seqs=1, block_size=4, max_model_len=128)
    try:
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                            [SamplingParams(temperature=0, max_tokens=m) for m in budgets], use_tqdm=False)
        eos = llm.config.eos_token_ids
    finally:
        llm.shutdown()
    for p, m, o in zip(prompts, budgets, outs):
        assert o.prompt_token_ids == p
        assert o.outputs[0].token_ids == hf_greedy(model_dir, p, m, eos)
