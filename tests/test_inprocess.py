"""The in-process mode (`LLM(..., multiprocess=False)`, LOOM_ENABLE_MULTIPROCESSING=0): the engine
core and its one worker in the caller's process, with the process mode's tokens, stats and
control calls, and no child process, socket or thread."""
from __future__ import annotations

import multiprocessing
import os
import random
import threading

import pytest

from frontend import LLM, SamplingParams
from tests.conftest import child_pids

MAX_NEW = 10


def _workload(vocab: int = 300) -> tuple[list[list[int]], list[SamplingParams]]:
    """Prompts that share a prefix (prefix caching) and long ones (chunked prefill), each
    greedy and seeded."""
    rng = random.Random(3)
    shared = [rng.randrange(3, vocab - 16) for _ in range(21)]
    prompts = [shared + [rng.randrange(3, vocab - 16) for _ in range(k)] for k in (1, 5, 11)]
    prompts += [[rng.randrange(3, vocab - 16) for _ in range(k)] for k in (2, 19, 33, 7)]
    greedy = [SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True)] * len(prompts)
    seeded = [SamplingParams(temperature=0.9, top_p=0.9, seed=100 + i, max_tokens=MAX_NEW, ignore_eos=True)
              for i in range(len(prompts))]
    return prompts + prompts, greedy + seeded


def _run(model_dir: str, multiprocess: bool | None, expect_procs: bool, **options):
    prompts, params = _workload()
    llm = LLM(model_dir, multiprocess=multiprocess, max_model_len=64, block_size=4, **options)
    try:
        assert bool(llm.engine_procs) == expect_procs
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        return [o.outputs[0].token_ids for o in outs], llm.stats
    finally:
        llm.shutdown()


@pytest.mark.parametrize("name,options", [
    # chunked prefill (8 tokens a step) with the shared prefix cached, two steps in flight
    ("chunked_prefix_caching", dict(max_num_batched_tokens=8, max_num_seqs=4, enable_prefix_caching=True)),
    # a KV cache so small that requests are preempted and recomputed
    ("preempted", dict(num_gpu_blocks_override=20, max_num_seqs=8)),
])
def test_same_tokens_as_the_process_mode(model_factory, monkeypatch, name, options):
    """The keyword wins over the variable: with LOOM_ENABLE_MULTIPROCESSING=0 set,
    multiprocess=True still starts the engine-core process."""
    model_dir = model_factory("qwen3")
    monkeypatch.setenv("LOOM_ENABLE_MULTIPROCESSING", "0")
    process, process_stats = _run(model_dir, True, True, **options)
    inproc, inproc_stats = _run(model_dir, None, False, **options)   # from the variable
    assert inproc == process
    assert inproc_stats.prefix_cache_hits == process_stats.prefix_cache_hits
    if name == "chunked_prefix_caching":
        assert inproc_stats.prefix_cache_hits > 0
    else:
        assert inproc_stats.num_preemptions > 0 and process_stats.num_preemptions > 0


def _sockets() -> set[str]:
    """This process's open sockets (zmq's included), by inode."""
    fds = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            fds.append(os.readlink(f"/proc/self/fd/{fd}"))
        except OSError:   # (the directory's own fd, closed by now)
            pass
    return {f for f in fds if f.startswith("socket:")}


def test_no_child_process_socket_or_thread(model_factory):
    """Everything runs in the caller's thread: a breakpoint in the scheduler or the runner is hit
    from generate()."""
    from engine_core.scheduler import Scheduler
    from workers.model_runner import ModelRunner
    model_dir = model_factory("qwen3")   # (built first: its writer's progress bar starts a thread)
    children, sockets, threads = set(child_pids(os.getpid(), trackers=True)), _sockets(), threading.enumerate()
    seen: set[str] = set()

    def calls_from(name, fn):
        def wrapper(*a, **kw):
            seen.add(f"{name} in {threading.current_thread().name}")
            return fn(*a, **kw)
        return wrapper
    mp = pytest.MonkeyPatch()
    mp.setattr(Scheduler, "schedule", calls_from("schedule", Scheduler.schedule))
    mp.setattr(ModelRunner, "launch", calls_from("launch", ModelRunner.launch))
    try:
        with LLM(model_dir, multiprocess=False, max_model_len=64, block_size=4) as llm:
            out = llm.generate({"prompt_token_ids": [5, 6, 7]}, SamplingParams(temperature=0, max_tokens=4),
                               use_tqdm=False)[0]
            assert len(out.outputs[0].token_ids) == 4
            assert multiprocessing.active_children() == []
            assert set(child_pids(os.getpid(), trackers=True)) <= children
            assert _sockets() <= sockets and llm.ipc_dir is None
            assert threading.enumerate() == threads
    finally:
        mp.undo()
    main = threading.main_thread().name
    assert seen == {f"schedule in {main}", f"launch in {main}"}


@pytest.mark.parametrize("options", [dict(tensor_parallel_size=2), dict(data_parallel_size=2)])
def test_one_engine_one_worker_only(model_factory, options):
    with pytest.raises(ValueError, match="multiprocess=False"):
        LLM(model_factory("qwen3"), multiprocess=False, max_model_len=64, **options)


def test_sleep_wake_and_control_calls(model_factory):
    prompts = [{"prompt_token_ids": p} for p in ([11, 12, 13, 14], [50, 60, 70])]
    greedy = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    with LLM(model_factory("qwen3"), multiprocess=False, max_model_len=64, block_size=4,
             enable_sleep_mode=True) as llm:
        before = [o.outputs[0].token_ids for o in llm.generate(prompts, greedy, use_tqdm=False)]
        llm.sleep(1)
        assert llm.is_sleeping()
        assert llm.collective_rpc("memory_info")[0]["weights"] == 0
        llm.enqueue(prompts, greedy)
        with pytest.raises(RuntimeError, match="nothing it can run"):   # no other process could wake it
            llm.wait_for_completion()
        llm.wake_up()
        assert not llm.is_sleeping()
        assert [o.outputs[0].token_ids for o in llm.generate(prompts, greedy, use_tqdm=False)] == before
        # pause(wait): the engine steps in this thread until the running requests finish
        llm.enqueue(prompts, greedy)
        assert llm.debug_info()["running"] == len(prompts)
        llm.pause("wait")
        assert llm.is_paused() and llm.debug_info()["running"] == 0
        llm.resume()
        assert [o.outputs[0].token_ids for o in llm.wait_for_completion()] == before
        assert llm.collective_rpc("ping") == ["pong"]
        assert llm.reset_prefix_cache() is True
        with pytest.raises(RuntimeError, match="unknown utility method"):
            llm.client.call_utility("no_such_method")
        with pytest.raises(RuntimeError, match="worker 0: .*not callable"):
            llm.collective_rpc("no_such_method")
    with pytest.raises(RuntimeError, match="shut down"):
        llm.generate(prompts, greedy, use_tqdm=False)


def test_an_error_in_a_step_ends_the_engine(model_factory, monkeypatch):
    """What a step raises reaches the caller, and ends the engine as it ends the engine-core
    process: the state it left is unknown, so later calls say so."""
    from frontend.engine_client import EngineDeadError
    from workers.model_runner import ModelRunner
    prompt = {"prompt_token_ids": [5, 6, 7]}
    with LLM(model_factory("qwen3"), multiprocess=False, max_model_len=64, block_size=4) as llm:
        def broken(self, so, prev=None, host_step=None):
            raise RuntimeError("a broken kernel")
        monkeypatch.setattr(ModelRunner, "launch", broken)
        with pytest.raises(RuntimeError, match="a broken kernel"):
            llm.generate(prompt, SamplingParams(max_tokens=2), use_tqdm=False)
        monkeypatch.undo()
        with pytest.raises(EngineDeadError, match="in-process engine failed: RuntimeError: a broken kernel"):
            llm.generate(prompt, SamplingParams(max_tokens=2), use_tqdm=False)
