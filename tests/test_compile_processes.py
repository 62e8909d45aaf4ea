"""The start-up's compile processes (workers/compile_processes.py), on the CPU: a variant a
child cannot compile comes back as a failure with the child's own error (the worker then
compiles it at its first launch), a child that dies fails its job instead of hanging the wait,
and close() leaves no child behind (without waiting for their exits). The compiles themselves need CUDA: tests/test_gpu_startup.py."""
from __future__ import annotations

import time

import pytest
import torch

from workers.compile_processes import CompileJob, CompileProcesses

H100 = {"backend": "cuda", "arch": 90, "warp_size": 32}


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU's failure path (on CUDA the kernel compiles)")
def test_failures_come_back_with_the_childs_error_and_a_dead_child_hangs_nothing():
    pool = CompileProcesses.start(2, H100)
    try:
        deadline = time.monotonic() + 120
        while pool.ready < 2 and time.monotonic() < deadline:   # each says so once it has imported torch
            time.sleep(0.05)
        assert pool.ready == 2 and pool.alive == 2
        pool.submit(CompileJob("no_such_module_here", "kernel", "{}"))
        pool.submit(CompileJob("kernels.rms_norm", "_rms_norm_kernel", "{}"))
        pool.wait(timeout=120)
        assert pool.pending == 0 and pool.alive == 2
        assert len(pool.failed) == 2
        # without CUDA, Triton finds no driver to compile for; the child says so
        assert all("RuntimeError" in f or "ModuleNotFoundError" in f for f in pool.failed), pool.failed
        pool.procs[0].kill()
        pool.procs[0].wait()
        for _ in range(4):
            pool.submit(CompileJob("no_such_module_here", "kernel", "{}"))
        pool.wait(timeout=120)
        assert pool.pending == 0 and pool.alive >= 1 and len(pool.failed) == 6
    finally:
        pool.close()   # returns at once; the children exit and are reaped in the background
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and any(p.poll() is None for p in pool.procs):
        time.sleep(0.05)
    assert all(p.poll() is not None for p in pool.procs)
