"""Start-up on the GPU (issue 49): a phase's Triton kernels compiled ahead in parallel by a dry
run (workers/compile_ahead.py): the real run compiles nothing more, its results are exact, and
a value out of a skipped kernel that indexes a torch op in the dry run is a valid index."""
from __future__ import annotations

import os
import random
import time

import pytest
import torch
import triton
import triton.language as tl

from workers import compile_ahead as compile_ahead_module
from workers.compile_ahead import compile_ahead, run_compiled_ahead, threads
from workers.compile_processes import CompileProcesses

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


@triton.jit
def _scaled_index(x_ptr, out_ptr, n, SCALE: tl.constexpr, MOD: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(x_ptr + offs, mask=offs < n, other=0)
    tl.store(out_ptr + offs, (x * SCALE) % MOD, mask=offs < n)


def _phase(x: torch.Tensor, table: torch.Tensor, scales: list[int]) -> list[torch.Tensor]:
    out = []
    for scale in scales:
        idx = torch.empty_like(x)   # the dry run leaves it as allocated: zeroed, a valid index
        _scaled_index[(triton.cdiv(x.numel(), 128),)](x, idx, x.numel(), SCALE=scale, MOD=table.numel(), BLOCK=128)
        out.append(table[idx] * 2)  # a gather: an out-of-range index would be a device assert
    return out


@pytest.mark.parametrize("processes", [0, 2], ids=["threads", "processes"])
def test_compiled_ahead_the_real_run_compiles_nothing(tmp_path, monkeypatch, processes):
    """The dry run compiles the phase's new variants (in compile threads, or in compile processes
    that write them to the cache dir); the real run then compiles nothing more, builds no
    launcher, and its results are exact."""
    from triton.runtime import driver
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("LOOM_COMPILE_THREADS", "4")
    monkeypatch.setattr(compile_ahead_module, "_known_start", False)   # (an engine of an earlier test may have set it)
    pool = CompileProcesses.start(processes, dict(vars(driver.active.get_current_target()))) if processes else None
    deadline = time.monotonic() + 120
    while pool is not None and pool.ready < processes and time.monotonic() < deadline:   # (until then: threads)
        time.sleep(0.05)
    monkeypatch.setattr(compile_ahead_module, "_processes", pool)
    device = torch.device("cuda", torch.cuda.current_device())
    assert threads(device) == 4
    scales = random.sample(range(3, 10_000), 6)   # variants no earlier run compiled
    x = torch.arange(1000, device=device, dtype=torch.int64)
    table = torch.randn(97, device=device)
    kernels = _scaled_index.device_caches[device.index][0]
    before = len(kernels)
    try:
        compile_ahead(lambda: _phase(x, table, scales), device, "test")
        if pool is None:   # each compiled here and made launchable in the pool: binary loaded, launcher built
            assert len(kernels) == before + len(scales)
            assert all(getattr(k, "module", None) is not None for k in kernels.values())
        else:              # each compiled by a process; no placeholder left in the kernel cache
            assert len(kernels) == before and not pool.failed and pool.pending == 0
        on_disk = sorted(os.listdir(tmp_path))
        assert len(on_disk) > len(scales)   # the variants and their launcher (Triton 3.6 builds one per signature)
        got = run_compiled_ahead(lambda: _phase(x, table, scales), device, "test")   # a second dry run: all cached;
        # the real run writes nothing to the cache dir (no compile, no launcher)
        assert len(kernels) == before + len(scales) and sorted(os.listdir(tmp_path)) == on_disk
    finally:
        if pool is not None:
            pool.close()
    for scale, g in zip(scales, got):
        torch.testing.assert_close(g, table[(x * scale) % table.numel()] * 2, rtol=0, atol=0)


def test_an_engine_started_with_dry_runs_samples_as_one_without(model_factory, tmp_path, monkeypatch, caplog):
    """End to end on the GPU: an engine whose profiling run, warm-up and graph capture each ran
    dry first (kernels compiled ahead) gives the same greedy and seeded tokens as an engine
    started with LOOM_COMPILE_THREADS=0; its worker logged the dry runs."""
    import logging

    from frontend import LLM, SamplingParams
    model = model_factory("qwen3", hidden_size=256, intermediate_size=512, num_attention_heads=8,
                          num_key_value_heads=2, num_hidden_layers=2)
    prompts = [{"prompt_token_ids": list(range(5, 5 + n))} for n in (3, 40, 200)]
    params = [SamplingParams(temperature=0, max_tokens=16, ignore_eos=True),
              SamplingParams(temperature=0.8, top_p=0.9, seed=7, max_tokens=16, ignore_eos=True)]
    runs = []
    for threads_env in ("4", "0"):
        monkeypatch.setenv("LOOM_COMPILE_THREADS", threads_env)
        monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / f"cache-{threads_env}"))
        with caplog.at_level(logging.DEBUG, logger="workers.compile_ahead"), \
                LLM(model, multiprocess=False, max_model_len=512, dtype="bfloat16") as llm:
            runs.append([[o.outputs[0].token_ids for o in llm.generate(prompts, p, use_tqdm=False)] for p in params])
    dry = [r.getMessage() for r in caplog.records if "kernels ahead" in r.getMessage()]
    assert any("warm-up" in m for m in dry) and any("profiling run" in m for m in dry), dry
    assert runs[0] == runs[1]
