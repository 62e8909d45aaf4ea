"""Speculative decoding on the GPU: fp32 greedy output identical with and without it for every
method, with CUDA graphs (the plain steps' decode graphs, the verify steps' piecewise graphs) and
eager; a seeded bf16 request reproduces."""
from __future__ import annotations

import json

import pytest

from frontend import LLM, SamplingParams

pytestmark = pytest.mark.gpu
PROMPTS = [[11, 12, 13, 14, 15, 16, 17, 18] * 3, [50, 60, 70], list(range(100, 140))]
GREEDY = SamplingParams(temperature=0, max_tokens=64, ignore_eos=True)


@pytest.fixture(scope="module")
def model(model_factory):
    return model_factory("llama", hidden_size=256, intermediate_size=512, num_attention_heads=8,
                         num_key_value_heads=2, num_hidden_layers=4)


def _run(model, params=GREEDY, **kw):
    llm = LLM(model, max_model_len=256, **kw)
    try:
        outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
        return [o.outputs[0].token_ids for o in outs], llm.stats
    finally:
        llm.shutdown()


def test_fp32_greedy_identical_with_speculation_graphs_and_eager(model, tmp_path):
    want, _ = _run(model, dtype="float32")
    oracle = tmp_path / "oracle.json"
    oracle.write_text(json.dumps([{"prompt_token_ids": p, "output_token_ids": o} for p, o in zip(PROMPTS, want)]))
    specs = [{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "prompt_lookup_max": 3},
             {"method": "draft_model", "model": model, "num_speculative_tokens": 3},
             {"method": "oracle", "num_speculative_tokens": 4, "oracle_path": str(oracle), "oracle_miss_rate": 0.25}]
    for spec in specs:
        for eager in (False, True):
            got, stats = _run(model, dtype="float32", enforce_eager=eager, speculative_config=spec)
            assert got == want, (spec["method"], eager)
            assert stats.spec_num_accepted_tokens > 0, spec["method"]


def test_bf16_seeded_sampling_reproduces_with_speculation(model):
    spec = {"method": "draft_model", "model": model, "num_speculative_tokens": 3}
    params = SamplingParams(temperature=0.8, top_p=0.95, seed=3, max_tokens=48, ignore_eos=True)
    a, stats = _run(model, params, speculative_config=spec)
    b, _ = _run(model, params, speculative_config=spec)
    assert a == b and stats.spec_num_accepted_tokens > 0
