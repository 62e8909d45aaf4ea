"""EAGLE on the GPU: fp32 greedy output identical with and without an EAGLE-1 / EAGLE-3 head,
with CUDA graphs (the decode graphs capture EAGLE-3's auxiliary-stream copies) and eager; the
drafts under graphs are the torch reference's (from the HF target's hidden states); a seeded
bf16 request reproduces with EAGLE-3."""
from __future__ import annotations

import pytest

from frontend import LLM, SamplingParams
from tests.eagle_heads import write_head
from tests.test_eagle import record_drafts, reference_drafts

pytestmark = pytest.mark.gpu
ENGINE_IN_PROCESS = True   # the drafts are recorded in this process (tests/test_eagle.py record_drafts)
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


@pytest.mark.parametrize("method", ["eagle", "eagle3"])
def test_fp32_greedy_identical_with_eagle_graphs_and_eager(method, model, tmp_path, monkeypatch):
    head = write_head(str(tmp_path / "head"), model, method)
    want, _ = _run(model, dtype="float32")
    spec = {"method": method, "model": head, "num_speculative_tokens": 3}
    for eager in (False, True):
        records = record_drafts(monkeypatch)
        got, stats = _run(model, dtype="float32", enforce_eager=eager, speculative_config=spec)
        # (which request and token first differ, and the acceptance: the messages say what failed)
        diff = [(i, next(j for j, (a, b) in enumerate(zip(g, w)) if a != b) if len(g) == len(w) else "length")
                for i, (g, w) in enumerate(zip(got, want)) if g != w]
        assert got == want, (method, eager, "first differences (request, token)", diff,
                             stats.mean_acceptance_length)
        assert stats.spec_num_drafts > 0
        sample = records[::3]
        ref = reference_drafts(model, head, method, sample, aux_layers=(2, 2, 1))
        same = sum(a == b for (_, a), b in zip(sample, ref))
        bad = [(len(t), a, b) for (t, a), b in zip(sample, ref) if a != b][:5]
        assert same >= 0.95 * len(sample), (method, eager, same, len(sample), "(tokens, drafts, reference):", bad)


def test_bf16_seeded_sampling_reproduces_with_eagle3(model, tmp_path):
    head = write_head(str(tmp_path / "head"), model, "eagle3")
    spec = {"method": "eagle3", "model": head, "num_speculative_tokens": 3}
    params = SamplingParams(temperature=0.8, top_p=0.95, seed=3, max_tokens=48, ignore_eos=True)
    a, stats = _run(model, params, speculative_config=spec)
    b, _ = _run(model, params, speculative_config=spec)
    assert a == b and stats.spec_num_drafts > 0
