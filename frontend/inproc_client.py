"""InprocClient: the engine core and its one worker in the caller's process.

The surface the offline LLM uses of EngineCoreClient (add_request, abort, get_outputs,
call_utility), over an EngineCore stepped in the caller's thread: no sockets, no threads,
no child processes. `LLM(model, multiprocess=False)` or LOOM_ENABLE_MULTIPROCESSING=0
selects it (vLLM's VLLM_ENABLE_V1_MULTIPROCESSING=0), so that a breakpoint in the
scheduler or the model runner is hit from `llm.generate(...)`. The scheduler, the runner
and the utility dispatch are the process mode's; the one difference is that the engine
steps only while the caller waits for outputs or a utility reply.

Requests and outputs go through the wire's codec (ipc/serial.py), as over the sockets: the
engine holds no reference into the caller's objects, and the caller gets the types a
process would send.
"""
from __future__ import annotations

import contextlib
import itertools
import time
from typing import Any

from engine_core.core import DEFERRED_POLL_S, EngineCore
from engine_core.uniproc_executor import UniprocExecutor
from frontend.engine_client import EngineDeadError
from ipc.config import EngineConfig
from ipc.messages import (EngineCoreOutputs, EngineCoreRequest, EngineLoad, EngineReady, MsgType, UtilityOutput,
                          UtilityRequest)
from ipc.serial import Decoder, Encoder

_IDLE_S = 0.001   # between turns while only a grammar compile (on its thread) can make progress


class InprocClient:
    """A blocking client of an EngineCore in this process (one engine, client index 0)."""

    client_index = 0
    engine_indices = [0]
    dead_reason: str | None = None   # set by an exception out of a step: the engine's state is then unknown

    def __init__(self, config: EngineConfig):
        if config.tensor_parallel_size != 1 or config.data_parallel_size != 1:
            raise ValueError("the in-process mode runs one engine with one worker: tensor_parallel_size and "
                             "data_parallel_size must be 1 (use multiprocess=True)")
        self.engine = EngineCore(config, None, executor_class=UniprocExecutor)
        self.ready = EngineReady(config.max_model_len, self.engine.num_gpu_blocks, config.block_size, 0,
                                 config.model_name, scheduling_policy=config.scheduling_policy)
        self._enc = Encoder()
        self._req_dec, self._out_dec = Decoder(EngineCoreRequest), Decoder(EngineCoreOutputs)
        self._util_dec = Decoder(UtilityRequest)
        self._call_ids = itertools.count(1)
        self._pending: list[EngineCoreOutputs] = []   # outputs made while waiting for a utility reply
        self._published = (0, (0, False), (0, 0))     # the engine's (step, control, load) last reported
        self._num_added = 0

    def wait_ready(self, timeout: float | None = None) -> EngineReady:
        return self.ready

    @property
    def is_dead(self) -> bool:
        return self.dead_reason is not None

    @contextlib.contextmanager
    def _stepping(self):
        """Around the engine's own work. What a step raises (a worker error, Ctrl-C in the middle of
        it) ends the engine, as it ends the engine-core process: later calls raise EngineDeadError."""
        if self.dead_reason:
            raise EngineDeadError(self.dead_reason)
        try:
            yield
        except BaseException as e:
            self.dead_reason = f"the in-process engine failed: {type(e).__name__}: {e}"
            raise

    # ------------------------------------------------------------ requests

    def add_request(self, req: EngineCoreRequest, engine: int | None = None) -> None:
        if self.dead_reason:
            raise EngineDeadError(self.dead_reason)
        req.client_index = self.client_index
        self._num_added += 1
        error = self.engine.add_request(self._req_dec.decode(self._enc.encode(MsgType.ADD.value, req)))
        if error is not None:
            self.engine.pending_outputs.setdefault(self.client_index, []).append(error)

    def abort(self, request_ids: list[str], engine: int | None = None) -> None:
        if self.is_dead:
            return
        reqs = self.engine.scheduler.requests
        self.engine.abort_requests([rid for rid in request_ids if rid in reqs])

    def get_outputs(self, timeout: float | None = None) -> EngineCoreOutputs | None:
        """Step the engine until it has something to say; None after `timeout` seconds without."""
        if self._pending:
            return self._pending.pop(0)
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            outs = self._turn()
            if outs is not None:
                return outs
            if deadline is not None and time.monotonic() >= deadline:
                return None
            self._check_progress(deadline)
            time.sleep(_IDLE_S)

    def _turn(self) -> EngineCoreOutputs | None:
        """One turn of the engine's loop (EngineCoreProc.run_busy_loop, without the sockets): a step
        and its outputs, with the stats, timings and load, as _publish reports them to one client."""
        engine = self.engine
        with self._stepping():
            outputs = engine.step_with_pending().get(self.client_index, [])
            engine._finish_deferred()
        sched = engine.scheduler
        state = (sched.step_id, (engine.control.sleep_level, engine.is_paused()),
                 (len(sched.waiting), len(sched.running)))
        if not outputs and state == self._published and not sched.has_timings():
            return None
        self._published = state
        stats = sched.make_stats()
        stats.sleep_level, stats.is_paused = state[1]
        outs = EngineCoreOutputs(outputs, 0, time.time(), stats, None, [t for _, t in sched.take_timings()],
                                 EngineLoad(*state[2], self._num_added))
        return self._out_dec.decode(self._enc.encode(MsgType.OUTPUTS.value, outs))

    def _check_progress(self, deadline: float | None) -> None:
        """Waiting for ever on an engine that cannot step (paused, asleep) would hang this process,
        the only one that could resume it: an error instead (with a timeout, the caller's wait)."""
        engine = self.engine
        if deadline is None and not engine.has_work() and not engine._deferred \
                and not (engine.control.can_step and engine.control.admits_new and engine.scheduler.requests):
            raise RuntimeError("the in-process engine has nothing it can run (paused or asleep, or no "
                               "request): resume or wake it up first")

    # ------------------------------------------------------------ utility calls

    def call_utility(self, method: str, *args, timeout: float | None = None, engine: int | None = None) -> Any:
        """Run an engine utility method through the engine core's own dispatch; its result.
        The engine first takes one turn, as a running engine steps between a client's calls (a
        caller polling debug_info() sees its requests move). A deferred reply (pause in wait
        mode) keeps the engine stepping until it is ready."""
        self._pend(self._turn())
        call_id = next(self._call_ids)
        req = UtilityRequest(self.client_index, call_id, method, list(args))
        req = self._util_dec.decode(self._enc.encode(MsgType.UTILITY.value, req))
        with self._stepping():   # (it first takes the steps in flight)
            self.engine._run_utility(req)
        deadline = None if timeout is None else time.monotonic() + timeout
        while (reply := self._take_reply(call_id)) is None:
            if deadline is not None and time.monotonic() >= deadline:
                raise TimeoutError(f"utility call {method} timed out")
            if not self._pend(self._turn()):
                time.sleep(min(DEFERRED_POLL_S, _IDLE_S * 10))
        if reply.failure:
            raise RuntimeError(reply.failure)
        return self._out_dec.decode(self._enc.encode(MsgType.OUTPUTS.value, EngineCoreOutputs(
            utility_output=reply))).utility_output.result

    def _pend(self, outs: EngineCoreOutputs | None) -> bool:
        """Keep outputs made during a utility call for get_outputs."""
        if outs is not None:
            self._pending.append(outs)
        return outs is not None

    def call_utility_all(self, method: str, *args, timeout: float | None = None) -> list[Any]:
        return [self.call_utility(method, *args, timeout=timeout)]

    def _take_reply(self, call_id: int) -> UtilityOutput | None:
        replies = self.engine.utility_outputs
        for i, out in enumerate(replies):
            if out.call_id == call_id:
                return replies.pop(i)
        return None

    def close(self) -> None:
        engine, self.engine = self.engine, None
        if engine is not None:
            engine.shutdown()
