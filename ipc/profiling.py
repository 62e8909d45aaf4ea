"""Opt-in CPU profiles of the engine, worker and API-server processes: set LOOM_PROFILE_DIR.

Each process writes <dir>/<name>.prof (cProfile) when it exits normally; read
them with `python -m pstats` or `python -m ipc.profiling DIR`.
"""
from __future__ import annotations

import contextlib
import cProfile
import os
import pstats
import sys

from ipc import envs


_active: list = []   # (profile, path) of this process's profile while it runs


@contextlib.contextmanager
def maybe_profile(name: str):
    out_dir = envs.LOOM_PROFILE_DIR
    if not out_dir:
        yield
        return
    prof = cProfile.Profile()
    _active[:] = [(prof, os.path.join(out_dir, f"{name}.prof"))]
    prof.enable()
    try:
        yield
    finally:
        dump()


def dump() -> None:
    """Write the running profile now: for a process about to leave by os._exit (the API servers)."""
    if not _active:
        return
    prof, path = _active.pop()
    prof.disable()
    os.makedirs(os.path.dirname(path), exist_ok=True)
    prof.dump_stats(path)


def step_stats_mode() -> str:
    """LOOM_STEP_STATS, the one place it is read: "" (off), "sync" (on, and every host wait on
    the device warns) or "on". It switches the workers' per-step stats (workers/step_stats.py)
    and the engine loop's (engine_core/loop_stats.py)."""
    value = envs.LOOM_STEP_STATS
    return "" if value in ("", "0") else "sync" if value == "sync" else "on"


def step_stats_enabled() -> bool:
    return step_stats_mode() != ""


if __name__ == "__main__":
    for fn in sorted(os.listdir(sys.argv[1])):
        if fn.endswith(".prof"):
            print(f"===== {fn}")
            pstats.Stats(os.path.join(sys.argv[1], fn)).sort_stats("tottime").print_stats(int(sys.argv[2]) if len(sys.argv) > 2 else 25)
