"""Child processes: spawn, death pipes, and teardown.

Every parent watches its children's sentinels; every child watches its parent
through a death pipe (EOF when the parent is gone, however it died) and exits.
"""
from __future__ import annotations

import gc
import logging
import multiprocessing as mp
import contextlib
import os
import shutil
import sys
import signal
import threading
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess

logger = logging.getLogger(__name__)
_ctx = mp.get_context("spawn")


def start_process(target, name: str, args: tuple = ()) -> BaseProcess:
    """Start target(*args, death_pipe) in a fresh interpreter; the parent keeps the write end."""
    reader, writer = _ctx.Pipe(duplex=False)
    proc = _ctx.Process(target=target, name=name, args=(*args, reader), daemon=False)
    with _main_module_hidden():
        proc.start()
    reader.close()
    proc._loom_death_writer = writer  # keep it open for as long as the parent lives
    return proc


@contextlib.contextmanager
def _main_module_hidden():
    """Our targets live in packages, so the child need not re-run the caller's script
    (spawn would, and a script without a __main__ guard would then start itself again)."""
    main = sys.modules.get("__main__")
    saved = {k: main.__dict__[k] for k in ("__file__", "__spec__") if main is not None and k in main.__dict__}
    try:
        for k in saved:
            setattr(main, k, None) if k == "__spec__" else delattr(main, k)
        yield
    finally:
        for k, v in saved.items():
            setattr(main, k, v)


DRAIN = b"drain"   # parent -> child on the death pipe: finish in-flight work, then exit


def freeze_startup_heap() -> None:
    """Move every object alive after start-up (imported modules, torch, the model's Python
    objects) out of the garbage collector's reach, as vLLM does: the collector's full passes
    then walk only what the serving loop made. Without it, a step that allocates many
    containers (logprobs: lists per request per token) set off full passes over a heap of
    hundreds of thousands of start-up objects. Cycles made at start-up are collected first."""
    gc.collect()
    gc.freeze()


def request_drain(proc: BaseProcess) -> None:
    """In the parent: ask a child started by start_process to drain (see watch_parent's on_drain)."""
    try:
        proc._loom_death_writer.send_bytes(DRAIN)
    except (OSError, AttributeError):
        pass


def watch_parent(death_pipe: Connection, on_death=None, on_drain=None, remove_dirs: tuple = ()) -> None:
    """In a child: exit at once when the parent goes away, however it died (SIGKILL included),
    first removing `remove_dirs` (the parent's socket / metrics directories it can no longer
    remove itself). A DRAIN message from the parent calls `on_drain` (from this thread)."""
    def _watch():
        try:
            while True:
                if death_pipe.recv_bytes() == DRAIN and on_drain is not None:
                    on_drain()
        except (EOFError, OSError):
            pass
        for path in remove_dirs:
            if path:
                shutil.rmtree(path, ignore_errors=True)
        if on_death is not None:
            try:
                on_death()
            except Exception:
                pass
        os._exit(1)
    threading.Thread(target=_watch, name="parent-watch", daemon=True).start()


def child_signals() -> None:
    """Children leave Ctrl-C to the parent (it stops them in order); SIGTERM exits at once
    (SystemExit in the main thread: each process's entry point cleans up and tells its peers)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, _exit_on_sigterm)


def _exit_on_sigterm(signum, frame):
    raise SystemExit(0)


def stop_processes(procs: list[BaseProcess], timeout: float = 5.0) -> None:
    """SIGTERM, wait, then SIGKILL what is left."""
    for p in procs:
        if p.is_alive():
            p.terminate()
    for p in procs:
        p.join(timeout)
        if p.is_alive():
            logger.warning("%s did not stop in %.0fs; killing it", p.name, timeout)
            p.kill()
            p.join(2)


def catch_stop_signals() -> threading.Event:
    """SIGINT and SIGTERM set the returned event: a parent's watch loop then stops its children
    in order, instead of dying in the middle of it."""
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda signum, frame: stop.set())
    return stop
