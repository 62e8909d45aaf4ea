"""Speculative decoding on the GPU: fp32 greedy output identical with and without it for every
method, with CUDA graphs (verify steps in the decode graphs, one row per token, or with
LOOM_SPEC_FULL_GRAPH=0 in the piecewise graphs) and eager; a seeded bf16 request reproduces.

The n-gram case runs on the trained demo model's Zen prompts: a random model's greedy output
does not repeat itself (session 30: 0 drafts accepted on the tiny model), the demo model's does
("... is better than ..."), so prompt lookup has drafts to accept."""
from __future__ import annotations

import json

import pytest

from frontend import LLM, SamplingParams

pytestmark = pytest.mark.gpu
PROMPTS = [[11, 12, 13, 14, 15, 16, 17, 18] * 3, [50, 60, 70], list(range(100, 140))]
GREEDY = SamplingParams(temperature=0, max_tokens=64, ignore_eos=True)
ZEN = ["Beautiful is better than", "Explicit is better than", "Simple is better than", "Flat is better than",
       "Readability counts.", "Errors should never"]
VARIANTS = [(False, "1"), (False, "0"), (True, "1")]   # (enforce_eager, LOOM_SPEC_FULL_GRAPH)


@pytest.fixture(scope="module")
def model(model_factory):
    return model_factory("llama", hidden_size=256, intermediate_size=512, num_attention_heads=8,
                         num_key_value_heads=2, num_hidden_layers=4)


def _run(model, params=GREEDY, prompts=None, **kw):
    llm = LLM(model, max_model_len=256, max_num_seqs=8, max_num_batched_tokens=256, **kw)   # (fewer graphs to capture)
    try:
        prompts = prompts or [{"prompt_token_ids": p} for p in PROMPTS]
        outs = llm.generate(prompts, params, use_tqdm=False)
        return [list(o.outputs[0].token_ids) for o in outs], llm.stats
    finally:
        llm.shutdown()


def _check_variants(model, want, spec, monkeypatch, prompts=None):
    for eager, full_graph in VARIANTS:
        monkeypatch.setenv("LOOM_SPEC_FULL_GRAPH", full_graph)
        got, stats = _run(model, dtype="float32", enforce_eager=eager, speculative_config=spec, prompts=prompts)
        assert got == want, (spec["method"], eager, full_graph)
        assert stats.spec_num_accepted_tokens > 0, (spec["method"], eager, full_graph)


def test_fp32_greedy_identical_with_speculation_graphs_and_eager(model, tmp_path, monkeypatch):
    want, _ = _run(model, dtype="float32")
    oracle = tmp_path / "oracle.json"
    oracle.write_text(json.dumps([{"prompt_token_ids": p, "output_token_ids": o} for p, o in zip(PROMPTS, want)]))
    for spec in ({"method": "draft_model", "model": model, "num_speculative_tokens": 3},
                 {"method": "oracle", "num_speculative_tokens": 4, "oracle_path": str(oracle),
                  "oracle_miss_rate": 0.25}):
        _check_variants(model, want, spec, monkeypatch)


def test_fp32_ngram_greedy_identical_on_repetitive_text(demo_model_dir, monkeypatch):
    want, _ = _run(demo_model_dir, dtype="float32", prompts=ZEN)
    spec = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "prompt_lookup_max": 3}
    _check_variants(demo_model_dir, want, spec, monkeypatch, prompts=ZEN)


def test_bf16_seeded_sampling_reproduces_with_speculation(model):
    spec = {"method": "draft_model", "model": model, "num_speculative_tokens": 3}
    params = SamplingParams(temperature=0.8, top_p=0.95, seed=3, max_tokens=48, ignore_eos=True)
    a, stats = _run(model, params, speculative_config=spec)
    b, _ = _run(model, params, speculative_config=spec)
    assert a == b and stats.spec_num_accepted_tokens > 0
