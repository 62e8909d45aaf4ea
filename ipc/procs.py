"""Child processes: spawn, death pipes, and teardown.

Every parent watches its children's sentinels; every child watches its parent
through a death pipe (EOF when the parent is gone, however it died) and exits.
"""
from __future__ import annotations

import faulthandler
import gc
import logging
import multiprocessing as mp
import contextlib
import os
import shutil
import sys
import signal
import threading
import time
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess

from ipc import envs

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
STOP = b"stop"     # parent -> child on the death pipe: exit now (stop_processes: the end of a stop)

# `loom serve`'s (or a headless node's) pid, for its children: a SIGTERM one of them gets while
# its parent lives is passed there, and that process coordinates the stop (the drain first).
SERVE_PID_ENV = "LOOM_SERVE_PID"

_stop_requested = threading.Event()   # in a child: its parent sent STOP
_parent_pid: int | None = None        # in a child: the parent it started under (child_signals)
_exiting = False


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
    _tell(proc, DRAIN)


def _tell(proc: BaseProcess, message: bytes) -> None:
    try:
        proc._loom_death_writer.send_bytes(message)
    except (OSError, AttributeError):
        pass


def coordinate_stops_here() -> None:
    """In `loom serve` (or a headless node): the SIGTERMs its children get are passed here."""
    os.environ[SERVE_PID_ENV] = str(os.getpid())


def watch_parent(death_pipe: Connection, on_death=None, on_drain=None, remove_dirs: tuple = ()) -> None:
    """In a child: exit at once when the parent goes away, however it died (SIGKILL included),
    first removing `remove_dirs` (the parent's socket / metrics directories it can no longer
    remove itself). A DRAIN message from the parent calls `on_drain` (from this thread)."""
    def _watch():
        try:
            while True:
                message = death_pipe.recv_bytes()
                if message == DRAIN and on_drain is not None:
                    on_drain()
                elif message == STOP:   # the parent's SIGTERM may have come first and been passed on
                    _stop_requested.set()
                    signal.pthread_kill(threading.main_thread().ident, signal.SIGTERM)
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
    """Children leave Ctrl-C and SIGTERM to the parent, which stops them in order: a SIGTERM sent
    to the whole process group (systemd's KillMode=control-group, `kill -TERM -- -PGID`) must
    not cut the streams that `loom serve`'s drain is finishing. While the parent lives, a
    SIGTERM is passed to `loom serve` (SERVE_PID_ENV; it drains, then stops everyone); it exits
    (SystemExit in the main thread: the entry point cleans up and tells its peers) once the
    parent said STOP, or at once when the parent is gone."""
    global _parent_pid
    _parent_pid = os.getppid()
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, _on_sigterm)
    dump_stacks_on_sigusr1()


def dump_stacks_on_sigusr1() -> None:
    """`kill -USR1 PID` prints every thread's Python stack to stderr (faulthandler: also while
    the main thread is blocked): how a hung stop is diagnosed, by an operator or a test."""
    faulthandler.register(signal.SIGUSR1, all_threads=True)


def sigterm_exits() -> bool:
    """In a child, on SIGTERM: True to exit now (the parent said STOP, or the child is orphaned);
    else the signal is passed to the process that coordinates the stop, and False."""
    if _stop_requested.is_set() or os.getppid() != _parent_pid:
        return True
    serve_pid = envs.LOOM_SERVE_PID
    if serve_pid and serve_pid != os.getpid():
        try:
            os.kill(serve_pid, signal.SIGTERM)
        except (ProcessLookupError, PermissionError):
            return True   # no one to coordinate the stop
    return False


def stop_requested() -> bool:
    """In a child: whether its parent sent STOP (the end of an orderly stop)."""
    return _stop_requested.is_set()


def _on_sigterm(signum, frame):
    global _exiting
    if not _exiting and sigterm_exits():
        _exiting = True   # once: a second SIGTERM must not cut the cleanup short
        raise SystemExit(0)


STOP_GRACE_S = 0.5   # for a child to read STOP before the SIGTERM that follows it


def stop_processes(procs: list[BaseProcess], timeout: float = 5.0) -> None:
    """STOP, then SIGTERM for a child still there after STOP_GRACE_S (one that does not read its
    death pipe), wait, then SIGKILL what is left. (A SIGTERM sent with the STOP could reach a
    child before it read the STOP; the child then passed it on to `loom serve` as an operator's
    stop, and a `loom serve -tp 2` whose rank had died exited 0, not 1.)"""
    alive = [p for p in procs if p.is_alive()]
    for p in alive:
        _tell(p, STOP)
    grace_end = time.monotonic() + STOP_GRACE_S
    for p in alive:
        p.join(max(0.0, grace_end - time.monotonic()))
    for p in alive:
        if p.is_alive():
            p.terminate()
    for p in procs:
        p.join(timeout)
        if p.is_alive():
            logger.warning("%s did not stop in %.0fs; killing it", p.name, timeout)
            p.kill()
            p.join(2)


class StopFlag:
    """Set by SIGINT / SIGTERM, polled by a parent's watch loop. A plain attribute, not a
    threading.Event: Event.set() takes a lock, and a second signal whose handler runs while the
    first handler's set() holds it waits for that lock forever, in the main thread. Stops bring
    signals in bursts (each child passes its SIGTERM to `loom serve`), and that deadlock left
    `loom serve` running after its children had stopped (measured: 1 process in 5 hung under a
    burst of 20,000 SIGTERMs with an Event; the CI flakes of test_control_http and test_signals)."""

    def __init__(self):
        self._set = False

    def set(self) -> None:
        self._set = True

    def is_set(self) -> bool:
        return self._set


def catch_stop_signals() -> StopFlag:
    """SIGINT and SIGTERM set the returned flag: a parent's watch loop then stops its children
    in order, instead of dying in the middle of it."""
    stop = StopFlag()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda signum, frame: stop.set())
    dump_stacks_on_sigusr1()
    return stop
