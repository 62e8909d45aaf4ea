"""UniprocExecutor: one worker built in this process and called directly.

No ring, no sockets, no child process: a breakpoint in the model runner is hit from
the caller's thread (`LLM(..., multiprocess=False)`). It keeps the worker loop's order
(workers/step_pipeline.py, as serve_steps): a step is launched behind the one still pending,
whose tokens are then taken, so async scheduling keeps two steps in flight as in the process
mode and the tokens are the same.

What a worker sets for its whole process is set in the caller's: torch's thread count (given
back at shutdown), and which kernels the model layers run (workers/models/layers.py
use_kernels: Triton or the torch references), chosen again by each engine as it starts, so
engines one after the other each run their own; two in-process engines alive at once with
different attention backends would share the later one's.

Each message goes through the wire's codec (ipc/serial.py) as it would through the
ring: the worker then holds no reference into the scheduler's objects (which change
after a step is sent), and the engine gets the types a worker process would send.
"""
from __future__ import annotations

import gc
from collections import deque
from typing import Any

from engine_core.executor import Executor, PendingOutput
from ipc.config import EngineConfig
from ipc.messages import GrammarOutput, ModelRunnerOutput, MsgType, SchedulerOutput, WorkerCall, WorkerReply
from ipc.serial import Decoder, Encoder
from workers.step_pipeline import StepPipeline


class UniprocExecutor(Executor):
    def __init__(self, config: EngineConfig, ipc_dir: str | None = None):
        import torch
        from workers.worker import Worker
        if config.tensor_parallel_size != 1:
            raise ValueError("the in-process executor runs one worker: tensor_parallel_size must be 1")
        self._caller_threads = torch.get_num_threads()   # a CPU worker sets its own; given back at shutdown
        self.worker = Worker(config, rank=0)
        self.runner = self.worker.runner
        self._enc = Encoder()
        self._step_dec, self._sample_dec = Decoder(SchedulerOutput), Decoder(GrammarOutput)
        self._call_dec, self._reply_dec = Decoder(WorkerCall), Decoder(WorkerReply)
        self._outputs: deque[ModelRunnerOutput] = deque()   # taken, not yet collected (oldest first)
        self.steps = StepPipeline(self.runner, self._outputs.append)

    def _wire(self, kind: MsgType, msg: Any, dec: Decoder) -> Any:
        return dec.decode(self._enc.encode(kind.value, msg))

    def submit(self, so: SchedulerOutput) -> PendingOutput:
        self.steps.step(self._wire(MsgType.WORKER_STEP, so, self._step_dec))
        return PendingOutput(self)

    def sample(self, grammar: GrammarOutput) -> None:
        self.steps.sample(self._wire(MsgType.WORKER_SAMPLE, grammar, self._sample_dec))

    def collect(self) -> ModelRunnerOutput:
        if not self._outputs:
            self.steps.finish_pending()
        return self._outputs.popleft()

    def collective_rpc(self, method: str, args: list | tuple = (), kwargs: dict | None = None,
                       timeout: float | None = None) -> list[Any]:
        """The worker's method, called here (timeout: not applicable, the call runs in this
        thread). A failure reads as a worker process's would."""
        if self.steps.pending is not None:   # a worker answers calls between steps
            self.steps.finish_pending()
        call = self._wire(MsgType.WORKER_CALL, WorkerCall(method, list(args), kwargs or {}, 1), self._call_dec)
        try:
            reply = WorkerReply(0, result=self.worker.call(call), call_id=call.call_id)
        except Exception as e:   # noqa: BLE001  (as serve_steps: a failed call is the caller's problem)
            raise RuntimeError(f"worker 0: {type(e).__name__}: {e}") from e
        return [self._wire(MsgType.WORKER_REPLY, reply, self._reply_dec).result]

    def shutdown(self) -> None:
        import torch
        if self.runner.stats is not None:
            self.runner.stats.log()
        # the model and its KV cache go with the last references to them
        self.worker = self.runner = self.steps = None
        self._outputs.clear()
        # the model's modules, its graphs and the KV cache hold reference cycles: collect them now, and
        # give their blocks back to the device, so that the next engine in this process (a notebook's,
        # a test's) profiles free memory rather than this one's leftovers
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        torch.set_num_threads(self._caller_threads)
