"""Where a worker's step time goes: opt-in with LOOM_STEP_STATS=1.

Per kind of step (decode CUDA graph, one with cascade attention, piecewise CUDA graphs, or
eager; a verify step of speculative decoding apart), it sums the host time spent launching a
step (split into the phases the caller marks), the host time spent finishing it (its tokens
recorded, the next drafts proposed: host work between the device's end of a step and the next
launch when steps do not overlap), the device time between two events around it, and the
device's idle time before it (from the previous step's end: the step was launched too late),
and it counts the Triton kernels compiled after warm-up (a compile mid-run costs 0.1-1 s). A
step's start event is recorded where it first queues device work (device_start: after the host
has built its inputs), so that host time spent preparing a step while the device waits counts
as idle, not as the step's device time. Device and idle time are also summed by the step's
token count (powers of two):
a small batch's step can be shorter than the host's work between steps.
The summary is logged when the worker exits and returned by the `step_stats`
worker method (collective_rpc).
"""
from __future__ import annotations

import logging
import time
from collections import defaultdict, deque
from dataclasses import dataclass, field

import torch

from ipc.profiling import step_stats_mode
from workers.compile_ahead import mid_run_compiles
from workers import profiler

logger = logging.getLogger(__name__)


@dataclass
class StepToken:
    """One step being launched: when it began, its start event, and the phases marked so far."""
    t0: float
    start: object
    laps: list[tuple[str, float]] = field(default_factory=list)
    # marks of work launched inside this step before its own device work (its encoder): read
    # with it, first, so that marks stay in launch order (an encoder's mark read at once came
    # before the previous step's, and its idle then held that whole step's device time)
    inner: list[StepMark] = field(default_factory=list)


@dataclass(slots=True)
class StepMark:
    """A launched step's record (end() makes it, finished() reads it): its device time is
    read from its events once they fire (start None: not on a GPU)."""
    kind: str
    start: object
    stop: object
    num_tokens: int
    inner: list[StepMark]


class StepStats:
    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.host_s: dict[str, float] = defaultdict(float)
        self.finish_s: dict[str, float] = defaultdict(float)   # kind -> host s in ModelRunner.finish
        self.phase_s: dict[str, dict[str, float]] = defaultdict(lambda: defaultdict(float))  # kind -> phase -> s
        self.device_s: dict[str, float] = defaultdict(float)
        self.steps: dict[str, int] = defaultdict(int)
        self.tokens: dict[str, int] = defaultdict(int)
        self.idle_s: dict[str, float] = defaultdict(float)
        # by kind and token count (rounded up to a power of two): [steps, device s, idle s before]
        self.by_tokens: dict[tuple[str, int], list[float]] = defaultdict(lambda: [0, 0.0, 0.0])
        self._last_stop = None  # the end event of the newest step read
        self.serving = False
        self._unread: deque[StepMark] = deque()  # marks whose events may not have fired yet, in launch order

    def start_serving(self) -> None:
        """From now on (the worker's warm-up and graph capture are done): with
        LOOM_STEP_STATS=sync, every call that makes the host wait for the device warns
        (torch.cuda.set_sync_debug_mode), naming its line. (A Triton compile while serving is a
        warm-up miss: workers/compile_ahead.py logs and counts them.)"""
        self.serving = True
        if self.cuda and step_stats_mode() == "sync":
            torch.cuda.set_sync_debug_mode("warn")

    def begin(self):
        """Call before launching a step; returns the token for end()."""
        profiler.mark("loom.begin")
        start = torch.cuda.Event(enable_timing=True) if self.cuda else None
        if start is not None:
            start.record()
        return StepToken(time.perf_counter(), start)

    def device_start(self, token: StepToken) -> None:
        """The step's first device work is queued next: its device time starts here."""
        if token.start is not None:
            token.start = torch.cuda.Event(enable_timing=True)
            token.start.record()

    @staticmethod
    def lap(token: StepToken, phase: str) -> None:
        """The host time since begin() or the previous lap was `phase`'s."""
        token.laps.append((phase, time.perf_counter()))
        profiler.mark(f"loom.{phase}")

    def end(self, token: StepToken, kind: str, num_tokens: int) -> StepMark:
        """Call after the step's last kernel is queued; returns what finished() takes."""
        profiler.mark(f"loom.end.{kind}")
        start, t0 = token.start, token.t0
        self.host_s[kind] += time.perf_counter() - t0
        for phase, t in token.laps:
            self.phase_s[kind][phase] += t - t0
            t0 = t
        self.steps[kind] += 1
        self.tokens[kind] += num_tokens
        stop = None
        if start is not None:
            stop = torch.cuda.Event(enable_timing=True)
            stop.record()
        return StepMark(kind, start, stop, num_tokens, token.inner)

    def finished(self, mark: StepMark | None, wait: bool = False, host_s: float = 0.0) -> None:
        """Call when the step is delivered (host_s: the host time its finishing took); device
        times are read, in launch order, once their events fire."""
        if mark is not None and host_s:
            self.finish_s[mark.kind] += host_s
        if mark is not None:
            self._unread.extend(m for m in mark.inner if m.start is not None)
            if mark.start is not None:
                self._unread.append(mark)
        while self._unread and (wait or self._unread[0].stop.query()):
            m = self._unread.popleft()
            kind, start, stop, num_tokens = m.kind, m.start, m.stop, m.num_tokens
            device = start.elapsed_time(stop) / 1e3
            self.device_s[kind] += device
            bucket = self.by_tokens[kind, 1 << max(num_tokens - 1, 0).bit_length()]
            bucket[0] += 1
            bucket[1] += device
            if self._last_stop is not None:
                idle = max(self._last_stop.elapsed_time(start), 0.0) / 1e3
                self.idle_s[kind] += idle
                bucket[2] += idle
            self._last_stop = stop

    def summary(self) -> dict:
        self.finished(None, wait=True)
        return {kind: {"steps": n, "tokens": self.tokens[kind],
                       "host_ms_per_step": 1e3 * self.host_s[kind] / n,
                       "device_ms_per_step": 1e3 * self.device_s[kind] / n,
                       "idle_ms_before": 1e3 * self.idle_s[kind] / n,
                       **{f"host_ms_{p}": 1e3 * t / n for p, t in self.phase_s[kind].items()},
                       **({"host_ms_finish": 1e3 * self.finish_s[kind] / n} if kind in self.finish_s else {})}
                for kind, n in self.steps.items()} | {
            "by_tokens": {f"{kind} <={b}": {"steps": n, "device_ms": round(1e3 * d, 1), "idle_ms": round(1e3 * i, 1)}
                          for (kind, b), (n, d, i) in sorted(self.by_tokens.items())},
            "triton_compiles_while_serving": mid_run_compiles(),
            # a retry frees every cached block (cudaFree: a device sync) before allocating again
            "allocator_retries": torch.cuda.memory_stats().get("num_alloc_retries", 0) if self.cuda else 0}

    def log(self) -> None:
        for kind, s in self.summary().items():
            logger.warning("step stats %s: %s", kind, s)
