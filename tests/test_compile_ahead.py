"""workers/compile_ahead.py (issue 49, start-up): a phase's Triton compiles in parallel by a dry
run of it. The dry run's own launches need a GPU (tests/test_gpu_startup.py); here: the zeroed
allocations that keep a dry run's values valid, the switch, and the launch patch's scope."""
from __future__ import annotations

import threading

import pytest
import torch

from workers import compile_ahead
from workers.compile_ahead import DryLaunches, ZeroedAllocations, run_compiled_ahead, threads


def test_dry_runs_allocations_are_zeroed_and_other_ops_untouched():
    base = torch.full((4, 3), 7.0)
    torch.empty(1 << 16).fill_(5.0)   # leave nonzero bytes in the allocator's way
    with ZeroedAllocations(devices=("cpu",)):
        made = [torch.empty(1 << 16), torch.empty_like(base), base.new_empty((5,)),
                torch.empty_strided((2, 3), (3, 1), dtype=torch.int64), torch.empty(3, dtype=torch.int32)]
        ones, added = torch.ones(3), base + 1
    assert all(t.count_nonzero() == 0 for t in made)
    assert torch.equal(ones, torch.ones(3)) and torch.equal(added, torch.full((4, 3), 8.0))
    assert torch.equal(base, torch.full((4, 3), 7.0))            # nothing allocated before is touched
    idx = torch.empty(4, dtype=torch.int64)
    with ZeroedAllocations(devices=("cpu",)):
        idx = torch.empty(4, dtype=torch.int64)
    assert torch.equal(torch.arange(10)[idx], torch.zeros(4, dtype=torch.int64))   # a valid index


def test_the_switch_and_the_cpu(monkeypatch):
    cuda, cpu = torch.device("cuda", 0), torch.device("cpu")
    assert not compile_ahead._known_start   # (a CPU engine marks nothing: tests/test_engine_parity.py ran before)
    monkeypatch.setenv("LOOM_COMPILE_THREADS", "0")
    assert threads(cuda) == 0
    monkeypatch.setenv("LOOM_COMPILE_THREADS", "3")
    assert threads(cpu) == 0 and threads(cuda) == 3
    monkeypatch.delenv("LOOM_COMPILE_THREADS")
    assert 1 <= threads(cuda) <= 16
    calls = []
    assert run_compiled_ahead(lambda: calls.append(1) or len(calls), cpu) == 1 and calls == [1]  # once, no dry run


def test_dry_launch_patch_is_scoped_to_its_thread_and_restored():
    triton_jit = pytest.importorskip("triton.runtime.jit")
    original = triton_jit.JITFunction.run
    dry = DryLaunches()
    seen = []

    class Kernel(triton_jit.JITFunction):   # its run as Triton's, recording the warmup flag it gets
        def __init__(self):
            pass

    def record(self, *args, grid, warmup, **kwargs):
        seen.append((threading.get_ident() == dry.thread, warmup))
    triton_jit.JITFunction.run = record
    try:
        with dry.patched():
            with pytest.raises(RuntimeError, match="already"):
                with DryLaunches().patched():
                    pass
            Kernel().run(1, grid=(1,), warmup=False)          # this thread: dry
            t = threading.Thread(target=lambda: Kernel().run(1, grid=(1,), warmup=False))
            t.start()
            t.join()                                           # another thread: launched
        Kernel().run(1, grid=(1,), warmup=False)               # after: launched
    finally:
        triton_jit.JITFunction.run = original
    assert seen == [(True, True), (False, False), (True, False)] and dry.launches == 1
    assert compile_ahead.DryLaunches._active is None


def test_decode_graphs_dry_run_body_runs_every_size_and_leaves_the_tokens(tiny_model_dir, monkeypatch):
    """DecodeGraphs.run_once (the dry run of capture on the GPU) runs each size's model and head
    work (uncaptured on the CPU); the engine's greedy tokens after it are the graphs' before it."""
    from frontend import LLM, SamplingParams
    monkeypatch.setenv("LOOM_DECODE_GRAPHS_ON_CPU", "1")
    prompts = [{"prompt_token_ids": list(range(3, 3 + n))} for n in (5, 17)]
    greedy = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    with LLM(tiny_model_dir, multiprocess=False, max_model_len=64, block_size=4, max_num_seqs=4) as llm:
        want = [o.outputs[0].token_ids for o in llm.generate(prompts, greedy, use_tqdm=False)]
        graphs = llm.client.engine.executor.runner.decode_graphs
        assert graphs is not None and graphs.sizes == [1, 2, 4]
        with ZeroedAllocations(devices=("cpu",)):
            graphs.run_once()
        assert [o.outputs[0].token_ids for o in llm.generate(prompts, greedy, use_tqdm=False)] == want


def test_a_start_seen_before_runs_no_dry_runs(tiny_model_dir, tmp_path, monkeypatch):
    """start_key: the same start keys the same; a shape-changing flag, a kernel-changing LOOM_*
    variable or another GPU keys anew; the log level does not. A marked start turns the dry runs
    off (threads 0) until a start of another key."""
    from ipc.config import EngineConfig
    cfg = lambda **kw: EngineConfig(model=tiny_model_dir, **kw).resolve()
    key = compile_ahead.start_key(cfg(), "H200 sm90")
    assert compile_ahead.start_key(cfg(), "H200 sm90") == key
    assert compile_ahead.start_key(cfg(max_model_len=64), "H200 sm90") != key
    assert compile_ahead.start_key(cfg(), "H100 sm90") != key
    monkeypatch.setenv("LOOM_LOG_LEVEL", "DEBUG")
    assert compile_ahead.start_key(cfg(), "H200 sm90") == key
    monkeypatch.setenv("LOOM_GEMV", "0")
    assert compile_ahead.start_key(cfg(), "H200 sm90") != key
    monkeypatch.setenv("LOOM_COMPILE_THREADS", "2")
    cuda = torch.device("cuda", 0)
    monkeypatch.setattr(compile_ahead, "_marker", str(tmp_path / "loom-starts" / key))
    monkeypatch.setattr(compile_ahead, "_known_start", False)
    assert threads(cuda) == 2
    compile_ahead.mark_started()
    assert (tmp_path / "loom-starts" / key).exists() and threads(cuda) == 0


def test_warm_up_and_capture_survive_a_dry_run_and_leave_the_engine_as_it_was(model_factory, monkeypatch):
    """The dry runs on the CPU: the interpreted Triton kernels' launches turned dry (the GPU's
    JITFunction launches are, in the same way), allocations zero-filled. The warm-up's and the
    decode graphs' bodies run to the end on what the skipped kernels leave (no index out of
    range, no host check failing), launch kernels, and the engine's tokens after are those before."""
    from triton.runtime.interpreter import InterpretedFunction

    from frontend import LLM, SamplingParams
    from workers.warmup import _graph_bodies, _warm_up
    monkeypatch.setenv("LOOM_DECODE_GRAPHS_ON_CPU", "1")
    model_dir = model_factory("qwen3", num_hidden_layers=1, max_position_embeddings=128)
    prompts = [{"prompt_token_ids": list(range(3, 3 + n))} for n in (3, 6)]
    greedy = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
    with LLM(model_dir, multiprocess=False, attention_backend="triton", max_model_len=128, block_size=16,
             max_num_seqs=2, max_num_batched_tokens=64) as llm:
        want = [o.outputs[0].token_ids for o in llm.generate(prompts, greedy, use_tqdm=False)]
        runner = llm.client.engine.executor.runner
        dry = DryLaunches()
        with dry.patched(InterpretedFunction), ZeroedAllocations(devices=("cpu",)):
            _warm_up(runner)
            _graph_bodies(runner)   # the decode graphs' steps, on graph objects of their own
        assert dry.launches > 50
        assert [o.outputs[0].token_ids for o in llm.generate(prompts, greedy, use_tqdm=False)] == want


def test_mid_run_compiles_are_counted_and_named(monkeypatch, caplog):
    """Once the worker serves (mark_started), Triton's compile hooks count and log every variant
    still compiled, with its kernel's name; the step stats read the count."""
    from triton import knobs
    monkeypatch.setattr(compile_ahead, "_mid_run", None)
    monkeypatch.setattr(compile_ahead, "_marker", None)
    monkeypatch.setattr(knobs.runtime, "jit_cache_hook", None)
    monkeypatch.setattr(knobs.runtime, "jit_post_compile_hook", None)
    compile_ahead.watch_mid_run_compiles()
    assert knobs.runtime.jit_post_compile_hook is None   # (no CUDA worker: nothing to watch)
    monkeypatch.setattr(compile_ahead, "_marker", "/nonexistent/marker")
    compile_ahead.watch_mid_run_compiles()
    assert knobs.runtime.jit_cache_hook(key=("k",), repr="_kernel[num_warps=4](x: *fp32)") is False   # compiles
    with caplog.at_level("WARNING", logger="workers.compile_ahead"):
        knobs.runtime.jit_post_compile_hook(key=("k",), repr="_kernel[num_warps=4](x: *fp32)", compile={"x": 1})
    assert compile_ahead.mid_run_compiles() == 1
    assert "mid-run" in caplog.text and "_kernel[num_warps=4]" in caplog.text
