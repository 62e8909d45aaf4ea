"""The sampling surface: logprobs against HF, penalties, logit_bias, n, min_tokens,
stop strings, seeds."""
from __future__ import annotations

import pytest
import torch

from frontend import LLM, SamplingParams
from ipc.sampling_params import SamplingParams as SP
from tests.hf_oracle import hf_logprobs
from workers.sampler import SamplingRow, _adjust_row
import numpy as np

PROMPT = [12, 40, 7, 99, 150, 3, 77, 23]


@pytest.fixture(scope="module")
def llm(model_factory):
    model_dir = model_factory("qwen3")
    engine = LLM(model_dir, max_model_len=128, block_size=4)
    yield engine
    engine.shutdown()


def test_logprobs_match_hf(llm):
    out = llm.generate({"prompt_token_ids": PROMPT},
                       SamplingParams(temperature=0, max_tokens=6, logprobs=5, prompt_logprobs=3),
                       use_tqdm=False)[0]
    gen = out.outputs[0].token_ids
    ref = hf_logprobs(llm.config.model, PROMPT + gen)
    for i, (tok, entry) in enumerate(zip(gen, out.outputs[0].logprobs)):
        row = ref[len(PROMPT) - 1 + i]
        assert entry[tok].logprob == pytest.approx(row[tok].item(), abs=1e-4)
        assert entry[tok].rank == 1  # greedy
        top_v, top_i = row.topk(5)
        assert set(top_i.tolist()) <= set(entry)
        for v, t in zip(top_v.tolist(), top_i.tolist()):
            assert entry[t].logprob == pytest.approx(v, abs=1e-4)
    # prompt logprobs: None for the first token, then the prompt token and the top 3
    plp = out.prompt_logprobs
    assert plp[0] is None and len(plp) == len(PROMPT)
    for p in range(1, len(PROMPT)):
        row = ref[p - 1]
        assert plp[p][PROMPT[p]].logprob == pytest.approx(row[PROMPT[p]].item(), abs=1e-4)
        assert plp[p][PROMPT[p]].rank == int((row > row[PROMPT[p]]).sum()) + 1


def test_logprobs_zero_gives_sampled_token_only(llm):
    out = llm.generate({"prompt_token_ids": PROMPT}, SamplingParams(temperature=0.8, seed=1, max_tokens=4,
                                                                      logprobs=0), use_tqdm=False)[0]
    for tok, entry in zip(out.outputs[0].token_ids, out.outputs[0].logprobs):
        assert list(entry) == [tok]


def test_logit_bias_forces_and_forbids(llm):
    base = llm.generate({"prompt_token_ids": PROMPT}, SamplingParams(temperature=0, max_tokens=5),
                        use_tqdm=False)[0].outputs[0].token_ids
    forced = llm.generate({"prompt_token_ids": PROMPT},
                          SamplingParams(temperature=0, max_tokens=5, logit_bias={42: 100.0}),
                          use_tqdm=False)[0].outputs[0].token_ids
    assert forced == [42] * 5
    banned = llm.generate({"prompt_token_ids": PROMPT},
                          SamplingParams(temperature=0, max_tokens=5, logit_bias={base[0]: -100.0}),
                          use_tqdm=False)[0].outputs[0].token_ids
    assert base[0] not in banned


def test_penalties_adjust_logits_as_specified():
    torch.manual_seed(0)
    logits = torch.randn(50)
    prompt, output = np.array([1, 2, 3]), np.array([3, 4, 4, 5])
    params = SP(repetition_penalty=1.5, presence_penalty=0.5, frequency_penalty=0.25)
    row = logits.clone()
    _adjust_row(row, SamplingRow(params, 0, 4, prompt, output, []))
    expected = logits.clone()
    for t in {1, 2, 3, 4, 5}:  # repetition: prompt and output tokens
        expected[t] = expected[t] / 1.5 if expected[t] > 0 else expected[t] * 1.5
    counts = {3: 1, 4: 2, 5: 1}
    for t, c in counts.items():
        expected[t] -= 0.25 * c + 0.5
    assert torch.allclose(row, expected)


def test_min_tokens_and_stop_token_ids(llm):
    base = llm.generate({"prompt_token_ids": PROMPT}, SamplingParams(temperature=0, max_tokens=8),
                        use_tqdm=False)[0].outputs[0].token_ids
    stop_tok = base[0]
    out = llm.generate({"prompt_token_ids": PROMPT}, SamplingParams(temperature=0, max_tokens=8,
                                                                      stop_token_ids=[stop_tok]), use_tqdm=False)[0]
    assert out.outputs[0].token_ids == [stop_tok] and out.outputs[0].finish_reason == "stop"
    assert out.outputs[0].stop_reason == stop_tok
    out = llm.generate({"prompt_token_ids": PROMPT}, SamplingParams(temperature=0, max_tokens=8, min_tokens=3,
                                                                      stop_token_ids=[stop_tok]), use_tqdm=False)[0]
    assert len(out.outputs[0].token_ids) >= 3 and stop_tok not in out.outputs[0].token_ids[:3]


def test_stop_strings(llm):
    params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    text = llm.generate({"prompt_token_ids": PROMPT}, params, use_tqdm=False)[0].outputs[0].text
    assert len(text) > 6
    stop = text[3:6]
    i = text.index(stop)
    out = llm.generate({"prompt_token_ids": PROMPT}, SamplingParams(temperature=0, max_tokens=30, ignore_eos=True,
                                                                      stop=[stop]), use_tqdm=False)[0].outputs[0]
    assert out.text == text[:i] and out.finish_reason == "stop" and out.stop_reason == stop
    out = llm.generate({"prompt_token_ids": PROMPT}, SamplingParams(temperature=0, max_tokens=30, ignore_eos=True,
                                                                      stop=[stop], include_stop_str_in_output=True),
                       use_tqdm=False)[0].outputs[0]
    assert out.text == text[:i + len(stop)]
    assert llm.debug_info()["tracked_requests"] == 0  # the engine let go of the stopped request


def test_n_choices_and_seed_reproducible(llm):
    params = SamplingParams(n=3, temperature=1.0, seed=7, max_tokens=8)
    a = llm.generate({"prompt_token_ids": PROMPT}, params, use_tqdm=False)[0]
    assert [c.index for c in a.outputs] == [0, 1, 2]
    assert len({tuple(c.token_ids) for c in a.outputs}) > 1
    # the same seeded request in a crowded batch gives the same tokens
    others = [{"prompt_token_ids": [5 + i, 6, 7]} for i in range(5)]
    b = llm.generate([*others, {"prompt_token_ids": PROMPT}],
                     [SamplingParams(temperature=1.0, max_tokens=12)] * 5 + [params], use_tqdm=False)[-1]
    assert [c.token_ids for c in b.outputs] == [c.token_ids for c in a.outputs]


def test_sampling_filters_respected(llm):
    # top_k=1 is greedy whatever the temperature
    greedy = llm.generate({"prompt_token_ids": PROMPT}, SamplingParams(temperature=0, max_tokens=6),
                          use_tqdm=False)[0].outputs[0].token_ids
    topk1 = llm.generate({"prompt_token_ids": PROMPT}, SamplingParams(temperature=2.0, top_k=1, max_tokens=6),
                         use_tqdm=False)[0].outputs[0].token_ids
    assert topk1 == greedy


def test_invalid_params_rejected(llm):
    for bad in (dict(temperature=-1), dict(top_p=0), dict(top_p=1.5), dict(max_tokens=0), dict(n=0),
                dict(logprobs=100), dict(min_p=2)):
        with pytest.raises(ValueError, match=next(iter(bad))):
            llm.generate({"prompt_token_ids": PROMPT}, SamplingParams(**bad), use_tqdm=False)
    with pytest.raises(ValueError, match="empty"):
        llm.generate({"prompt_token_ids": []}, SamplingParams(), use_tqdm=False)
    with pytest.raises(ValueError, match="context length"):
        llm.generate({"prompt_token_ids": [5] * 200}, SamplingParams(), use_tqdm=False)


def test_sampler_fails_a_bad_row_alone():
    """Per-request adjustments that fail (ids the boundaries would refuse) fail that row only."""
    import numpy as np
    import torch

    from ipc.sampling_params import SamplingParams
    from workers.sampler import Sampler
    empty = np.zeros(0, np.int64)
    rows = [SamplingRow(SamplingParams(temperature=0, logit_bias={3: 1.0}), 0, 0, empty, empty, []),
            SamplingRow(SamplingParams(temperature=0, logit_bias={-7: 1.0}), 0, 0, empty, empty, []),
            SamplingRow(SamplingParams(temperature=0, min_tokens=2), 0, 0, empty, empty, [10 ** 6])]
    logits = torch.randn(3, 50)
    tokens, _, failed = Sampler(use_triton=False)(logits, rows, {})
    assert sorted(failed) == [1, 2]
    expected = logits[0].clone()
    expected[3] += 1.0
    assert int(tokens[0]) == int(expected.argmax())
