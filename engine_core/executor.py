"""Executor: the engine core's side of the workers.

Starts one worker process per device, broadcasts each step through the
shared-memory ring, and collects replies. A worker that dies or reports an
error raises WorkerError within ~0.1 s, whatever the engine is waiting for.
"""
from __future__ import annotations

import itertools
import logging
import time
from typing import Any

import zmq
from multiprocessing.connection import wait as wait_sentinels

from ipc.config import EngineConfig
from ipc.messages import GrammarOutput, ModelRunnerOutput, MsgType, SchedulerOutput, WorkerCall, WorkerReply
from ipc.procs import start_process, stop_processes
from ipc.serial import Decoder, Encoder
from ipc.sockets import ipc_address, make_socket

logger = logging.getLogger(__name__)
_POLL_MS = 100


class WorkerError(RuntimeError):
    pass


class PendingOutput:
    """The output of a step sent to the workers. Steps answer in the order they were sent,
    so results must be taken in that order (the engine core's in-flight queue keeps it)."""

    def __init__(self, executor: "Executor"):
        self._executor = executor

    def result(self) -> ModelRunnerOutput:
        return self._executor.collect()


class Executor:
    def __init__(self, config: EngineConfig, ipc_dir: str, startup_timeout: float = 900.0):
        from shm.broadcast_ring import BroadcastRing
        from workers.worker import run_worker
        self.world_size = config.tensor_parallel_size
        self.ctx = zmq.Context()
        self.enc = Encoder()
        self.dec = Decoder(WorkerReply)
        self._call_ids = itertools.count(1)
        self.ring = BroadcastRing.create(self.world_size, ipc_dir)
        self.rendezvous, self._store = self._serve_rendezvous(config)
        self.replies = []
        self.procs = []
        for rank in range(self.world_size):
            addr = ipc_address(ipc_dir, f"worker-reply-{rank}")
            self.replies.append(make_socket(self.ctx, zmq.PULL, addr, bind=True))
            self.procs.append(start_process(run_worker, f"loom-worker-{rank}",
                                            (rank, rank, config.to_dict(), self.ring.handle(), addr,
                                             self.rendezvous)))
        self.poller = zmq.Poller()
        for sock in self.replies:
            self.poller.register(sock, zmq.POLLIN)
        self.ring.wait_until_ready(timeout=startup_timeout)
        deadline = time.monotonic() + startup_timeout
        ready: set[int] = set()
        while len(ready) < self.world_size:  # "ready" from each rank once its model is loaded, any order
            ready.add(self._recv_step(None, deadline).rank)

    @staticmethod
    def _serve_rendezvous(config: EngineConfig):
        """The engine core picks where the ranks meet: a TCPStore it serves itself, on a free
        port of 127.0.0.1 for one node (bound, so nothing can take it before the ranks come)."""
        if config.tensor_parallel_size == 1:
            return None, None
        from workers.distributed import Rendezvous, serve_rendezvous
        store = serve_rendezvous("127.0.0.1", 0)
        return Rendezvous("127.0.0.1", store.port, config.tensor_parallel_size), store

    # ------------------------------------------------------------ liveness

    def dead_worker(self) -> str | None:
        for p in self.procs:
            if not p.is_alive():
                return f"{p.name} (pid {p.pid}) died with exit code {p.exitcode}"
        return None

    def _check_alive(self) -> None:
        dead = self.dead_worker()
        if dead:
            raise WorkerError(dead)

    def sentinels(self) -> list[int]:
        return [p.sentinel for p in self.procs]

    # ------------------------------------------------------------ calls

    def _recv_any(self, deadline: float | None = None) -> WorkerReply:
        """The next reply of any worker, checking every 0.1 s that all of them live."""
        while True:
            for sock, _ in self.poller.poll(_POLL_MS):
                return self.dec.decode(sock.recv_multipart(copy=False))
            self._check_alive()
            if deadline is not None and time.monotonic() > deadline:
                raise TimeoutError("no reply from the workers in time")

    def _recv_step(self, rank: int | None, deadline: float | None = None) -> WorkerReply:
        """The next step-level reply of `rank` (None: of any rank). A step error of any rank is
        fatal; stale call replies are dropped."""
        while True:
            reply = self._recv_any(deadline)
            if reply.call_id:
                continue  # the late answer of a call that timed out
            if reply.error is not None:
                raise WorkerError(f"worker {reply.rank}: {reply.error}")
            if rank is None or reply.rank == rank:
                return reply

    def submit(self, so: SchedulerOutput) -> PendingOutput:
        """Send a step; its output comes from the returned handle (or collect()), in order."""
        self.ring.enqueue(self.enc.encode(MsgType.WORKER_STEP.value, so))
        return PendingOutput(self)

    def sample(self, grammar: GrammarOutput) -> None:
        """Let the oldest step sent with defer_sample sample, with this bitmask."""
        self.ring.enqueue(self.enc.encode(MsgType.WORKER_SAMPLE.value, grammar))

    def collect(self) -> ModelRunnerOutput:
        return self._recv_step(0).output

    def collective_rpc(self, method: str, args: list | tuple = (), kwargs: dict | None = None,
                       timeout: float | None = None) -> list[Any]:
        """Run a method on every worker; their results by rank. A method that fails on any
        worker raises RuntimeError once every worker has answered."""
        call_id = next(self._call_ids)
        self.ring.enqueue(self.enc.encode(MsgType.WORKER_CALL.value,
                                          WorkerCall(method, list(args), kwargs or {}, call_id)))
        results: dict[int, Any] = {}
        errors: list[str] = []
        deadline = None if timeout is None else time.monotonic() + timeout
        while len(results) < self.world_size:
            reply = self._recv_any(deadline)
            if reply.call_id != call_id:
                if reply.call_id == 0 and reply.error is not None:
                    raise WorkerError(f"worker {reply.rank}: {reply.error}")
                continue
            results[reply.rank] = reply.result
            if reply.error is not None:
                errors.append(f"worker {reply.rank}: {reply.error}")
        if errors:
            raise RuntimeError("; ".join(errors))
        return [results[r] for r in range(self.world_size)]

    def shutdown(self) -> None:
        try:
            if all(p.is_alive() for p in self.procs):
                self.ring.enqueue(self.enc.encode(MsgType.WORKER_CALL.value, WorkerCall("shutdown")))
                wait_sentinels(self.sentinels(), timeout=5)
        except Exception:
            pass
        stop_processes(self.procs)
        self.ring.close()
        for sock in self.replies:
            sock.close()
        self.ctx.term()
