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


@contextlib.contextmanager
def maybe_profile(name: str):
    out_dir = os.environ.get("LOOM_PROFILE_DIR")
    if not out_dir:
        yield
        return
    prof = cProfile.Profile()
    prof.enable()
    try:
        yield
    finally:
        prof.disable()
        os.makedirs(out_dir, exist_ok=True)
        prof.dump_stats(os.path.join(out_dir, f"{name}.prof"))


if __name__ == "__main__":
    for fn in sorted(os.listdir(sys.argv[1])):
        if fn.endswith(".prof"):
            print(f"===== {fn}")
            pstats.Stats(os.path.join(sys.argv[1], fn)).sort_stats("tottime").print_stats(int(sys.argv[2]) if len(sys.argv) > 2 else 25)
