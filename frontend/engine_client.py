"""Clients of an engine core: token ids in, EngineCoreOutputs out.

Used by the API servers (async), the offline LLM (sync), and any external
scheduler or router. The client binds an input ROUTER and an output PULL; the
engine connects to both and says READY first. The engine is declared dead on
an ENGINE_DEAD message, on the output connection dropping, or (when this
client owns the process) on its exit.
"""
from __future__ import annotations

import asyncio
import socket
import itertools
import logging
import time
from typing import Any

import msgspec
import zmq
import zmq.asyncio
from zmq.utils.monitor import parse_monitor_message

from ipc.auth import (CLIENT_ROLE, ENGINE_ROLE, HANDSHAKE_FAILED, CurveClient, CurveServer, HandshakeWatch,
                      PeerGuard, derive_keys, new_keys)
from ipc.messages import (AttachRequest, EngineCoreOutputs, EngineCoreRequest, EngineReady, Hello, MsgType,
                          UtilityRequest)
from ipc.handshake import HandshakeDealer
from ipc.serial import Decoder, Encoder
from ipc.sockets import make_socket

logger = logging.getLogger(__name__)


class EngineDeadError(RuntimeError):
    """The engine core (or one of its workers) is gone; nothing more will come."""


class _ClientBase:
    """One input ROUTER and one output PULL for every engine core of the client: each engine
    (a data-parallel rank) connects to both and says READY with its engine_index, which is how
    its identity on the ROUTER is learnt; its outputs carry the same index."""

    def __init__(self, ctx: zmq.Context, input_address: str, output_address: str, client_index: int,
                 num_engines: int = 1):
        self.ctx = ctx
        self.client_index = client_index
        self.num_engines = num_engines
        # tcp:// endpoints are CURVE servers with fresh keys; only the engines' keys (learned in HELLO) get in
        self.keys = self.guard = None
        auth = None
        if input_address.startswith("tcp://") or output_address.startswith("tcp://"):
            auth = self._curve()
        self.input = make_socket(ctx, zmq.ROUTER, input_address, bind=True, auth=auth)
        self.output = make_socket(ctx, zmq.PULL, output_address, bind=True, auth=auth)
        # the addresses as bound ("tcp://host:*" picks a free port)
        self.input_address = self.input.getsockopt_string(zmq.LAST_ENDPOINT)
        self.output_address = self.output.getsockopt_string(zmq.LAST_ENDPOINT)
        self._tcp = (self.input_address, self.output_address) if auth is not None else None
        events = zmq.EVENT_HANDSHAKE_SUCCEEDED | zmq.EVENT_DISCONNECTED | HANDSHAKE_FAILED
        self.monitor = self.output.get_monitor_socket(events)
        self.input_monitor = self.input.get_monitor_socket(HANDSHAKE_FAILED)
        self.handshake_watch = HandshakeWatch("engine client sockets")
        self._after_failure = False   # the next DISCONNECTED is that of a peer whose handshake failed
        # engine index -> when that engine last sent anything (each beats when idle), from its READY on
        self.last_heard: dict[int, float] = {}
        self.enc = Encoder()
        self.out_dec = Decoder(EngineCoreOutputs)
        self.ready_dec = Decoder(EngineReady)
        self.engines: dict[int, bytes] = {}        # engine index -> its identity on our input ROUTER
        self.readies: dict[int, EngineReady] = {}
        self.ready: EngineReady | None = None      # the first engine's, once every engine is ready
        self.dead_reason: str | None = None
        self._call_ids = itertools.count()
        self._connected = False

    @property
    def is_dead(self) -> bool:
        return self.dead_reason is not None

    @property
    def engine_indices(self) -> list[int]:
        return sorted(self.engines)

    def _frames(self, kind: MsgType, msg: Any, engine: int | None = None) -> list:
        identity = self.engines[self.engine_indices[0] if engine is None else engine]
        return [identity, *self.enc.encode(kind.value, msg)]

    def _curve(self) -> CurveServer:
        self.keys = new_keys()
        self.guard = PeerGuard(self.ctx, "engine client sockets")
        return CurveServer(self.keys)

    def tcp_addresses(self, host: str) -> tuple[str, str]:
        """Input and output addresses that an engine elsewhere can connect to: CURVE endpoints,
        bound on first use beside the ipc:// ones of local engines (libzmq takes a socket's
        security options as they are at each bind)."""
        if self._tcp is None:
            auth = self._curve()
            for sock in (self.input, self.output):
                auth.apply(sock)
                sock.bind(f"tcp://{host}:*")
            self._tcp = (self.input.getsockopt_string(zmq.LAST_ENDPOINT),
                         self.output.getsockopt_string(zmq.LAST_ENDPOINT))
        return self._tcp

    def _on_monitor(self, frames: list) -> None:
        """The output socket's connection events. A peer that failed the handshake (no or a wrong
        key) is counted and its departure ignored; the engine's own departure means it is gone."""
        event = parse_monitor_message(frames)["event"]
        if self.handshake_watch.note(event):
            self._after_failure = True
        elif event == zmq.EVENT_HANDSHAKE_SUCCEEDED:
            self._connected = True
        elif event == zmq.EVENT_DISCONNECTED:
            if self._after_failure:
                self._after_failure = False
            elif self._connected:
                self.dead_reason = self.dead_reason or "an engine core closed its connection (it exited)"

    def _on_input_monitor(self, frames: list) -> None:
        self.handshake_watch.note(parse_monitor_message(frames)["event"])

    def _on_output_frames(self, frames: list) -> EngineCoreOutputs | None:
        """The outputs in `frames`; None for ENGINE_DEAD (then is_dead) or a malformed message (dropped)."""
        kind = bytes(frames[0].buffer)
        try:
            if kind == MsgType.ENGINE_DEAD.value:
                self.dead_reason = f"engine core died: {msgspec.msgpack.decode(frames[1].buffer)}"
                return None
            outs = self.out_dec.decode(frames)
        except Exception as e:  # noqa: BLE001  (only the engine can send here, but never trust a frame)
            logger.warning("dropping a malformed %r message from the engine: %s", kind[:8], e)
            return None
        if outs.engine_index in self.last_heard:
            self.last_heard[outs.engine_index] = time.monotonic()
        return outs

    def silent_engines(self, seconds: float) -> frozenset[int]:
        """The engines that have sent nothing, not even a heartbeat, for more than `seconds`."""
        if self.ready is None:
            return frozenset()
        now = time.monotonic()
        return frozenset(e for e, t in self.last_heard.items() if now - t > seconds)

    def silent_for(self) -> float:
        """Seconds since the quietest engine last sent anything (0 before every engine is ready)."""
        if self.ready is None:
            return 0.0
        return time.monotonic() - min(self.last_heard.values())

    def _on_ready(self, frames: list) -> None:
        ready = self.ready_dec.decode(frames[1:])
        self.engines[ready.engine_index] = bytes(frames[0].buffer)
        self.last_heard[ready.engine_index] = time.monotonic()
        self.readies[ready.engine_index] = ready
        if len(self.readies) == self.num_engines:
            self.ready = self.readies[min(self.readies)]
            # the index the first engine knows us by (an engine attached from elsewhere gives its own)
            self.client_index = self.ready.client_index

    def _close_sockets(self) -> None:
        if self.guard is not None:
            self.guard.close()
        for s in (self.monitor, self.input_monitor, self.input, self.output):
            s.close(linger=0)


def local_address_towards(engine_address: str) -> str:
    """The IP of this host on the route to the engine: where the engine can reach our sockets."""
    host, port = engine_address.split("://", 1)[-1].rsplit(":", 1)
    host = host.strip("[]")
    if host in ("127.0.0.1", "localhost", "::1"):
        return "127.0.0.1"
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.connect((host, int(port)))
        return s.getsockname()[0]


def attach_handshake(engine_address: str, client: "_ClientBase", auth_key: str | None = None,
                     timeout: float = 30.0) -> None:
    """Ask the engine at its handshake address to connect to our sockets (docs/protocol.md)."""
    from ipc.auth import auth_proof
    auth = None
    if auth_key:  # the engine's handshake socket is CURVE with keys derived from the key
        auth = CurveClient(derive_keys(auth_key, CLIENT_ROLE), derive_keys(auth_key, ENGINE_ROLE).public)
    enc = Encoder()
    with HandshakeDealer(engine_address, auth, "the engine") as dealer:
        frames = dealer.ask(enc.encode(MsgType.HELLO.value, None), timeout, f"no engine answered at {engine_address}")
        hello: Hello = Decoder(Hello).decode(frames)
        if hello.auth_required and not auth_key:
            raise PermissionError("the engine requires an auth key (--engine-auth-key / LOOM_ENGINE_AUTH_KEY)")
        input_address, output_address = client.tcp_addresses(local_address_towards(engine_address))
        client.guard.allow(hello.engine_public_key)   # before the engine can connect to us
        proof = auth_proof(auth_key, hello.nonce) if hello.auth_required else ""
        frames = dealer.ask(enc.encode(MsgType.ATTACH.value, AttachRequest(
            input_address, output_address, proof, client.keys.public)), timeout,
            f"the engine at {engine_address} did not answer the attach request")
        # READY (accepted; READY also comes on our input) or REFUSED
        if bytes(frames[0].buffer) == MsgType.REFUSED.value:
            raise PermissionError(f"the engine refused to attach: {msgspec.msgpack.decode(frames[1].buffer)}")


class EngineCoreClient(_ClientBase):
    """Blocking client (offline LLM, scripts, external schedulers and routers)."""

    @classmethod
    def attach(cls, engine_address: str, auth_key: str | None = None, timeout: float = 30.0) -> "EngineCoreClient":
        """Attach to a running engine core (`loom serve --headless --engine-address tcp://...`)."""
        host = local_address_towards(engine_address)
        client = cls(f"tcp://{host}:*", f"tcp://{host}:*")
        try:
            attach_handshake(engine_address, client, auth_key, timeout)
            client.wait_ready(timeout)
        except BaseException:
            client.close()
            raise
        return client

    def __init__(self, input_address: str, output_address: str, client_index: int = 0, engine_proc=None,
                 num_engines: int = 1):
        super().__init__(zmq.Context(), input_address, output_address, client_index, num_engines)
        self.engine_procs = [engine_proc] if engine_proc is not None else []   # processes this client owns
        self.poller = zmq.Poller()
        for s in (self.output, self.monitor, self.input_monitor):
            self.poller.register(s, zmq.POLLIN)
        self._pending: list[EngineCoreOutputs] = []

    def _check_proc(self) -> None:
        for p in self.engine_procs:
            if not p.is_alive() and not self.dead_reason:
                self.dead_reason = f"{p.name} exited with code {p.exitcode}"
        if self.dead_reason:
            raise EngineDeadError(self.dead_reason)

    def wait_ready(self, timeout: float = 900.0) -> EngineReady:
        deadline = time.monotonic() + timeout
        while self.ready is None:
            if self.input.poll(100):
                self._on_ready(self.input.recv_multipart(copy=False))
            elif self.output.poll(0):
                self._on_output_frames(self.output.recv_multipart(copy=False))
            self._check_proc()
            if time.monotonic() > deadline:
                raise TimeoutError(f"the engine core was not ready after {timeout:.0f}s")
        return self.ready

    def add_request(self, req: EngineCoreRequest, engine: int | None = None) -> None:
        self._check_proc()
        req.client_index = self.client_index
        self.input.send_multipart(self._frames(MsgType.ADD, req, engine), copy=False)

    def abort(self, request_ids: list[str], engine: int | None = None) -> None:
        if request_ids and not self.is_dead:
            self.input.send_multipart(self._frames(MsgType.ABORT, list(request_ids), engine), copy=False)

    def get_outputs(self, timeout: float | None = None) -> EngineCoreOutputs | None:
        """The next batch of outputs; None on timeout."""
        if self._pending:
            return self._pending.pop(0)
        return self._recv_outputs(timeout)

    def _recv_outputs(self, timeout: float | None) -> EngineCoreOutputs | None:
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            for sock, _ in self.poller.poll(100):
                if sock is self.monitor:
                    self._on_monitor(sock.recv_multipart())
                    continue
                if sock is self.input_monitor:
                    self._on_input_monitor(sock.recv_multipart())
                    continue
                outs = self._on_output_frames(sock.recv_multipart(copy=False))
                if outs is not None:
                    return outs
            self._check_proc()
            if deadline is not None and time.monotonic() >= deadline:
                return None

    def call_utility(self, method: str, *args, timeout: float | None = None, engine: int | None = None) -> Any:
        """Run an engine utility method on one engine (default: the first); its result."""
        return self._call(method, args, timeout, [self.engine_indices[0] if engine is None else engine])[0]

    def call_utility_all(self, method: str, *args, timeout: float | None = None) -> list[Any]:
        """Run it on every engine at once; their results, by engine index."""
        return self._call(method, args, timeout, self.engine_indices)

    def _call(self, method: str, args: tuple, timeout: float | None, engines: list[int]) -> list[Any]:
        call_id = next(self._call_ids)
        for e in engines:
            self.input.send_multipart(self._frames(
                MsgType.UTILITY, UtilityRequest(self.client_index, call_id, method, list(args)), e), copy=False)
        results: dict[int, Any] = {}
        failure = None
        deadline = None if timeout is None else time.monotonic() + timeout
        while len(results) < len(engines):
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                raise TimeoutError(f"utility call {method} timed out")
            outs = self._recv_outputs(left)
            if outs is None:
                continue
            u = outs.utility_output
            if u is not None and u.call_id == call_id:
                if outs.outputs or outs.scheduler_stats or outs.finished_timings or outs.load:
                    outs.utility_output = None
                    self._pending.append(outs)
                results[outs.engine_index] = u.result
                failure = failure or u.failure
                continue
            self._pending.append(outs)
        if failure:
            raise RuntimeError(failure)
        return [results[e] for e in engines]

    def close(self) -> None:
        self._close_sockets()
        self.ctx.term()


class AsyncEngineCoreClient(_ClientBase):
    """asyncio client (API servers), of one engine core or of every data-parallel rank.
    Outputs are delivered to `on_outputs`; the death of any engine is the death of all."""

    def __init__(self, input_address: str, output_address: str, client_index: int, on_outputs, on_dead,
                 num_engines: int = 1):
        super().__init__(zmq.asyncio.Context(), input_address, output_address, client_index, num_engines)
        self.on_outputs = on_outputs
        self.on_dead = on_dead
        self._calls: dict[tuple[int, int], asyncio.Future] = {}   # (engine index, call id) -> its reply
        self._tasks: list[asyncio.Task] = []

    async def attach(self, engine_address: str, auth_key: str | None = None, timeout: float = 30.0) -> EngineReady:
        """Attach to an engine core at its handshake address, then wait for READY."""
        await self.attach_handshake(engine_address, auth_key, timeout)
        return await self.wait_ready(timeout)

    async def attach_handshake(self, engine_address: str, auth_key: str | None = None,
                               timeout: float = 30.0) -> None:
        """Ask the engine at engine_address to connect to us (its READY is taken by wait_ready)."""
        self.tcp_addresses(local_address_towards(engine_address))   # bound here, in the loop's thread
        await asyncio.get_running_loop().run_in_executor(None, attach_handshake, engine_address, self, auth_key,
                                                         timeout)

    async def wait_ready(self, timeout: float = 900.0) -> EngineReady:
        """Until every engine said READY."""
        deadline = time.monotonic() + timeout
        while self.ready is None:
            left = deadline - time.monotonic()
            if left <= 0 or not await self.input.poll(left * 1000):
                missing = sorted(set(range(self.num_engines)) - set(self.readies))
                raise TimeoutError(f"engine core(s) {missing} not ready after {timeout:.0f}s")
            self._on_ready(await self.input.recv_multipart(copy=False))
        self._tasks = [asyncio.create_task(self._output_loop()), asyncio.create_task(self._monitor_loop()),
                       asyncio.create_task(self._input_monitor_loop())]
        return self.ready

    async def _output_loop(self) -> None:
        while not self.is_dead:
            frames = await self.output.recv_multipart(copy=False)
            outs = self._on_output_frames(frames)
            if self.is_dead:
                self._declare_dead()
                return
            if outs is None:
                continue
            u = outs.utility_output
            if u is not None:
                fut = self._calls.pop((outs.engine_index, u.call_id), None)
                if fut is not None and not fut.done():
                    if u.failure:
                        fut.set_exception(RuntimeError(u.failure))
                    else:
                        fut.set_result(u.result)
            self.on_outputs(outs)

    async def _monitor_loop(self) -> None:
        while not self.is_dead:
            self._on_monitor(await self.monitor.recv_multipart())
        self._declare_dead()

    async def _input_monitor_loop(self) -> None:
        while not self.is_dead:
            self._on_input_monitor(await self.input_monitor.recv_multipart())

    def _declare_dead(self) -> None:
        for fut in self._calls.values():
            if not fut.done():
                fut.set_exception(EngineDeadError(self.dead_reason))
        self._calls.clear()
        self.on_dead(self.dead_reason)

    async def add_request(self, req: EngineCoreRequest, engine: int | None = None) -> None:
        if self.is_dead:
            raise EngineDeadError(self.dead_reason)
        req.client_index = self.client_index
        await self.input.send_multipart(self._frames(MsgType.ADD, req, engine), copy=False)

    async def abort(self, request_ids: list[str], engine: int | None = None) -> None:
        if request_ids and not self.is_dead:
            await self.input.send_multipart(self._frames(MsgType.ABORT, list(request_ids), engine), copy=False)

    async def call_utility(self, method: str, *args, timeout: float | None = None, engine: int | None = None) -> Any:
        """Run an engine utility method on one engine (default: the first); its result."""
        return (await self._call(method, args, timeout, [self.engine_indices[0] if engine is None else engine]))[0]

    async def call_utility_all(self, method: str, *args, timeout: float | None = None) -> list[Any]:
        """Run it on every engine at once; their results, by engine index."""
        return await self._call(method, args, timeout, self.engine_indices)

    async def _call(self, method: str, args: tuple, timeout: float | None, engines: list[int]) -> list[Any]:
        if self.is_dead:
            raise EngineDeadError(self.dead_reason)
        call_id = next(self._call_ids)
        loop = asyncio.get_running_loop()
        futs = []
        try:
            for e in engines:
                # encoded first: arguments that do not encode (an int past 64 bits) leave no reply
                # waiting, which the engine's death would fail unretrieved ("Future exception was
                # never retrieved"), one per such call
                frames = self._frames(MsgType.UTILITY, UtilityRequest(self.client_index, call_id, method,
                                                                      list(args)), e)
                fut = loop.create_future()
                self._calls[(e, call_id)] = fut
                futs.append(fut)
                await self.input.send_multipart(frames, copy=False)
            results = await asyncio.wait_for(asyncio.gather(*futs, return_exceptions=True), timeout)
        finally:
            for e in engines:
                self._calls.pop((e, call_id), None)
            for fut in futs:   # (a send that failed part-way: replies no one will await)
                if not fut.done():
                    fut.cancel()
        for r in results:
            if isinstance(r, BaseException):
                raise r
        return results

    def close(self) -> None:
        for t in self._tasks:
            t.cancel()
        self._close_sockets()
        self.ctx.term()
