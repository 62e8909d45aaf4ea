"""Executor: the engine core's side of the workers.

One interface (Executor: submit / sample / collect, collective_rpc, shutdown), so the
engine core does not know which one runs:

- MultiprocExecutor starts one worker process per device, broadcasts each step through
  the shared-memory ring, and collects replies. A worker that dies or reports an error
  raises WorkerError within ~0.1 s, whatever the engine is waiting for.
- UniprocExecutor (engine_core/uniproc_executor.py) builds one worker in this process
  and calls it directly: `LLM(..., multiprocess=False)`, for debugging and fast tests.
"""
from __future__ import annotations

import abc
import itertools
import logging
import os
import socket
import time
from typing import Any

import zmq
from multiprocessing.connection import wait as wait_sentinels

from ipc import envs
from ipc.auth import HANDSHAKE_FAILED
from ipc.config import ConfigError, EngineConfig
from ipc.messages import GrammarOutput, ModelRunnerOutput, MsgType, SchedulerOutput, WorkerCall, WorkerReply
from ipc.procs import catch_stop_signals, coordinate_stops_here, start_process, stop_processes
from ipc.serial import Decoder, Encoder
from ipc.sockets import Rendezvous, bind_rendezvous, ipc_address, make_socket

logger = logging.getLogger(__name__)
_POLL_MS = 100
# what the reply socket of other nodes' workers reports (MultiprocExecutor._watch_remote)
REMOTE_WORKER_EVENTS = (zmq.EVENT_HANDSHAKE_SUCCEEDED | HANDSHAKE_FAILED | zmq.EVENT_DISCONNECTED
                        | zmq.EVENT_MONITOR_STOPPED)


class WorkerError(RuntimeError):
    pass


class PendingOutput:
    """The output of a step sent to the workers. Steps answer in the order they were sent,
    so results must be taken in that order (the engine core's in-flight queue keeps it)."""

    def __init__(self, executor: "Executor"):
        self._executor = executor

    def result(self) -> ModelRunnerOutput:
        return self._executor.collect()


class Executor(abc.ABC):
    """The engine core's handle on its workers. Steps are answered in the order sent."""

    @abc.abstractmethod
    def submit(self, so: SchedulerOutput) -> PendingOutput:
        """Send a step; its output comes from the returned handle (or collect()), in order."""

    @abc.abstractmethod
    def sample(self, grammar: GrammarOutput) -> None:
        """Let the oldest step sent with defer_sample sample, with this bitmask."""

    @abc.abstractmethod
    def collect(self) -> ModelRunnerOutput:
        """The output of the oldest step not yet collected."""

    @abc.abstractmethod
    def collective_rpc(self, method: str, args: list | tuple = (), kwargs: dict | None = None,
                       timeout: float | None = None) -> list[Any]:
        """Run a method on every worker; their results by rank. A method that fails on any
        worker raises RuntimeError."""

    @abc.abstractmethod
    def shutdown(self) -> None:
        ...


class MultiprocExecutor(Executor):
    """One worker process per local rank, fed by the shared-memory broadcast ring."""

    def __init__(self, config: EngineConfig, ipc_dir: str, startup_timeout: float = 900.0):
        from shm.broadcast_ring import BroadcastRing
        from workers.worker import run_worker
        self.world_size = config.tensor_parallel_size
        self.ctx = zmq.Context()
        self.enc = Encoder()
        self.dec = Decoder(WorkerReply)
        self._call_ids = itertools.count(1)
        nodes = self._place(config)
        self.ring = BroadcastRing.create(nodes.local, ipc_dir, remote=nodes.remote_spec())
        self.rendezvous, listener = self._bind_rendezvous(config, nodes)
        self.replies = []
        self.procs = []
        self._guard = None
        self._remote_dead: str | None = None
        self._remote_sock = None
        self._dead_r, self._dead_w = os.pipe()  # readable once a worker of another node is gone
        for rank in range(nodes.local):
            addr = ipc_address(ipc_dir, f"worker-reply-{rank}")
            self.replies.append(make_socket(self.ctx, zmq.PULL, addr, bind=True))
            self._start_worker(run_worker, rank, config, self.ring.handle(), addr)
        if nodes.count > 1:  # the replies of the other nodes' workers
            if nodes.auth_key:
                from ipc.auth import PeerGuard, derive_keys
                from ipc.auth import READER_ROLE
                self._guard = PeerGuard(self.ctx, "tensor-parallel replies",
                                        (derive_keys(nodes.auth_key, READER_ROLE).public,))
            # watched from before it binds: another node's workers may be connecting already
            remote = make_socket(self.ctx, zmq.PULL, nodes.reply_address, bind=True, auth=nodes.reply_server(),
                                 monitor=REMOTE_WORKER_EVENTS)
            self.replies.append(remote)
            self._remote_sock = remote
            self._watch_remote(remote.get_monitor_socket())
        self._start_remote_workers(run_worker, config, nodes)
        # torch's import (1-3 s on 2 CPU cores) runs while the workers import theirs
        self._store = self._serve_rendezvous(self.rendezvous, listener)
        self.poller = zmq.Poller()
        self._reply_spin_s = envs.LOOM_ENGINE_REPLY_SPIN_MS / 1e3
        for sock in self.replies:
            self.poller.register(sock, zmq.POLLIN)
        self.ring.wait_until_ready(timeout=startup_timeout)
        deadline = time.monotonic() + startup_timeout
        ready: set[int] = set()
        while len(ready) < self.world_size:  # "ready" from each rank once its model is loaded, any order
            ready.add(self._recv_step(None, deadline).rank)

    def _place(self, config: EngineConfig) -> "Nodes":
        """Where the ranks run (the Ray executor places them on a placement group first)."""
        return Nodes(config)

    def _start_worker(self, run_worker, rank: int, config: EngineConfig, ring_handle, reply_address: str) -> None:
        """Start the worker of local rank `rank` (a process here; an actor in RayExecutor)."""
        self.procs.append(start_process(run_worker, f"loom-worker-{rank}",
                                        (rank, rank, config.to_dict(), ring_handle, reply_address,
                                         self.rendezvous)))

    def _start_remote_workers(self, run_worker, config: EngineConfig, nodes: "Nodes") -> None:
        """The ranks of other nodes: started there by hand (`loom serve --headless`) with mp."""

    @staticmethod
    def _bind_rendezvous(config: EngineConfig, nodes: "Nodes") -> tuple[Rendezvous | None, socket.socket | None]:
        """The engine core picks where the ranks meet: a TCPStore it serves itself, on a free
        port of 127.0.0.1 for one node (bound, so nothing can take it before the ranks come),
        on --master-addr:--master-port across nodes. Only the socket here: the store needs torch."""
        if config.tensor_parallel_size == 1:
            return None, None
        host, port = (nodes.addr, nodes.port) if nodes.count > 1 else ("127.0.0.1", 0)
        listener = bind_rendezvous(host, port)
        return Rendezvous(host, listener.getsockname()[1], config.tensor_parallel_size), listener

    @staticmethod
    def _serve_rendezvous(rendezvous: Rendezvous | None, listener: socket.socket | None):
        """The TCPStore on the socket _bind_rendezvous bound (None at TP=1)."""
        if rendezvous is None:
            return None
        from workers.distributed import serve_rendezvous
        return serve_rendezvous(rendezvous.host, rendezvous.port, listener=listener)

    # ------------------------------------------------------------ liveness

    def _watch_remote(self, mon: zmq.Socket) -> None:
        """A worker of another node holds one connection to the reply socket, open from its
        start to its end: that connection dropping is its death (its node died or went away).
        A disconnect that follows a failed handshake is a stranger's, not a worker's.
        mon: the reply socket's monitor, of REMOTE_WORKER_EVENTS."""
        import threading
        from zmq.utils.monitor import recv_monitor_message

        def watch():
            workers = strangers = 0  # connections that passed the handshake / that failed it
            try:
                while True:
                    ev = recv_monitor_message(mon)["event"]
                    if ev == zmq.EVENT_MONITOR_STOPPED:
                        return
                    if ev == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                        workers += 1
                    elif ev & HANDSHAKE_FAILED:
                        strangers += 1
                    elif strangers:  # the disconnect that follows a failed handshake
                        strangers -= 1
                    elif workers:
                        self._remote_dead = "a worker on another node disconnected (its node died or stopped)"
                        os.write(self._dead_w, b"x")
                        return
            except zmq.ZMQError:  # the context is terminating
                pass
            finally:
                mon.close(linger=0)
        threading.Thread(target=watch, name="remote-worker-watch", daemon=True).start()

    def dead_worker(self) -> str | None:
        if self._remote_dead:
            return self._remote_dead
        for p in self.procs:
            if not p.is_alive():
                return f"{p.name} (pid {p.pid}) died with exit code {p.exitcode}"
        return None

    def _check_alive(self) -> None:
        dead = self.dead_worker()
        if dead:
            raise WorkerError(dead)

    def sentinels(self) -> list[int]:
        """What to wait on for a worker's death: the local processes, and a pipe that becomes
        readable when a worker of another node goes."""
        return [p.sentinel for p in self.procs] + [self._dead_r]

    # ------------------------------------------------------------ calls

    def _recv_any(self, deadline: float | None = None) -> WorkerReply:
        """The next reply of any worker, checking every 0.1 s that all of them live (busy-polling
        first for LOOM_ENGINE_REPLY_SPIN_MS)."""
        spin_end = time.monotonic() + self._reply_spin_s
        while True:
            spinning = time.monotonic() < spin_end
            for sock, _ in self.poller.poll(0 if spinning else _POLL_MS):
                return self.dec.decode(sock.recv_multipart(copy=False))
            if not spinning:
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

    def close_sockets(self) -> None:
        for sock in self.replies:
            if sock is self._remote_sock:
                sock.disable_monitor()  # the watch thread then closes its end, which ctx.term() waits for
            sock.close()
        if self._guard is not None:
            self._guard.close()
        self.ctx.term()
        os.close(self._dead_r)
        os.close(self._dead_w)

    def shutdown(self) -> None:
        try:
            if all(p.is_alive() for p in self.procs):
                # bounded: a step cut short by SIGTERM may have left the ring's next chunk
                # claimed and unpublished, and then the workers are stopped by signal below
                self.ring.enqueue(self.enc.encode(MsgType.WORKER_CALL.value, WorkerCall("shutdown")), timeout=1)
                wait_sentinels(self.sentinels(), timeout=5)
        except Exception:
            pass
        stop_processes(self.procs)
        self.ring.close()
        self.close_sockets()


class Nodes:
    """Where the ranks live when they span nodes: node n runs ranks [n * local, (n + 1) * local).
    Node 0's engine core publishes each step on --master-port + 1 (the ring's TCP XPUB) and
    takes the other nodes' replies on --master-port + 2; torch.distributed meets on
    --master-port. With an auth key both sockets are CURVE (keys derived from the key);
    without one they must stay on loopback."""

    def __init__(self, config: EngineConfig):
        self.count = config.nnodes
        self.local = config.tensor_parallel_size // config.nnodes
        self.world = config.tensor_parallel_size
        self.node_rank = config.node_rank
        self.addr, self.port = config.master_addr, config.master_port
        self.auth_key = envs.LOOM_ENGINE_AUTH_KEY or None
        if self.count > 1:
            check_network_security(self.addr, self.auth_key)

    @property
    def ring_address(self) -> str:
        return f"tcp://{_bracket(self.addr)}:{self.port + 1}"

    @property
    def reply_address(self) -> str:
        return f"tcp://{_bracket(self.addr)}:{self.port + 2}"

    def remote_spec(self):
        if self.count == 1:
            return None
        from shm.broadcast_ring import RemoteSpec
        return RemoteSpec(self.ring_address, tuple(range(self.local, self.world)), self.auth_key)

    def remote_handle(self):
        from shm.broadcast_ring import RemoteHandle
        return RemoteHandle(self.ring_address, self.auth_key)

    def reply_server(self):
        from ipc.auth import ring_curve_server
        return ring_curve_server(self.auth_key)


def _bracket(host: str) -> str:
    return f"[{host}]" if ":" in host else host


def check_network_security(host: str, auth_key: str | None) -> None:
    """Workers on other nodes read every step and can send replies: off loopback, require a key."""
    if not auth_key and host not in ("127.0.0.1", "localhost", "::1"):
        raise ConfigError(f"--master-addr {host} is reachable from the network: set --engine-auth-key "
                          f"(or LOOM_ENGINE_AUTH_KEY) on every node so that the step broadcast and the "
                          f"workers' replies are authenticated (CURVE)")


def serve_secondary_node(config: EngineConfig) -> int:
    """`loom serve MODEL --headless --nnodes N --node-rank R ...`: this node's workers, ranks
    [R * local, (R + 1) * local). They read the steps from node 0's XPUB, reply to its PULL and
    join the group at its rendezvous. Returns when a worker exits (non-zero: the engine is gone
    or a worker failed) or on SIGTERM / Ctrl-C (0)."""
    from workers.worker import run_worker
    nodes = Nodes(config)
    first = nodes.node_rank * nodes.local
    rdv = Rendezvous(nodes.addr, nodes.port, nodes.world)
    coordinate_stops_here()   # the workers' SIGTERMs come here (ipc/procs.py child_signals)
    stop = catch_stop_signals()
    procs = [start_process(run_worker, f"loom-worker-{rank}",
                           (rank, rank - first, config.to_dict(), nodes.remote_handle(), nodes.reply_address, rdv))
             for rank in range(first, first + nodes.local)]
    logger.info("node %d: workers %d..%d started; node 0 at %s", nodes.node_rank, first,
                first + nodes.local - 1, nodes.addr)
    code = 0
    try:
        while not stop.is_set():
            wait_sentinels([p.sentinel for p in procs], timeout=0.2)
            dead = [p for p in procs if not p.is_alive()]
            if dead:
                for p in dead:
                    logger.log(logging.ERROR if p.exitcode else logging.INFO,
                               "%s exited with code %s; stopping this node", p.name, p.exitcode)
                code = 1 if any(p.exitcode for p in dead) else 0
                break
    finally:
        stop_processes(procs)
    return code
