"""Sleep, wake-up, pause and resume through the offline LLM (the engine core owns the state)."""
from __future__ import annotations

import time

import pytest

from frontend import LLM, SamplingParams

PROMPTS = [[11, 12, 13, 14], [50, 60, 70], [101, 102, 103, 104, 105, 106]]
GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)


@pytest.fixture(scope="module", params=[True, False], ids=["process", "inprocess"])
def llm(model_factory, request):
    """Each test in both modes: the engine-core process, and in-process (multiprocess=False)."""
    engine = LLM(model_factory("qwen3"), multiprocess=request.param, max_model_len=128, block_size=4,
                 enable_sleep_mode=True)
    yield engine
    engine.shutdown()


def _gen(llm) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in PROMPTS], GREEDY,
                                                         use_tqdm=False)]


@pytest.fixture(scope="module")
def reference(llm):
    return _gen(llm)


def _until_waiting(llm, n: int, timeout: float = 30.0) -> dict:
    """debug_info once the engine holds n waiting requests (enqueue returns before they arrive)."""
    deadline = time.monotonic() + timeout
    while (info := llm.debug_info())["waiting"] < n and time.monotonic() < deadline:
        time.sleep(0.01)
    assert info["waiting"] == n, info
    return info


def test_sleep_level0_queues_then_runs(llm, reference):
    llm.sleep(0)
    assert llm.is_sleeping()
    llm.enqueue([{"prompt_token_ids": p} for p in PROMPTS], GREEDY)
    info = _until_waiting(llm, len(PROMPTS))
    time.sleep(0.3)
    assert info == llm.debug_info() and info["running"] == 0   # queued, and nothing moves
    llm.wake_up(["scheduling"])
    assert not llm.is_sleeping()
    assert [o.outputs[0].token_ids for o in llm.wait_for_completion()] == reference


@pytest.mark.parametrize("level", [1, 2])
def test_sleep_frees_memory_and_wakes_identical(llm, reference, level):
    awake = llm.collective_rpc("memory_info")[0]
    assert awake["weights"] > 0 and awake["kv_cache"] > 0
    llm.sleep(level)
    assert llm.is_sleeping()
    asleep = llm.collective_rpc("memory_info")[0]
    assert asleep["weights"] == 0 and asleep["kv_cache"] == 0
    llm.wake_up(["weights"])
    assert llm.is_sleeping()            # kv_cache still asleep
    llm.wake_up(["kv_cache"])           # RL trainers' sequence: weights (then updated), then the cache
    assert not llm.is_sleeping()        # (an internal "scheduling" tag kept it asleep: requests hung)
    assert _gen(llm) == reference


def test_sleep_with_requests_in_flight(llm, reference):
    llm.enqueue([{"prompt_token_ids": p} for p in PROMPTS], GREEDY)
    llm.sleep(1)                         # running requests are preempted, recomputed after wake-up
    llm.wake_up()
    assert [o.outputs[0].token_ids for o in llm.wait_for_completion()] == reference


def test_pause_abort_then_resume(llm, reference):
    llm.enqueue([{"prompt_token_ids": p} for p in PROMPTS], SamplingParams(temperature=0, max_tokens=100,
                                                                            ignore_eos=True))
    llm.pause("abort")
    assert llm.is_paused()
    outs = llm.wait_for_completion()
    assert [o.outputs[0].finish_reason for o in outs] == ["abort"] * len(PROMPTS)
    llm.enqueue([{"prompt_token_ids": p} for p in PROMPTS], GREEDY)  # queued while paused
    _until_waiting(llm, len(PROMPTS))
    time.sleep(0.3)
    assert llm.debug_info()["running"] == 0
    llm.resume()
    assert [o.outputs[0].token_ids for o in llm.wait_for_completion()] == reference


def test_pause_wait_returns_after_in_flight_finish(llm, reference):
    llm.enqueue([{"prompt_token_ids": p} for p in PROMPTS], GREEDY)
    while llm.debug_info()["running"] == 0:
        time.sleep(0.01)
    llm.pause("wait")
    assert llm.debug_info()["running"] == 0
    llm.resume()
    assert [o.outputs[0].token_ids for o in llm.wait_for_completion()] == reference


@pytest.mark.parametrize("clear_cache", [False, True])
def test_pause_keep_freezes_and_resumes_identically(llm, reference, clear_cache):
    llm.enqueue([{"prompt_token_ids": p} for p in PROMPTS], GREEDY)
    while llm.debug_info()["running"] == 0:
        time.sleep(0.01)
    t0 = time.monotonic()
    llm.pause("keep", clear_cache)
    assert time.monotonic() - t0 < 2.0    # never blocks on running requests
    frozen = llm.debug_info()
    time.sleep(0.3)
    assert llm.debug_info() == frozen     # nothing moves while paused
    llm.resume()
    assert [o.outputs[0].token_ids for o in llm.wait_for_completion()] == reference


def test_bad_control_arguments(llm):
    with pytest.raises(RuntimeError, match="level"):
        llm.sleep(3)
    with pytest.raises(RuntimeError, match="mode"):
        llm.pause("sometimes")
    with pytest.raises(RuntimeError, match="tags"):
        llm.wake_up(["gpu"])
    with pytest.raises(RuntimeError, match="not callable"):
        llm.collective_rpc("__init__")
    with pytest.raises(RuntimeError, match="must be a string"):   # (an AttributeError's message before)
        llm.collective_rpc(5)


def test_sleep_levels_need_sleep_mode(model_factory):
    llm = LLM(model_factory("qwen3"), max_model_len=128)
    try:
        with pytest.raises(RuntimeError, match="enable-sleep-mode"):
            llm.sleep(1)
        llm.sleep(0)
        llm.wake_up()
    finally:
        llm.shutdown()
    # after shutdown: one clear error (a ZMQError, or "the engine core exited with code 0")
    for call in (lambda: llm.generate(["hi"], use_tqdm=False), llm.pause, llm.is_sleeping):
        with pytest.raises(RuntimeError, match="shut down"):
            call()
    llm.shutdown()   # (idempotent)
