"""The sampling surface: logprobs against HF, penalties, logit_bias, n, min_tokens,
stop strings, seeds."""
from __future__ import annotations

import pytest
import torch

from frontend import LLM, SamplingParams
from ipc.sampling_params import SamplingParams as SP
from tests.hf_oracle import hf_greedy, hf_logprobs
from kernels.penalties import apply_penalties_ref
from workers.host_to_device import map_arrays
from workers.input_batch import InputBatch
from workers.sampler import Sampler, SamplingRow

ENGINE_IN_PROCESS = True   # outputs only: the engine in the test process (tests/conftest.py engine_in_process)

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
    # vLLM's cumulative_logprob: the sum of the sampled tokens' logprobs (None unless asked for)
    assert out.outputs[0].cumulative_logprob == pytest.approx(
        sum(ref[len(PROMPT) - 1 + i][tok].item() for i, tok in enumerate(gen)), abs=1e-3)
    plain = llm.generate({"prompt_token_ids": PROMPT}, SamplingParams(temperature=0, max_tokens=2), use_tqdm=False)
    assert plain[0].outputs[0].cumulative_logprob is None
    # prompt logprobs: None for the first token, then the prompt token and the top 3
    plp = out.prompt_logprobs
    assert plp[0] is None and len(plp) == len(PROMPT)
    for p in range(1, len(PROMPT)):
        row = ref[p - 1]
        assert plp[p][PROMPT[p]].logprob == pytest.approx(row[PROMPT[p]].item(), abs=1e-4)
        assert plp[p][PROMPT[p]].rank == int((row > row[PROMPT[p]]).sum()) + 1


def test_prompt_logprobs_chunked_and_batched_match_hf(model_factory):
    # prompts split over several steps (16-token budget), three requests per step asking for
    # different top-N (and one for none): each position's logprob and rank as HF computes them
    model_dir = model_factory("qwen3")
    prompts = [[(7 * i + 3) % 200 for i in range(23)], [(5 * i + 1) % 180 for i in range(30)], PROMPT]
    ks = [2, 0, None]
    engine = LLM(model_dir, max_model_len=128, block_size=4, max_num_batched_tokens=16, max_num_seqs=4)
    try:
        outs = engine.generate([{"prompt_token_ids": p} for p in prompts],
                               [SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=k) for k in ks],
                               use_tqdm=False)
    finally:
        engine.shutdown()
    assert outs[2].prompt_logprobs is None
    for p, k, o in zip(prompts[:2], ks, outs):
        ref = hf_logprobs(model_dir, p)
        plp = o.prompt_logprobs
        assert plp[0] is None and len(plp) == len(p)
        for pos in range(1, len(p)):
            row, tok = ref[pos - 1], p[pos]
            assert plp[pos][tok].logprob == pytest.approx(row[tok].item(), abs=1e-4)
            assert plp[pos][tok].rank == int((row > row[tok]).sum()) + 1
            assert len(set(plp[pos]) - {tok}) <= k
            for t in row.topk(k).indices.tolist() if k else []:
                assert plp[pos][t].logprob == pytest.approx(row[t].item(), abs=1e-4)


def test_logprobs_of_a_batch_asking_different_n_match_hf(llm):
    """One step with rows asking logprobs None, 0, 2 and 5 (the worker cuts each row of the
    sampler's [B, 1 + 5] arrays to its own 1 + N): each gets its token and its own top N, as HF."""
    prompts = [PROMPT, PROMPT[::-1], [5, 6, 7, 8, 9, 10], [200, 100, 50, 25]]
    ks = [None, 0, 2, 5]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        [SamplingParams(temperature=0, max_tokens=4, logprobs=k) for k in ks], use_tqdm=False)
    assert outs[0].outputs[0].logprobs is None
    for p, k, o in zip(prompts[1:], ks[1:], outs[1:]):
        gen = o.outputs[0].token_ids
        ref = hf_logprobs(llm.config.model, p + gen)
        assert len(o.outputs[0].logprobs) == len(gen)
        for i, (tok, entry) in enumerate(zip(gen, o.outputs[0].logprobs)):
            row = ref[len(p) - 1 + i]
            top_v, top_i = row.topk(k) if k else (row[:0], row[:0].long())
            assert set(entry) == {tok, *top_i.tolist()}
            assert next(iter(entry)) == tok and entry[tok].rank == 1  # greedy; the sampled token first
            for v, t in zip([row[tok].item(), *top_v.tolist()], [tok, *top_i.tolist()]):
                assert entry[t].logprob == pytest.approx(v, abs=1e-4)
                assert entry[t].decoded_token == llm.tokenizer.decode([t])


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


def test_allowed_token_ids_only_those_are_sampled(llm):
    # vLLM's allowed_token_ids: sampled (temperature 1, several seeds) and greedy, in one batch
    # with a row that has none, which samples exactly as it does alone
    allowed = [5, 9, 42]
    free = SamplingParams(temperature=1.0, max_tokens=12, seed=3, ignore_eos=True)
    alone = llm.generate({"prompt_token_ids": PROMPT}, free, use_tqdm=False)[0].outputs[0].token_ids
    params = [SamplingParams(temperature=1.0, max_tokens=12, seed=s, ignore_eos=True, allowed_token_ids=allowed)
              for s in range(3)]
    params += [SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, allowed_token_ids=[77]), free]
    outs = llm.generate([{"prompt_token_ids": PROMPT}] * len(params), params, use_tqdm=False)
    sampled = [o.outputs[0].token_ids for o in outs]
    assert all(set(t) <= set(allowed) and len(t) == 12 for t in sampled[:3])
    assert len({tuple(t) for t in sampled[:3]}) > 1   # really sampled, not forced
    assert sampled[3] == [77] * 6
    assert sampled[4] == alone
    for bad in ([], [10 ** 6]):
        with pytest.raises(ValueError, match="allowed_token_ids"):
            llm.generate({"prompt_token_ids": PROMPT}, SamplingParams(allowed_token_ids=bad), use_tqdm=False)


def test_a_request_left_no_token_to_sample_fails_alone(llm):
    """allowed_token_ids that are all stop tokens, under min_tokens (which bans them), leave no
    token to sample: the request ends with an error (it once returned token 0, which it does not
    allow), greedy or sampled, while the row beside it samples as it does alone."""
    free = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    alone = llm.generate({"prompt_token_ids": PROMPT}, free, use_tqdm=False)[0].outputs[0].token_ids
    dead = [SamplingParams(temperature=t, max_tokens=6, min_tokens=2, allowed_token_ids=[77], stop_token_ids=[77])
            for t in (0.0, 1.0)]
    outs = llm.generate([{"prompt_token_ids": PROMPT}] * 3, dead + [free], use_tqdm=False)
    for o in outs[:2]:
        assert o.outputs[0].finish_reason == "error" and o.outputs[0].token_ids == [], o
        assert "no token is left to sample" in str(o.outputs[0].stop_reason)
    assert outs[2].outputs[0].token_ids == alone


def test_bad_words_match_hf(llm):
    # vLLM's bad_words as token ids (as the frontends tokenize them): a two-token word banned
    # where the outputs end with its first token, a one-token word never; HF's bad_words_ids
    # is the oracle (it also matches the prompt's end, which this word's prefix is not)
    greedy = lambda words=None: SamplingParams(temperature=0, max_tokens=12, ignore_eos=True,
                                               bad_words_token_ids=words)
    base = llm.generate({"prompt_token_ids": PROMPT}, greedy(), use_tqdm=False)[0].outputs[0].token_ids
    k = next(i for i in range(1, 8) if base[i] != PROMPT[-1])
    pair, single = [base[k], base[k + 1]], [base[0]]
    words = [[pair], [single, pair], None]     # a batch-mate without words samples as alone
    outs = [o.outputs[0].token_ids
            for o in llm.generate([{"prompt_token_ids": PROMPT}] * 3, [greedy(w) for w in words], use_tqdm=False)]
    assert outs[0][:k + 1] == base[:k + 1] and outs[0][k + 1] != base[k + 1]
    assert base[0] not in outs[1]
    assert outs[2] == base
    for out, w in zip(outs[:2], words):
        assert out == hf_greedy(llm.config.model, PROMPT, 12, bad_words_ids=w)
        assert all(out[i:i + 2] != pair for i in range(11))
    for bad in ([[]], [[10 ** 6]], [[1] * 33]):
        with pytest.raises(ValueError, match="bad_words"):
            llm.generate({"prompt_token_ids": PROMPT}, SamplingParams(bad_words_token_ids=bad), use_tqdm=False)


def test_priority_scheduling_offline(llm, model_factory):
    # LLM(scheduling_policy="priority").generate(..., priority=[...]) as vLLM's: one request at a
    # time here, each output as under fcfs; without the policy a priority is refused
    prompts = [{"prompt_token_ids": PROMPT[:k]} for k in (8, 6, 4)]
    greedy = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
    want = [o.outputs[0].token_ids for o in llm.generate(prompts, greedy, use_tqdm=False)]
    engine = LLM(model_factory("qwen3"), max_model_len=128, block_size=4, max_num_seqs=1,
                 scheduling_policy="priority")
    try:
        outs = engine.generate(prompts, greedy, use_tqdm=False, priority=[2, -1, 0])
    finally:
        engine.shutdown()
    assert [o.outputs[0].token_ids for o in outs] == want
    with pytest.raises(ValueError, match="Priority scheduling is not enabled"):
        llm.generate(prompts[0], greedy, use_tqdm=False, priority=[1])


def test_ban_bad_words_as_vllm_bans_them():
    # every (row, word) against vLLM's rule, over random outputs: a word's last token is banned
    # when the outputs so far end with the rest of it (never when there are fewer of them)
    from workers.sampler import BadWords, SamplingRow, _bad_word_batch, ban_bad_words
    gen = torch.Generator().manual_seed(0)
    vocab, rows, recents, expect = 6, [], [], []
    for _ in range(64):
        n_out = int(torch.randint(0, 5, (1,), generator=gen))
        outputs = torch.randint(0, 3, (n_out,), generator=gen).tolist()
        words = [torch.randint(0, 3, (int(torch.randint(1, 4, (1,), generator=gen)),), generator=gen).tolist()
                 for _ in range(int(torch.randint(1, 4, (1,), generator=gen)))]
        banned = {w[-1] for w in words if len(w) - 1 <= n_out and outputs[n_out - len(w) + 1:] == w[:-1]}
        rows.append(SamplingRow(SP(), 0, n_out, bad_words=BadWords.of(words)))
        recents.append([-1] * (5 - n_out) + outputs)
        expect.append([float("-inf") if t in banned else 0.0 for t in range(vocab)])
    rows.append(SamplingRow(SP(), 0, 0))   # no words: untouched
    recents.append([-1] * 5)
    expect.append([0.0] * vocab)
    prefix, last = (torch.from_numpy(a) for a in _bad_word_batch(rows))
    got = ban_bad_words(torch.zeros(len(rows), vocab), torch.tensor(recents), prefix, last)
    assert got.tolist() == expect


def test_keep_allowed_masks_rows_with_a_list_and_drops_ids_outside_the_vocabulary():
    from workers.sampler import keep_allowed
    got = keep_allowed(torch.zeros(3, 6), torch.tensor([[1, 4, -1], [-1, -1, -1], [5, 99, -1]]))
    inf = float("-inf")
    assert got.tolist() == [[inf, 0, inf, inf, 0, inf], [0] * 6, [inf] * 5 + [0]]


def test_penalties_adjust_logits_as_specified():
    # the persistent batch's device state (prompt mask, output counts updated from the sampled
    # tokens) and the sampler's per-row inputs give the adjustment the API documents
    torch.manual_seed(0)
    logits = torch.randn(2, 50)
    batch = InputBatch(4, 16, 4, vocab_size=50)
    params = SP(repetition_penalty=1.5, presence_penalty=0.5, frequency_penalty=0.25, logit_bias={7: 2.0},
                min_tokens=6, stop_token_ids=[9])
    batch.add("a", [1, 2, 3], [3, 4], [0], 0, params, 0, [11])      # resumed: two outputs known
    batch.add("b", [40], [], [1], 0, SP(logit_bias={3: -1.0}), 0, [11])
    batch.write_rows()                                                  # (the step's staging)
    slots = torch.tensor([batch.requests["a"].slot, batch.requests["b"].slot])
    batch.record_sampled(slots[:1], torch.tensor([4]))                  # a's third output, on the device
    batch.record_sampled(slots[:1], torch.tensor([5]))
    rows = [SamplingRow(params, 0, 4, int(slots[0]), (11,)), SamplingRow(SP(logit_bias={3: -1.0}), 0, 0,
                                                                          int(slots[1]), (11,))]
    dev = map_arrays(Sampler.host_params(rows), torch.from_numpy)
    out = apply_penalties_ref(logits, dev.penalty_slots, *batch.penalty_state(), dev.repetition_penalty,
                              dev.presence_penalty, dev.frequency_penalty, dev.bias_ids, dev.bias_values,
                              dev.banned_ids)
    expected = logits.clone()
    expected[0, 7] += 2.0
    for t in {1, 2, 3, 4, 5}:  # repetition: prompt and output tokens
        expected[0, t] = expected[0, t] / 1.5 if expected[0, t] > 0 else expected[0, t] * 1.5
    for t, c in {3: 1, 4: 2, 5: 1}.items():
        expected[0, t] -= 0.25 * c + 0.5
    expected[0, [9, 11]] = float("-inf")  # min_tokens: stop and eos ids banned
    expected[1, 3] -= 1.0                 # b: logit_bias only, no penalties from a's counts
    assert torch.allclose(out, expected)


def test_repetition_penalty_matches_hf_in_a_batch(llm):
    # greedy + repetition penalty, three requests in one (overlapped) batch with plain ones beside
    # them: the device-side counts see every token, the one still in flight included
    from tests.hf_oracle import hf_model
    prompts = [PROMPT, [5, 9, 5, 9, 5, 9], [300, 301, 302, 7, 7]]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, repetition_penalty=1.3)
    plain = SamplingParams(temperature=0.8, max_tokens=12, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts + prompts],
                        [params] * 3 + [plain] * 3, use_tqdm=False)
    model = hf_model(llm.config.model)
    changed = False
    for p, o in zip(prompts, outs):
        with torch.no_grad():
            ref = model.generate(torch.tensor([p]), max_new_tokens=12, do_sample=False, repetition_penalty=1.3,
                                 pad_token_id=0, attention_mask=torch.ones(1, len(p), dtype=torch.long))
        assert o.outputs[0].token_ids == ref[0, len(p):].tolist()
        greedy = llm.generate({"prompt_token_ids": p}, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True),
                              use_tqdm=False)[0].outputs[0].token_ids
        changed |= greedy != o.outputs[0].token_ids
    assert changed  # the penalty did something


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


def test_seeded_penalised_output_unchanged_by_batch(llm):
    # a seeded request with penalties, bias and top-k/top-p gives the same tokens alone and in a
    # crowded batch (other requests with their own penalties in other slots)
    params = SamplingParams(temperature=0.9, top_k=20, top_p=0.9, seed=5, max_tokens=10, ignore_eos=True,
                            repetition_penalty=1.2, presence_penalty=0.4, frequency_penalty=0.3,
                            logit_bias={7: 2.0})
    alone = llm.generate({"prompt_token_ids": PROMPT}, params, use_tqdm=False)[0].outputs[0].token_ids
    others = [{"prompt_token_ids": [9 + i, 4, 4, 4]} for i in range(4)]
    crowd = llm.generate([*others, {"prompt_token_ids": PROMPT}, *others],
                         [SamplingParams(temperature=1.0, max_tokens=12, ignore_eos=True, presence_penalty=1.0)] * 4
                         + [params] + [SamplingParams(temperature=0.5, max_tokens=6)] * 4, use_tqdm=False)
    assert crowd[4].outputs[0].token_ids == alone


def test_n_children_share_the_prompt_blocks(llm):
    # the n children of a request are scheduled in one step; all but the first hit the first's
    # prompt blocks (published as it is scheduled), and sample as if they ran alone
    prompt = [(11 * i + 5) % 250 for i in range(41)]  # 10 full blocks of 4, never seen before
    before = (llm.stats.prefix_cache_queries, llm.stats.prefix_cache_hits)
    params = SamplingParams(n=4, temperature=1.0, seed=11, max_tokens=6, ignore_eos=True)
    out = llm.generate({"prompt_token_ids": prompt}, params, use_tqdm=False)[0]
    hits = llm.stats.prefix_cache_hits - before[1]
    assert llm.stats.prefix_cache_queries - before[0] == 4 * 41 and hits == 3 * 40
    llm.reset_prefix_cache()
    alone = [llm.generate({"prompt_token_ids": prompt}, SamplingParams(temperature=1.0, seed=11 + i, max_tokens=6,
                                                                         ignore_eos=True), use_tqdm=False)[0]
             for i in range(4)]
    assert [c.token_ids for c in out.outputs] == [a.outputs[0].token_ids for a in alone]


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
    # wrong types, which SamplingParams built in Python does not check: refused here, where the
    # engine's decoder used to fail them silently (finish_reason "error", no tokens)
    for bad in (dict(max_tokens=4.5), dict(seed=1.5), dict(stop_token_ids=[1.5]), dict(bad_words=[5])):
        with pytest.raises(ValueError, match=next(iter(bad))):
            llm.generate({"prompt_token_ids": PROMPT}, SamplingParams(**bad), use_tqdm=False)
    for prompt in ([True, False], {"prompt_token_ids": "abc"}, 5):
        with pytest.raises(ValueError, match="prompt"):
            llm.generate(prompt, SamplingParams(max_tokens=2), use_tqdm=False)
    assert llm.generate({"prompt_token_ids": PROMPT}, SamplingParams(temperature=0, max_tokens=3),
                        use_tqdm=False)[0].outputs[0].finish_reason == "length"


def test_sampler_fails_a_bad_row_alone():
    """Per-request adjustments that cannot apply (ids the boundaries would refuse) fail that row
    only; the batch's kernels ignore such ids and the other rows sample as usual."""
    import torch

    from ipc.sampling_params import SamplingParams
    from workers.sampler import Sampler
    rows = [SamplingRow(SamplingParams(temperature=0, logit_bias={3: 100.0}), 0, 0),
            SamplingRow(SamplingParams(temperature=0, logit_bias={-7: 1.0}), 0, 0),
            SamplingRow(SamplingParams(temperature=0, min_tokens=2), 0, 0, 1, (10 ** 6,))]
    logits = torch.randn(3, 50)
    dev = map_arrays(Sampler.host_params(rows), torch.from_numpy)
    tokens, _, failed, _ = Sampler(use_triton=False)(logits, rows, dev)
    assert sorted(failed) == [1, 2] and "[-7]" in failed[1]
    assert tokens.tolist() == [3, int(logits[1].argmax()), int(logits[2].argmax())]


def test_an_interrupted_send_leaves_nothing_for_the_next_call(llm):
    """Ctrl-C while generate sends a batch: the requests already sent are aborted and none of the
    batch is waited for by the next call (it returned them too, some never sent, unfinished)."""
    params = SamplingParams(temperature=0, max_tokens=4)
    real, calls = llm.client.add_request, []

    def interrupted(*args):
        if len(calls) == 3:
            raise KeyboardInterrupt
        calls.append(args)
        real(*args)
    llm.client.add_request = interrupted
    try:
        with pytest.raises(KeyboardInterrupt):
            llm.generate([PROMPT] * 8, params, use_tqdm=False)
    finally:
        llm.client.add_request = real
    assert not llm._states and not llm._results   # (the next call waited for them: for ever)
    params = SamplingParams(temperature=0, max_tokens=4, stop=None, stop_token_ids=None)   # vLLM's defaults
    [out] = llm.generate([PROMPT], params, use_tqdm=False)
    assert len(out.outputs[0].token_ids) == 4 and out.finished


def test_chat_takes_vllms_keywords_and_batches(llm):
    """LLM.chat as vLLM's: a list of conversations, add_generation_prompt / continue_final_message,
    tools, chat_template_kwargs (each a TypeError before), and a mistake in the messages named in
    a ValueError (an AttributeError before)."""
    tok = llm.tokenizer
    conv = [{"role": "user", "content": "hi"}]
    params = SamplingParams(temperature=0, max_tokens=3)

    def direct(messages, **kw):
        text = tok.apply_chat_template(messages, tokenize=False, **kw)
        return llm.generate({"prompt_token_ids": tok.encode(text, add_special_tokens=False)}, params,
                            use_tqdm=False)[0].outputs[0].token_ids
    one, two = llm.chat([conv, conv + [{"role": "assistant", "content": "he"}]], params, use_tqdm=False)
    assert one.outputs[0].token_ids == direct(conv, add_generation_prompt=True)
    cont = llm.chat(conv + [{"role": "assistant", "content": "he"}], params, use_tqdm=False,
                    add_generation_prompt=False, continue_final_message=True)[0]
    assert cont.outputs[0].token_ids == direct(conv + [{"role": "assistant", "content": "he"}],
                                               add_generation_prompt=False, continue_final_message=True)
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    assert llm.chat(conv, params, use_tqdm=False, tools=tools, chat_template_kwargs={"enable_thinking": False})
    for bad in ("hello", ["hi"], [{"role": "user", "content": 5}], []):
        with pytest.raises(ValueError):
            llm.chat(bad, params, use_tqdm=False)
    with pytest.raises(ValueError, match="cannot both"):
        llm.chat(conv, params, use_tqdm=False, continue_final_message=True)


@pytest.mark.slow   # (about 10 s: the whole engine on the Triton interpreter)
def test_seeded_top_p_on_the_triton_sampler_matches_the_reference(model_factory, monkeypatch):
    """The engine on the Triton sampler (interpreted on CPU): seeded top-p requests, alone and with
    penalties, draw the tokens of the reference sampler on HF's logits with the same Philox noise
    (kernels.sampling.philox_noise), step by step: the top-p route that checks the race winner
    (no top-k candidates) and its penalties variant give the reference's tokens. Each request
    runs alone, the decode graphs' work on (uncaptured): the top-p request's decode steps are
    sampled by the graphs' head, the penalised one's by their penalty head (penalties in float32,
    then the same sampler; its counts recorded after each step)."""
    monkeypatch.setenv("LOOM_DECODE_GRAPHS_ON_CPU", "1")
    from kernels.sampling import philox_noise, sample_with_noise_ref
    from tests.hf_oracle import hf_model
    model_dir = model_factory("qwen3")
    cases = [SamplingParams(temperature=1.0, top_p=0.3, seed=5, max_tokens=3, ignore_eos=True),
             SamplingParams(temperature=0.8, top_p=0.5, seed=9, max_tokens=3, ignore_eos=True,
                            repetition_penalty=1.3, presence_penalty=0.5)]
    llm = LLM(model_dir, max_model_len=64, block_size=8, attention_backend="triton", max_num_seqs=2,
              cuda_graph_sizes=[1])   # (one graph size: each is set up with the interpreter)
    try:
        outs = [llm.generate({"prompt_token_ids": PROMPT}, c, use_tqdm=False)[0].outputs[0].token_ids for c in cases]
    finally:
        llm.shutdown()
    model = hf_model(model_dir)
    vocab = model.config.vocab_size
    for params, out in zip(cases, outs):
        sp = SP(temperature=params.temperature, top_p=params.top_p, repetition_penalty=params.repetition_penalty,
                presence_penalty=params.presence_penalty)
        for t in range(len(out)):
            with torch.no_grad():
                logits = model(torch.tensor([PROMPT + out[:t]])).logits[0, -1:].float()
            counts = torch.zeros(1, vocab, dtype=torch.int32)
            counts[0].index_add_(0, torch.tensor(out[:t], dtype=torch.long), torch.ones(t, dtype=torch.int32))
            prompt_mask = torch.zeros(1, vocab, dtype=torch.uint8)
            prompt_mask[0, PROMPT] = 1
            row = SamplingRow(sp, params.seed, t)
            dev = map_arrays(Sampler.host_params([row]), torch.from_numpy)
            if row.adjusts:
                logits = apply_penalties_ref(logits, dev.penalty_slots, counts, prompt_mask, dev.repetition_penalty,
                                             dev.presence_penalty, dev.frequency_penalty, dev.bias_ids,
                                             dev.bias_values, dev.banned_ids)
            noise = philox_noise(dev.seeds, dev.output_indices, vocab)
            want = sample_with_noise_ref(logits, dev.temperature, dev.top_k, dev.top_p, dev.min_p, noise)
            assert out[t] == int(want[0]), (params, t)
