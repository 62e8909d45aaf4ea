"""Where the engine loop's time goes, per step (opt-in with LOOM_STEP_STATS=1, as the
workers' step stats): scheduling, sending the step, waiting for the oldest step's
tokens, taking them in (update_from_output), and publishing outputs to the clients.

With async scheduling, everything but the wait is host work that must fit in one
step's device time, or the GPU idles between steps; the workers' `idle_ms_before`
says whether it does. Logged when the engine shuts down.
"""
from __future__ import annotations

import contextlib
import logging
import time
from collections import defaultdict

from ipc.profiling import step_stats_enabled

logger = logging.getLogger(__name__)


_OFF = contextlib.nullcontext()


class LoopStats:
    def __init__(self):
        self.on = step_stats_enabled()
        self.seconds: dict[str, float] = defaultdict(float)
        self.calls: dict[str, int] = defaultdict(int)

    def phase(self, name: str):
        """A context that times `name` (several per step: off, it is a shared no-op)."""
        return self._timed(name) if self.on else _OFF

    @contextlib.contextmanager
    def _timed(self, name: str):
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self.seconds[name] += time.perf_counter() - t0
            self.calls[name] += 1

    def log(self) -> None:
        if self.on and self.calls:
            logger.warning("engine loop stats (ms per call, calls): %s", {
                k: (round(1e3 * self.seconds[k] / n, 3), n) for k, n in self.calls.items()})
