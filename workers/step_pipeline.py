"""StepPipeline: the order in which a worker launches, samples and finishes its steps (the
worker loop's, workers/worker.py serve_steps, and the in-process executor's).

A step is launched on the device as soon as it arrives, behind the one still running there,
so the device never waits for the loop; then the pending step's tokens are taken and sent
(the engine needs them for the next bitmask). A step with defer_sample runs its model and
samples when its grammar bitmask comes (sample()).

A step that arrives while one waits for its bitmask takes that one's tokens as inputs: it is
held, and launched as soon as the sample is queued. The engine sends it before the bitmask,
so that meanwhile its host inputs are built (ModelRunner.prepare_host): the device, which
runs the sample, then waits only for the staging, not for the ~1 ms of host work of a
256-row step (the JSON-constrained workload's steps had that gap every step).
"""
from __future__ import annotations

from collections import deque
from typing import TYPE_CHECKING, Callable

from ipc.messages import GrammarOutput, ModelRunnerOutput, SchedulerOutput

if TYPE_CHECKING:
    from workers.model_runner import ModelRunner, PendingStep
    from workers.step_inputs import HostStep


class StepPipeline:
    def __init__(self, runner: ModelRunner, emit: Callable[[ModelRunnerOutput], None]):
        self.runner = runner
        self.emit = emit   # where a finished step's output goes (the engine; only rank 0's is sent)
        self.pending: PendingStep | None = None     # launched, its tokens not yet taken
        self.unsampled: PendingStep | None = None   # launched, waiting for its grammar bitmask
        # arrived while a step waited for its bitmask: launched after its sample (host inputs built, if allowed)
        self.held: deque[tuple[SchedulerOutput, HostStep | None]] = deque()

    def step(self, so: SchedulerOutput) -> None:
        if self.unsampled is None:
            self._launch(so, None)
            return
        ahead = None
        if not self.held and self.runner.can_prepare_ahead(self.unsampled, so):
            ahead = self.runner.prepare_ahead(so)
        self.held.append((so, ahead))

    def sample(self, grammar: GrammarOutput | None) -> None:
        self.runner.sample_deferred(self.unsampled, grammar)
        self.pending, self.unsampled = self.unsampled, None
        while self.held and self.unsampled is None:
            self._launch(*self.held.popleft())

    def finish_pending(self) -> None:
        step, self.pending = self.pending, None
        self.emit(self.runner.finish(step))

    def _launch(self, so: SchedulerOutput, host_step: HostStep | None) -> None:
        finished = None   # pending's output, when so's inputs need it: sent once so is launched
        if self.pending is not None and self.runner.must_finish_before(self.pending, so):
            # (a verify step's next under LOOM_SPEC_ASYNC: the device idles from pending's end to
            # so's launch, so the reply and the engine's and API server's work it wakes wait until
            # the device has so)
            finished, self.pending = self.runner.finish(self.pending), None
        step = self.runner.launch(so, self.pending, host_step)   # queued on the device behind `pending`
        if finished is not None:
            self.emit(finished)
        if self.pending is not None:
            self.finish_pending()   # the engine needs these tokens for the next bitmask
        if so.defer_sample:
            self.unsampled = step
        else:
            self.pending = step
