"""Child processes: spawn, death pipes, and teardown.

Every parent watches its children's sentinels; every child watches its parent
through a death pipe (EOF when the parent is gone, however it died) and exits.
"""
from __future__ import annotations

import logging
import multiprocessing as mp
import contextlib
import os
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


def watch_parent(death_pipe: Connection, on_death=None) -> None:
    """In a child: exit at once when the parent goes away."""
    def _watch():
        try:
            death_pipe.recv()
        except (EOFError, OSError):
            pass
        if on_death is not None:
            try:
                on_death()
            except Exception:
                pass
        os._exit(1)
    threading.Thread(target=_watch, name="parent-watch", daemon=True).start()


def child_signals() -> None:
    """Children leave Ctrl-C to the parent (it stops them in order); SIGTERM exits cleanly."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, lambda *_: (_ for _ in ()).throw(SystemExit(0)))


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
