"""Speculation with async scheduling (LOOM_SPEC_ASYNC=1): the engine schedules the next step while
a verify step is in flight, as if every draft in flight is accepted, and the worker places its
own drafts and each request's true position in it (ModelRunner._place_drafts). Two steps are in
flight while drafts are verified (one without the flag), and the output is unchanged: greedy
output identical to no speculation for every method and acceptance pattern (all accepted, some,
none), under chunked prefill, prefix caching, preemption and three steps in flight; requests
that end inside their drafts (max_tokens, stop tokens, stop strings); seeded sampling; a batch
mixing constrained requests (whose drafts the scheduler still cuts by their grammar) with free
ones; TP=2 on gloo."""
from __future__ import annotations

import json

import pytest

from ipc.sampling_params import SamplingParams, StructuredOutputsParams
from tests.eagle_heads import write_head
from tests.test_spec_decode import GREEDY, PROMPTS, SCHEMA, STRESS

ENGINE_IN_PROCESS = True   # the engine in the test process: its steps in flight are observed directly


@pytest.fixture(autouse=True)
def spec_async(monkeypatch):
    monkeypatch.setenv("LOOM_SPEC_ASYNC", "1")


def _run(model_dir, params=GREEDY, prompts=PROMPTS, **kw):
    """(outputs, stats, overlapped): overlapped counts the steps submitted while a step whose
    drafts the worker places was still in flight (never without LOOM_SPEC_ASYNC)."""
    from frontend.entrypoints.llm import LLM
    with LLM(model_dir, **{**STRESS, **kw}) as llm:
        engine = llm.client.engine
        submit, overlapped = engine.executor.submit, [0]

        def counting(so):
            overlapped[0] += any(any(s.spec_draft_slots.values()) for s, _ in engine.in_flight)
            return submit(so)
        engine.executor.submit = counting
        outs = [o.outputs[0] for o in llm.generate(prompts, params, use_tqdm=False)]
        return outs, llm.stats, overlapped[0]


@pytest.fixture(scope="module")
def baseline(tiny_model_dir):
    outs, stats, _ = _run(tiny_model_dir)
    assert stats.num_preemptions > 0 and stats.prefix_cache_hits > 0
    return [o.token_ids for o in outs]


def _oracle(tmp_path, outputs, miss: float, prompts=PROMPTS, k: int = 3) -> dict:
    path = tmp_path / "oracle.json"
    path.write_text(json.dumps([{"prompt_token_ids": p, "output_token_ids": o} for p, o in zip(prompts, outputs)]))
    return {"method": "oracle", "num_speculative_tokens": k, "oracle_path": str(path), "oracle_miss_rate": miss}


@pytest.mark.parametrize("flag", ["1", "0"])
def test_two_steps_in_flight_while_verifying(flag, tiny_model_dir, baseline, tmp_path, monkeypatch):
    """One request, every step a verify step (the oracle replays its output): with the flag, each
    step after the first decode goes to the worker while the one before is in flight; without it
    none does (the engine waits for a step's drafts). Same tokens either way."""
    monkeypatch.setenv("LOOM_SPEC_ASYNC", flag)
    spec = _oracle(tmp_path, baseline[:1], 0.3, PROMPTS[:1])
    outs, stats, overlapped = _run(tiny_model_dir, prompts=PROMPTS[:1], speculative_config=spec)
    assert outs[0].token_ids == baseline[0]
    assert stats.spec_num_drafts > 5 and stats.mean_acceptance_length > 1.5, stats.mean_acceptance_length
    if flag == "1":
        assert overlapped >= stats.spec_num_drafts - 1, (overlapped, stats.spec_num_drafts)
    else:
        assert overlapped == 0


@pytest.mark.parametrize("case", ["oracle-all", "oracle-some", "oracle-none", "oracle-k1", "oracle-k5",
                                  "oracle-3-in-flight", "ngram", "ngram-disable", "draft_model", "eagle3"])
def test_greedy_identical_across_acceptance_patterns(case, tiny_model_dir, baseline, tmp_path):
    """Every draft accepted (the worker's next drafts start past them), some, none (every slot
    rolls back); 1 and 5 drafts; three steps in flight (the GPU's depth: two steps' drafts
    pending at once); each method; under chunked prefill, prefix caching and preemption."""
    kw = {}
    if case.startswith("oracle"):
        miss = {"oracle-all": 0.0, "oracle-none": 1.0}.get(case, 0.4)
        k = {"oracle-k1": 1, "oracle-k5": 5}.get(case, 3)
        spec = _oracle(tmp_path, baseline, miss, k=k)
        if case == "oracle-3-in-flight":
            kw["steps_in_flight"] = 3
    elif case.startswith("ngram"):
        spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3}
        if case == "ngram-disable":
            spec["disable_by_batch_size"] = 3
    elif case == "draft_model":
        spec = {"method": "draft_model", "model": tiny_model_dir, "num_speculative_tokens": 3}
    else:
        head = write_head(str(tmp_path / "head"), tiny_model_dir, "eagle3")
        spec = {"method": "eagle3", "model": head, "num_speculative_tokens": 3}
    outs, stats, overlapped = _run(tiny_model_dir, speculative_config=spec, **kw)
    assert [o.token_ids for o in outs] == baseline
    assert stats.num_preemptions > 0 and stats.prefix_cache_hits > 0
    assert overlapped > 0 and stats.spec_num_drafts > 0
    assert sum(stats.spec_accepted_per_pos) == stats.spec_num_accepted_tokens <= stats.spec_num_draft_tokens
    if case == "oracle-none":
        assert stats.spec_num_accepted_tokens == 0
    if case in ("oracle-all", "draft_model"):   # drafts from the output itself (the draft model is the target)
        assert stats.spec_num_accepted_tokens == stats.spec_num_draft_tokens, stats


def test_requests_ending_inside_their_drafts(tiny_model_dir, baseline, tmp_path):
    """max_tokens, a stop token and a stop string that fall inside a step's accepted drafts (all
    accepted): each request ends where it ends without speculation, its step in flight ignored."""
    from frontend.entrypoints.llm import LLM
    params = [SamplingParams(max_tokens=m, temperature=0, ignore_eos=True) for m in (1, 2, 6, 11)]
    params.append(SamplingParams(max_tokens=48, temperature=0, ignore_eos=True, stop_token_ids=[baseline[4][9]]))
    with LLM(tiny_model_dir, **STRESS) as llm:
        text = llm.generate(PROMPTS[:1], GREEDY, use_tqdm=False)[0].outputs[0].text
        params.append(SamplingParams(max_tokens=48, temperature=0, ignore_eos=True, stop=[text[20:24]]))
        prompts = PROMPTS + PROMPTS[:1]
        want = [(o.outputs[0].token_ids, o.outputs[0].text, o.outputs[0].finish_reason)
                for o in llm.generate(prompts, params, use_tqdm=False)]
    spec = _oracle(tmp_path, baseline + baseline[:1], 0.0, prompts)
    outs, stats, overlapped = _run(tiny_model_dir, params, prompts, speculative_config=spec)
    assert [(o.token_ids, o.text, o.finish_reason) for o in outs] == want
    assert overlapped > 0 and stats.mean_acceptance_length > 2


def test_seeded_sampling_identical_with_and_without_speculation(tiny_model_dir, tmp_path):
    """Each token is the plain sampler's draw at its output index, wherever the worker placed it:
    an oracle drafting the unspeculated run's own tokens leaves seeded outputs unchanged."""
    params = SamplingParams(max_tokens=40, temperature=0.9, seed=5, ignore_eos=True, logprobs=1)
    want, _, _ = _run(tiny_model_dir, params)
    spec = _oracle(tmp_path, [o.token_ids for o in want], 0.2)
    got, stats, overlapped = _run(tiny_model_dir, params, speculative_config=spec)
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    # (a verify step's logits rows come from a wider matmul than a decode step's: equal to float error)
    got_lp, want_lp = ([lp[t].logprob for o in outs for t, lp in zip(o.token_ids, o.logprobs)] for outs in (got, want))
    assert got_lp == pytest.approx(want_lp, abs=1e-4)
    assert overlapped > 0 and stats.spec_num_accepted_tokens > 0


@pytest.mark.parametrize("method", ["ngram", "draft_model"])
def test_constrained_and_free_requests_in_one_batch(method, tiny_model_dir, baseline):
    """A JSON-schema request beside free ones. With a presence penalty it never drafts, so its
    steps overlap and each one's sampling waits for its bitmask: a step with placed drafts for
    the free requests is then verified once the bitmask comes. The free requests keep their
    tokens, the constrained one stays valid."""
    import jsonschema

    from frontend.entrypoints.llm import LLM
    spec = {"method": method, "num_speculative_tokens": 3}
    spec.update({"model": tiny_model_dir} if method == "draft_model" else {"prompt_lookup_min": 1})
    constrained = SamplingParams(temperature=0, max_tokens=100, presence_penalty=0.5,
                                 structured_outputs=StructuredOutputsParams(json=SCHEMA))
    with LLM(tiny_model_dir, **STRESS, speculative_config=spec) as llm:
        llm.generate(["x"], constrained, use_tqdm=False)   # its grammar compiled: it joins the batch at once
        engine = llm.client.engine
        submit, deferred_verify = engine.executor.submit, [0]

        def counting(so):
            deferred_verify[0] += so.defer_sample and any(so.spec_draft_slots.values())
            return submit(so)
        engine.executor.submit = counting
        outs = [o.outputs[0] for o in llm.generate([PROMPTS[0], PROMPTS[2], PROMPTS[3]], [GREEDY, constrained, GREEDY],
                                                    use_tqdm=False)]
        stats = llm.stats
    assert outs[1].finish_reason == "stop", outs[1]
    jsonschema.validate(json.loads(outs[1].text), SCHEMA)
    assert [outs[0].token_ids, outs[2].token_ids] == [baseline[0], baseline[3]]
    assert deferred_verify[0] > 0 and stats.spec_num_accepted_tokens > 0


@pytest.mark.slow   # two worker processes: ~15 s
def test_tensor_parallel_draft_model_identical(tiny_model_dir, baseline):
    """TP=2 on gloo: every rank finishes the step before a step that places drafts, so both place
    the same drafts at the same positions."""
    from frontend.entrypoints.llm import LLM
    spec = {"method": "draft_model", "model": tiny_model_dir, "num_speculative_tokens": 3}
    with LLM(tiny_model_dir, multiprocess=True, tensor_parallel_size=2, speculative_config=spec, **STRESS) as llm:
        got = [o.outputs[0].token_ids for o in llm.generate(PROMPTS[:2], GREEDY, use_tqdm=False)]
        assert llm.stats.spec_num_accepted_tokens > 0
    assert got == baseline[:2]


@pytest.mark.parametrize("steps_in_flight", [2, 3])
def test_request_reaching_max_model_len_inside_drafts(steps_in_flight, tiny_model_dir, tmp_path):
    """A request that runs to max_model_len with every draft accepted: the steps scheduled behind
    its verify steps never place a token past max_model_len, whatever the steps in flight accept."""
    kw = dict(max_model_len=64, steps_in_flight=steps_in_flight)
    params = SamplingParams(temperature=0, ignore_eos=True, max_tokens=None)   # (the room left)
    prompts = [PROMPTS[3], PROMPTS[3][:37]]
    want, _, _ = _run(tiny_model_dir, params, prompts, **kw)
    assert [len(o.token_ids) for o in want] == [24, 27]
    spec = _oracle(tmp_path, [o.token_ids for o in want], 0.0, prompts)
    got, stats, overlapped = _run(tiny_model_dir, params, prompts, speculative_config=spec, **kw)
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    assert overlapped > 0 and stats.mean_acceptance_length > 2.5


@pytest.mark.parametrize("flag", ["1", "0"])
def test_perfect_oracle_verifies_nearly_every_step_at_batch_1(flag, tiny_model_dir, tmp_path, monkeypatch):
    """Issue 47: at batch 1 a perfect oracle drafts every decode step once its own recording has
    settled (bench.spec_decode: the recording run, SETTLE_RUNS full runs, then the timed ones). In
    bf16 on the decode graphs' path (run uncaptured on the CPU) the replay of this prompt breaks a
    near tie at output 12 the other way from the recording run (whose tokens came from the first row
    of verify steps of junk drafts); the oracle then stopped drafting for the rest of every run (3
    verify steps, with the flag and without). A run that leaves the engine's own recording now
    records on from there, so the runs after it replay it further: then at least 90% of the 47
    decode tokens come out of verify steps (10 steps with the flag, 9 without)."""
    import numpy as np

    from bench.spec_decode import SETTLE_RUNS
    from frontend.entrypoints.llm import LLM
    monkeypatch.setenv("LOOM_SPEC_ASYNC", flag)
    monkeypatch.setenv("LOOM_DECODE_GRAPHS_ON_CPU", "1")
    prompt = np.random.default_rng(9).integers(10, 200, 32).tolist()
    path = tmp_path / "oracle.json"
    path.write_text(json.dumps([{"prompt_token_ids": prompt, "miss_rate": 0.0}]))
    spec = {"method": "oracle", "num_speculative_tokens": 4, "oracle_path": str(path)}
    run = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True)
    # graph sizes up to 8 (1, 2, 4, 8): a batch-1 verify step of 5 rows runs in the size-8 graph as
    # before; the default sizes up to 512 (256 sequences of 5 rows) took ~90% of the test to set up
    with LLM(tiny_model_dir, dtype="bfloat16", max_model_len=128, steps_in_flight=3, speculative_config=spec,
             cuda_graph_sizes=[8]) as llm:
        llm.generate([prompt], SamplingParams(temperature=0, max_tokens=56, ignore_eos=True), use_tqdm=False)
        for _ in range(SETTLE_RUNS):
            llm.generate([prompt], run, use_tqdm=False)
        s = llm.stats
        drafts, accepted = s.spec_num_drafts, s.spec_num_accepted_tokens
        llm.generate([prompt], run, use_tqdm=False)
        verify_steps, accepted = s.spec_num_drafts - drafts, s.spec_num_accepted_tokens - accepted
    # (the steps' count is no measure here: without the flag the first two decode steps never
    # verify, and a 48-token run has 10 verify steps at most)
    assert accepted >= 4 * verify_steps - 3 and verify_steps + accepted >= 0.9 * 47, (verify_steps, accepted)
