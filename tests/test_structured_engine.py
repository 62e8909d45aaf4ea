"""Structured outputs in the engine: offline SamplingParams(structured_outputs=...), identical
output with async scheduling on and off (the deferred sampling of a step whose bitmask needs
the previous step's tokens), free requests untouched in a mixed batch, a constraint that does
not compile failing alone in the engine, and the grammar starting after the thinking."""
from __future__ import annotations

import json
import os
import re
import sys
import threading
import time
from types import SimpleNamespace

import jsonschema
import pytest

from ipc.sampling_params import SamplingParams, StructuredOutputsParams

ENGINE_IN_PROCESS = True   # outputs only: the engine in the test process (tests/conftest.py engine_in_process)

SCHEMA = {"type": "object", "properties": {"word": {"type": "string", "maxLength": 6},
                                           "n": {"type": "integer", "minimum": 0, "maximum": 99},
                                           "ok": {"type": "boolean"}}, "required": ["word", "n", "ok"]}
REGEX = r"\d{2}-[xyz]{1,3}"
FREE = ["Beautiful is better than", "The quick brown fox", "Hello world! How"]


def _requests():
    prompts, params = [], []
    for seed in range(3):
        prompts.append("Tell me a story")
        params.append(SamplingParams(temperature=1.0, seed=seed, max_tokens=120,
                                     structured_outputs=StructuredOutputsParams(json=SCHEMA)))
    prompts.append("Count")
    params.append(SamplingParams(temperature=0.8, seed=5, max_tokens=20,
                                 structured_outputs=StructuredOutputsParams(regex=REGEX)))
    for p in FREE:
        prompts.append(p)
        params.append(SamplingParams(temperature=0, max_tokens=24))
    return prompts, params


@pytest.fixture(scope="module")
def results(tiny_model_dir):
    """(outputs with async scheduling, outputs without, solo greedy outputs of FREE)."""
    from frontend.entrypoints.llm import LLM
    prompts, params = _requests()
    out = {}
    for async_scheduling in (True, False):
        with LLM(tiny_model_dir, async_scheduling=async_scheduling, max_model_len=256) as llm:
            out[async_scheduling] = [o.outputs[0] for o in llm.generate(prompts, params, use_tqdm=False)]
            if async_scheduling:
                out["solo"] = [llm.generate([p], SamplingParams(temperature=0, max_tokens=24),
                                            use_tqdm=False)[0].outputs[0].text for p in FREE]
                bad_params = SamplingParams(max_tokens=4, structured_outputs=StructuredOutputsParams(regex="[0-9"))
                try:   # vLLM's LLM raises, and sends nothing
                    llm.generate(["x", "y"], [SamplingParams(max_tokens=4), bad_params], use_tqdm=False)
                except ValueError as e:
                    out["raised"] = str(e)
                # the engine checks again, for the clients that send it anyway (the LLM's check off)
                with pytest.MonkeyPatch.context() as mp:
                    mp.setattr("frontend.entrypoints.llm._check_constraint", lambda c: None)
                    bad = llm.generate(["x", "y"], [bad_params, SamplingParams(max_tokens=4, temperature=0)],
                                       use_tqdm=False)
                    out["bad"] = [o.outputs[0] for o in bad]
                    for _ in range(3):   # the same failed grammar, from the cache
                        llm.generate(["x"], bad_params, use_tqdm=False)
                out["live_after_bad"] = llm.debug_info()["live_requests"]
    return out


def test_constrained_outputs_are_valid(results):
    outs = results[True]
    for o in outs[:3]:
        assert o.finish_reason == "stop"
        jsonschema.validate(json.loads(o.text), SCHEMA)
    assert re.fullmatch(REGEX, outs[3].text) and outs[3].finish_reason == "stop"


def test_async_scheduling_on_and_off_identical(results):
    on, off = results[True], results[False]
    assert [(o.token_ids, o.finish_reason) for o in on] == [(o.token_ids, o.finish_reason) for o in off]


def test_free_requests_in_mixed_batch_equal_solo(results):
    assert [o.text for o in results[True][4:]] == results["solo"]
    assert [o.text for o in results[False][4:]] == results["solo"]


def test_constraint_that_does_not_compile_raises_in_llm(results):
    assert "the constraint is invalid" in results.get("raised", ""), results.get("raised")


def test_constraint_that_does_not_compile_fails_alone_in_the_engine(results):
    bad, good = results["bad"]
    assert bad.finish_reason == "error" and "does not compile" in str(bad.stop_reason)
    assert good.finish_reason == "length" and len(good.token_ids) == 4
    assert results["live_after_bad"] == 0   # the cached compile error held every such request


def test_grammar_applies_after_thinking(tiny_model_dir):
    """With --reasoning-parser, a request's matcher starts once </think> has been generated
    (or when the prompt already closed the thinking)."""
    from engine_core.request import Request
    from engine_core.structured_output import StructuredOutputManager
    from ipc.config import EngineConfig
    from ipc.messages import EngineCoreRequest, SchedulerOutput, CachedRequestData
    from transformers import AutoTokenizer
    config = EngineConfig(model=tiny_model_dir, reasoning_parser="qwen3").resolve()
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    manager = StructuredOutputManager(config)
    params = SamplingParams(structured_outputs=StructuredOutputsParams(choice=["yes", "no"]))

    def new(rid, prompt):
        req = Request(EngineCoreRequest(rid, tok.encode(prompt), params, config.eos_token_ids), 256, 0)
        manager.add_request(req)
        deadline = time.monotonic() + 60
        while not manager.ready(req):
            assert time.monotonic() < deadline
            time.sleep(0.01)
        return req

    def rows(*reqs):
        so = SchedulerOutput([], CachedRequestData(), [r.request_id for r in reqs], [1] * len(reqs))
        g = manager.grammar_bitmask(so, {r.request_id: r for r in reqs})
        return [] if g is None else g.rows

    thinking = new("a", "Question?")
    closed = new("b", "Question? <think>no</think>")
    assert not thinking.grammar.active and closed.grammar.active
    assert rows(thinking, closed) == [1]
    for t in tok.encode("<think>let me see"):
        thinking.output_token_ids.append(t)
        assert not manager.accept(thinking, t)
    assert rows(thinking) == []
    for t in tok.encode("</think>"):
        thinking.output_token_ids.append(t)
        manager.accept(thinking, t)
    assert thinking.grammar.active and rows(thinking) == [0]
    ended = [manager.accept(thinking, t) for t in tok.encode("yes") + config.eos_token_ids]
    assert ended[-1] and not any(ended[:-1])
    manager.shutdown()


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="per-thread nice values are Linux's")
def test_grammar_threads_leave_the_cpu_to_the_loop(tiny_model_dir):
    """xgrammar releases the GIL while it compiles, so a compile shares only the CPU with the busy
    loop: the grammar pool's thread (and xgrammar's threads, started from it) run at nice 19, so
    the loop gets most of a contended core. bench/grammar_stall.py measures the effect."""
    from engine_core.structured_output import StructuredOutputManager
    from ipc.config import EngineConfig
    mgr = StructuredOutputManager(EngineConfig(model=tiny_model_dir).resolve())
    req = SimpleNamespace(request_id="r", prompt_token_ids=[1], output_token_ids=[], eos_token_ids=[0], grammar=None,
                          sampling_params=SamplingParams(structured_outputs=StructuredOutputsParams(json=SCHEMA)))
    try:
        mgr.add_request(req)
        req.grammar.future.result(timeout=120)
        assert mgr.ready(req) and req.grammar.matcher is not None and req.grammar.error is None
        caller = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
        pool = mgr._pool.submit(lambda: os.getpriority(os.PRIO_PROCESS, threading.get_native_id())).result()
        assert pool == min(19, caller + 19)
        assert os.getpriority(os.PRIO_PROCESS, threading.get_native_id()) == caller   # the caller's thread is not
    finally:
        mgr.shutdown()


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="per-thread nice values are Linux's")
def test_bitmask_fill_runs_at_the_loops_priority(tiny_model_dir):
    """The step's bitmask fill is on the critical path: its thread, and the threads xgrammar's
    batch fill starts, run at the busy loop's priority, not at the compile pool's nice 19 (the
    batch matcher was made there, with the compiler: its threads filled every step's bitmask at
    nice 19, starved on a loaded host). Several rows take the batch fill; its Future gives what
    grammar_bitmask() gives."""
    from engine_core.structured_output import StructuredOutputManager
    from ipc.config import EngineConfig
    mgr = StructuredOutputManager(EngineConfig(model=tiny_model_dir).resolve())
    reqs = {str(i): SimpleNamespace(request_id=str(i), prompt_token_ids=[1], output_token_ids=[], eos_token_ids=[0],
                                    grammar=None, sampling_params=SamplingParams(
                                        structured_outputs=StructuredOutputsParams(json=SCHEMA)))
            for i in range(3)}
    so = SimpleNamespace(req_ids=["0", "free", "1", "2"], scheduled_spec_decode_tokens={})
    tasks = f"/proc/{os.getpid()}/task"
    try:
        for r in reqs.values():
            mgr.add_request(r)
            r.grammar.future.result(timeout=120)
            assert mgr.ready(r)
        assert mgr._batch is None   # not made with the compiler, on its nice-19 thread
        before = set(os.listdir(tasks))
        got = mgr.start_grammar_bitmask(so, reqs).result(timeout=60)
        assert got.rows == [0, 2, 3] and got.bitmask.shape[1] == (mgr.vocab_size + 31) // 32
        again = mgr.grammar_bitmask(so, reqs)
        assert again.rows == got.rows and (again.bitmask == got.bitmask).all()
        assert mgr._batch is not None
        caller = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
        new = [int(t) for t in set(os.listdir(tasks)) - before]
        assert mgr._filler.submit(threading.get_native_id).result() in new
        assert all(os.getpriority(os.PRIO_PROCESS, t) == caller for t in new if os.path.exists(f"{tasks}/{t}"))
    finally:
        mgr.shutdown()


def test_grammar_head_samples_as_the_eager_path(tiny_model_dir, monkeypatch):
    """With the decode graphs' work on (uncaptured, LOOM_DECODE_GRAPHS_ON_CPU=1), constrained
    decode steps are sampled by the graphs' grammar head (the bitmask staged into the head's
    buffers): the same tokens as the eager sampler's (LOOM_GRAMMAR_GRAPH_HEAD=0), valid output,
    and the head did run with constrained rows; the steps after them had their host inputs
    built while they waited for their bitmasks."""
    from frontend.entrypoints.llm import LLM
    from workers.decode_graphs import DecodeGraphs
    monkeypatch.setenv("LOOM_DECODE_GRAPHS_ON_CPU", "1")
    heads = []
    set_grammar = DecodeGraphs.set_grammar

    def counted(self, bs, distinct, mask_rows):
        heads.append(int((mask_rows >= 0).sum()))
        return set_grammar(self, bs, distinct, mask_rows)
    monkeypatch.setattr(DecodeGraphs, "set_grammar", counted)
    from workers.model_runner import ModelRunner
    ahead, prepare_ahead = [], ModelRunner.prepare_ahead

    def counted_ahead(self, so):   # a step built on the host while the one before waited for its bitmask
        ahead.append(len(so.req_ids))
        return prepare_ahead(self, so)
    monkeypatch.setattr(ModelRunner, "prepare_ahead", counted_ahead)
    prompts, params = _requests()
    out = {}
    for head in ("1", "0"):
        monkeypatch.setenv("LOOM_GRAMMAR_GRAPH_HEAD", head)
        with LLM(tiny_model_dir, max_model_len=256, cuda_graph_sizes=[8]) as llm:
            out[head] = [o.outputs[0] for o in llm.generate(prompts, params, use_tqdm=False)]
        if head == "1":
            assert heads and max(heads) >= 3, heads   # steps whose constrained rows the head masked
            n_heads, heads[:] = len(heads), []
        assert len(ahead) > 10, ahead   # (workers/step_pipeline.py, both ways of sampling)
        ahead[:] = []
    assert not heads   # the switch off: never the grammar head
    assert [(o.token_ids, o.finish_reason) for o in out["1"]] == [(o.token_ids, o.finish_reason) for o in out["0"]]
    for o in out["1"][:3]:
        jsonschema.validate(json.loads(o.text), SCHEMA)
    assert n_heads > 10


def test_steps_built_ahead_with_slots_taken_by_new_penalised_requests(tiny_model_dir):
    """More requests than slots (4), constrained ones with top-k and penalties (the eager sampler:
    their steps wait for the bitmask) beside greedy penalised ones, all finishing at different
    lengths: new requests take finished requests' slots in steps built while the step before
    waits for its sample, which still records tokens into those slots. The new requests' penalty
    rows are set after it (InputBatch.write_rows): the same tokens with async scheduling on
    (steps built ahead) and off (none deferred)."""
    from frontend.entrypoints.llm import LLM
    prompts, params = [], []
    for i in range(10):
        prompts.append(f"Request {i}: tell me a story")
        if i % 2:
            params.append(SamplingParams(temperature=1.0, seed=i, top_k=20, max_tokens=30 + 7 * i,
                                         repetition_penalty=1.3, frequency_penalty=0.4,
                                         structured_outputs=StructuredOutputsParams(json=SCHEMA)))
        else:
            params.append(SamplingParams(temperature=0, max_tokens=12 + 5 * i, ignore_eos=True,
                                         repetition_penalty=1.5, presence_penalty=0.7))
    out = {}
    for async_scheduling in (True, False):
        with LLM(tiny_model_dir, async_scheduling=async_scheduling, max_model_len=256, max_num_seqs=4) as llm:
            out[async_scheduling] = [(o.outputs[0].token_ids, o.outputs[0].finish_reason)
                                     for o in llm.generate(prompts, params, use_tqdm=False)]
    assert out[True] == out[False]
