"""Triton compiles in child processes, for a start-up dry run (workers/compile_ahead.py).

    processes = CompileProcesses.start(n, target)   # `python -m workers.compile_processes` x n
    processes.submit(CompileJob(module, name, specialization_data))   # once processes.ready
    processes.wait(); processes.close()

In compile threads, a variant's compile holds the GIL for about half its time (Triton's AST code
generator is Python, and its LLVM-IR passes run without releasing the GIL): on an H200 the
warm-up's dry pass took 20-25 s for 2-3 s of its own host work, its launches waiting for the GIL
behind 16 compiling threads (py-spy, bench/RESULTS.md session 42). A child process compiles
beside the worker without taking its GIL.

A child gets a variant as Triton's own specialization data (what its jit_cache_hook is given)
and compiles it with the kernel's `preload` into the shared cache directory (TRITON_CACHE_DIR),
then builds its launcher there too (Triton 3.6 compiles a C stub per signature). The worker's
real launch of the variant then loads both from the disk cache (a few ms) instead of compiling.
A child never touches the GPU: its Triton driver is told the worker's device and target, so it
creates no CUDA context (no device memory) while the KV cache holds nearly all of it.

A variant a child fails to compile (or a child that dies) is reported; the worker then compiles
it at its first launch, as it would have without the dry run. A child exits at the end of its
stdin: when the worker closes the pool after its start-up, or when the worker dies.
"""
from __future__ import annotations

import json
import os
import queue
import signal
import subprocess
import sys
import threading
from dataclasses import dataclass, field


@dataclass
class CompileJob:
    module: str          # the kernel's module (imported by the child)
    name: str            # its JITFunction's name in that module
    spec: str            # Triton's specialization data (JSON) of the variant


@dataclass
class CompileProcesses:
    """Child compile processes fed from one queue (each takes the next job when it is free)."""
    procs: list[subprocess.Popen]
    jobs: queue.Queue = field(default_factory=queue.Queue)
    failed: list[str] = field(default_factory=list)   # "kernel: error" of the variants not compiled
    pending: int = 0                                   # submitted, not yet answered
    ready: int = 0                                     # children that have imported torch and Triton
    alive: int = 0                                     # children still answering
    done: threading.Condition = field(default_factory=threading.Condition)

    @classmethod
    def start(cls, n: int, target: dict) -> CompileProcesses:
        """n children (each imports torch and Triton first, ~2 s, in parallel with the worker's
        own start, then says it is ready); target: the worker's Triton GPUTarget fields."""
        root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, (root, os.environ.get("PYTHONPATH")))))
        cmd = [sys.executable, "-m", "workers.compile_processes", json.dumps(target)]
        procs = [subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env, text=True, bufsize=1)
                 for _ in range(n)]
        self = cls(procs, alive=n)
        for i, proc in enumerate(procs):
            threading.Thread(target=self._feed, args=(proc,), name=f"loom-compile-feed_{i}", daemon=True).start()
        return self

    def submit(self, job: CompileJob) -> None:
        with self.done:
            self.pending += 1
        self.jobs.put(job)

    def _feed(self, proc: subprocess.Popen) -> None:
        """One child's jobs, one at a time, once it has imported what a compile needs (the
        thread waits on the pipe without the GIL)."""
        if not proc.stdout.readline():   # (its first line: ready)
            with self.done:
                self.alive -= 1
                self.done.notify_all()
            return
        with self.done:
            self.ready += 1
        while (job := self.jobs.get()) is not None:
            try:
                proc.stdin.write(json.dumps(vars(job)) + "\n")
                proc.stdin.flush()
                reply = proc.stdout.readline()
            except OSError:
                reply = ""
            error = "the compile process exited" if not reply else json.loads(reply).get("error")
            with self.done:
                if error:
                    self.failed.append(f"{job.name}: {error}")
                self.pending -= 1
                if not reply:
                    self.alive -= 1
                self.done.notify_all()
            if not reply:
                return

    def take_failed(self) -> list[str]:
        """The failures reported since the last call."""
        with self.done:
            failed, self.failed = self.failed, []
        return failed

    def wait(self, timeout: float = 600.0) -> None:
        """Until every submitted job is answered (or no child is left to answer the rest)."""
        with self.done:
            self.done.wait_for(lambda: self.pending == 0 or self.alive == 0, timeout)

    def close(self) -> None:
        """Every child told to exit at once (end of its stdin), then reaped in the background: a
        child's exit takes ~0.4 s (torch's), and waiting for each in turn held a fresh start
        6.6 s (16 children) after its graph capture."""
        for _ in self.procs:
            self.jobs.put(None)
        for proc in self.procs:
            try:
                proc.stdin.close()
            except OSError:
                pass
        threading.Thread(target=_reap, args=(self.procs,), name="loom-compile-reap", daemon=True).start()


def _reap(procs: list[subprocess.Popen], timeout: float = 30.0) -> None:
    """Wait for the children that were told to exit; kill one that has not within the timeout."""
    for proc in procs:
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def _serve(target: dict) -> None:
    """The child: one job per line of stdin, one JSON reply per line on the original stdout
    (anything else the compile prints goes to stderr)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)   # (a Ctrl-C reaches the whole group: the worker ends it)
    replies = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)
    import importlib

    import torch  # noqa: F401 - what every kernel module imports, before the child says it is ready
    from triton.compiler import compiler  # noqa: F401
    replies.write(json.dumps({"ready": True}) + "\n")
    active = None
    for line in sys.stdin:
        job = CompileJob(**json.loads(line))
        try:
            active = active or _told_driver(target)
            kernel = getattr(importlib.import_module(job.module), job.name).preload(job.spec)
            active.launcher_cls(kernel.src, kernel.metadata)   # the launcher's C stub, into the cache
            replies.write(json.dumps({}) + "\n")
        except Exception as e:   # noqa: BLE001 - reported: the worker compiles it itself
            replies.write(json.dumps({"error": f"{type(e).__name__}: {e}"[:500]}) + "\n")


def _told_driver(target: dict):
    """Triton's CUDA driver in the child, told the worker's device and target instead of asking
    CUDA (which would create a context: device memory)."""
    from triton.backends.compiler import GPUTarget
    from triton.runtime import driver
    active = driver.active
    gpu_target = GPUTarget(**target)
    active.get_current_device = lambda: 0
    active.get_current_target = lambda: gpu_target   # (preload checks the data was made for it)
    return active


if __name__ == "__main__":
    _serve(json.loads(sys.argv[1]))
