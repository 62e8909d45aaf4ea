"""Where a process's start-up goes: named phases timed in order, logged as one line at debug level
(`loom serve --log-level debug`): imports, process starts, weight load, the profiling run, Triton
compiles in the warm-up, graph capture. Each process (launcher, engine core, worker) keeps its
own; together they are the breakdown of `loom serve` to healthy."""
from __future__ import annotations

import contextlib
import logging
import os
import time

_T0 = time.perf_counter()   # this module's import: the process's start where /proc cannot tell


def process_age() -> float:
    """Seconds since this process started (Linux: /proc, 10 ms ticks; elsewhere since this module's
    import)."""
    try:
        with open("/proc/self/stat") as f:
            start_ticks = int(f.read().rsplit(")", 1)[1].split()[19])
        with open("/proc/uptime") as f:
            uptime = float(f.read().split()[0])
        return max(0.0, uptime - start_ticks / os.sysconf("SC_CLK_TCK"))
    except (OSError, ValueError, IndexError):
        return time.perf_counter() - _T0


class StartupTimes:
    """Phases of one process's start-up, in the order they ran."""

    def __init__(self, who: str):
        self.who = who
        self.phases: list[tuple[str, float]] = []
        self.started = time.perf_counter()

    def mark(self, name: str, since: float) -> None:
        self.phases.append((name, time.perf_counter() - since))

    @contextlib.contextmanager
    def phase(self, name: str):
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self.mark(name, t0)

    def since_process_start(self, name: str) -> None:
        """A phase from this process's start until now (its interpreter and imports); the total
        then counts from the process's start."""
        age = process_age()
        self.phases.append((name, age))
        self.started = time.perf_counter() - age

    def log(self, logger: logging.Logger) -> str:
        parts = ", ".join(f"{name} {s:.2f} s" for name, s in self.phases)
        line = f"start-up of {self.who}: {parts}; {time.perf_counter() - self.started:.2f} s in all"
        logger.debug("%s", line)
        return line
