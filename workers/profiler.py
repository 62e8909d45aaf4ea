"""The torch profiler of one worker, driven by /start_profile and /stop_profile.

Created on the first start. Each stop writes a chrome trace (open it in https://ui.perfetto.dev)
through torch's tensorboard_trace_handler:

    <profiler_dir>/{prefix}_dp{D}_tp{T}_rank{R}.<timestamp>.pt.trace.json

A later start with no prefix keeps the name (so traces of one run sort together); a new
prefix renames the traces that follow.
"""
from __future__ import annotations

import logging
import os

import torch

logger = logging.getLogger(__name__)

DEFAULT_PREFIX = "loom"
recording = False   # a WorkerProfiler of this process is recording


def mark(name: str) -> None:
    """A zero-length named range in the trace being recorded (nothing when none is): the step
    phases' ends that StepStats marks (LOOM_STEP_STATS=1), so that a trace's GPU idle gaps can be
    read against what the host was doing then (python -m bench.trace_gaps)."""
    if recording:
        with torch.profiler.record_function(name):
            pass


class WorkerProfiler:
    def __init__(self, out_dir: str, device: torch.device, dp_rank: int, tp_rank: int, rank: int):
        self.out_dir = out_dir
        self.device = device
        self.ranks = (dp_rank, tp_rank, rank)
        self.prefix = DEFAULT_PREFIX
        self._prof: torch.profiler.profile | None = None

    @property
    def trace_name(self) -> str:
        dp, tp, rank = self.ranks
        return f"{self.prefix}_dp{dp}_tp{tp}_rank{rank}"

    def start(self, prefix: str | None = None) -> str:
        if self._prof is not None:
            raise ValueError("the profiler is already running: stop it first")
        if prefix:
            if os.sep in prefix or prefix in (".", ".."):
                raise ValueError(f"profile_prefix must be a plain file name, got {prefix!r}")
            self.prefix = prefix
        activities = [torch.profiler.ProfilerActivity.CPU]
        if self.device.type == "cuda":
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        os.makedirs(self.out_dir, exist_ok=True)
        self._prof = torch.profiler.profile(
            activities=activities,
            on_trace_ready=torch.profiler.tensorboard_trace_handler(self.out_dir, worker_name=self.trace_name))
        self._prof.start()
        global recording
        recording = True
        logger.info("profiler started: traces go to %s/%s.*", self.out_dir, self.trace_name)
        return self.trace_name

    def stop(self) -> str:
        if self._prof is None:
            raise ValueError("the profiler is not running: start it first")
        prof, self._prof = self._prof, None
        global recording
        recording = False
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        prof.stop()   # writes the trace (on_trace_ready)
        logger.info("profiler stopped: trace written to %s/%s.*", self.out_dir, self.trace_name)
        return self.trace_name
