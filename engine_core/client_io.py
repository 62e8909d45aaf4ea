"""The engine core's side of its clients: input and output threads, the
handshake socket for clients attaching from elsewhere, and their departure.

Clients given at start-up (the API servers of `loom serve`, the offline LLM)
are connected at once. Others knock on the handshake ROUTER:

    client -> HELLO                   engine -> HELLO(nonce, auth_required, engine CURVE key)
    client -> ATTACH(addresses, proof, client CURVE key)
                                      engine connects, READY on the client's input,
                                      and READY on the handshake socket as the answer
                                      (or REFUSED(reason) on the handshake socket)

With an auth key the handshake socket itself is CURVE (ipc/auth.py): a peer without
the key cannot complete the ZMTP handshake, so nothing of it reaches this code. The
engine's sockets towards an attached client's tcp:// addresses are CURVE too.
A malformed handshake fails alone: nothing is registered until both sockets connected.

The engine stamps every ADD, ABORT and UTILITY with the index of the connection
it came on, so a client can only act as itself (and abort only its own requests).
A client whose connection drops is reported as ("CLIENT_GONE", index) on the
input queue.
"""
from __future__ import annotations

import collections
import hmac
import itertools
import logging
import queue
import re
import secrets
import struct
import threading
import time
from dataclasses import dataclass

import zmq
from zmq.utils.monitor import parse_monitor_message

from ipc import envs
from ipc.auth import (CLIENT_ROLE, ENGINE_ROLE, HANDSHAKE_FAILED, CurveClient, CurveServer, HandshakeWatch,
                      PeerGuard, auth_proof, derive_keys, new_keys)
from ipc.handshake import HANDSHAKE_MAX_MSG_BYTES
from ipc.messages import AttachRequest, EngineCoreRequest, EngineReady, Hello, MsgType, UtilityRequest
from ipc.serial import Decoder, Encoder
from ipc.sockets import close_socket, make_socket

logger = logging.getLogger(__name__)
CLIENT_GONE = b"client-gone"
ADD_MALFORMED = b"add-malformed"  # (client index, request id, error): an ADD that did not decode
UTILITY_MALFORMED = b"utility-malformed"  # (client index, call id, error): a UTILITY that did not decode
MALFORMED = {MsgType.ADD.value: ADD_MALFORMED, MsgType.UTILITY.value: UTILITY_MALFORMED}
MAX_PENDING_HELLOS = 1024             # nonces of HELLOs not yet followed by ATTACH: the oldest go first
HELLO_TTL_S = 30.0                    # ... and none lives longer than this
_FINAL_LINGER_MS = 200
_POLL_MS = 200                        # the input thread looks at attach deadlines this often
ATTACH_CONNECT_TIMEOUT_S = 30.0      # an attached client whose sockets the engine cannot reach is dropped
MAX_ATTACHED_CLIENTS = 256            # each costs three sockets (and their fds) in the engine
MAX_UNCONNECTED_ATTACHES = 32         # ... which retry connecting until ATTACH_CONNECT_TIMEOUT_S;
                                      # the last of them only for a peer on the engine's own host
MAX_UNCONNECTED_PER_PEER = 8          # ... of them from one peer (its address, as the handshake saw it)
_TCP_ADDRESS = re.compile(r"tcp://(\[[0-9a-fA-F:.]+\]|[A-Za-z0-9.-]{1,253}):(\d{1,5})")


def check_attach_address(addr: str) -> None:
    """tcp://HOST:PORT with a numeric port, or ipc://PATH; anything else is refused before connecting."""
    m = _TCP_ADDRESS.fullmatch(addr)
    if m is not None and 0 < int(m.group(2)) < 65536:
        return
    if addr.startswith("ipc://") and 6 < len(addr) <= 4096 and "\0" not in addr:
        return
    raise ValueError(f"not a tcp://HOST:PORT or ipc://PATH address: {addr[:100]!r}")



@dataclass
class _Watched:
    """An attached client's input socket, watched through its monitor socket."""
    index: int
    dealer: zmq.Socket
    deadline: float          # dropped if its connection is not up by then
    peer: str = ""           # the handshake's peer address ("": local, ipc://)
    connected: bool = False


class ClientIO:
    def __init__(self, ready: EngineReady, inputs: queue.Queue, clients: list[tuple[str, str]],
                 handshake_address: str | None = None, auth_key: str | None = None, output_hwm: int | None = None):
        self.ctx = zmq.Context()
        # Outputs queued in the engine for an attached client that does not read them (beyond the
        # kernel's socket buffers): one message per step it has outputs in. At the bound the client
        # is dropped (its requests aborted), where an unbounded queue would grow the engine's memory.
        # (--attached-output-hwm; LOOM_ATTACHED_OUTPUT_HWM where no config gives it.)
        self.output_hwm = output_hwm if output_hwm is not None else envs.LOOM_ATTACHED_OUTPUT_HWM
        self.ready = ready
        self.inputs = inputs
        self.static_clients = clients
        self.handshake_address = handshake_address
        self.auth_key = auth_key or None
        self.keys = new_keys()               # this engine's CURVE keys towards attached clients
        self.outputs: queue.Queue = queue.Queue()
        self._indices = itertools.count()
        self.live: set[int] = set()          # client indices connected now
        # identity -> (nonce, expiry) of HELLOs not yet followed by ATTACH (the input thread's)
        self.pending_hellos: collections.OrderedDict[bytes, tuple[bytes, float]] = collections.OrderedDict()
        self._enc = Encoder()                # the input thread's (the output thread has its own)
        self._decoders = {MsgType.ADD.value: Decoder(EngineCoreRequest), MsgType.ABORT.value: Decoder(list[str]),
                          MsgType.UTILITY.value: Decoder(UtilityRequest)}
        self._attach_dec = Decoder(AttachRequest)
        self._poller = zmq.Poller()
        self._by_sock: dict[zmq.Socket, int] = {}
        self._watched: dict[zmq.Socket, _Watched] = {}
        self._unread: queue.SimpleQueue[int] = queue.SimpleQueue()   # output thread -> input thread
        self._stop = threading.Event()
        self._in = threading.Thread(target=self._input_loop, name="engine-input", daemon=True)
        self._out = threading.Thread(target=self._output_loop, name="engine-output", daemon=True)
        self._handshake = self._handshake_monitor = self._guard = None
        # close() wakes the input thread at once (its poll would otherwise take up to _POLL_MS)
        self._wake_in = self.ctx.socket(zmq.PAIR)
        self._wake_in.bind(f"inproc://engine-input-wake-{id(self)}")
        self._wake = self.ctx.socket(zmq.PAIR)
        self._wake.connect(f"inproc://engine-input-wake-{id(self)}")
        self.handshake_watch = HandshakeWatch("engine handshake socket")
        if handshake_address:  # bind now, so a bad address fails start-up
            auth = None
            if self.auth_key:
                self._guard = PeerGuard(self.ctx, "engine handshake socket",
                                        (derive_keys(self.auth_key, CLIENT_ROLE).public,))
                auth = CurveServer(derive_keys(self.auth_key, ENGINE_ROLE))
            self._handshake = make_socket(self.ctx, zmq.ROUTER, handshake_address, bind=True, auth=auth,
                                          max_msg_size=HANDSHAKE_MAX_MSG_BYTES)
            self._handshake_monitor = self._handshake.get_monitor_socket(HANDSHAKE_FAILED)

    @property
    def handshake_endpoint(self) -> str | None:
        """The handshake address as bound (a "tcp://host:*" address picks a free port)."""
        return self._handshake.getsockopt_string(zmq.LAST_ENDPOINT) if self._handshake is not None else None

    def start(self) -> None:
        self._out.start()
        self._in.start()

    def healthy(self) -> bool:
        """Both I/O threads run (the engine's heartbeat stops when one has died)."""
        return self._in.is_alive() and self._out.is_alive()

    def client_indices(self) -> list[int]:
        return sorted(self.live)

    def send(self, client_index: int, kind: bytes, msg) -> None:
        """client_index -1: every client."""
        self.outputs.put((client_index, kind, msg))

    def send_dead(self, reason: str) -> None:
        self.outputs.put((-1, MsgType.ENGINE_DEAD.value, reason))
        self.outputs.put(None)
        self._out.join(timeout=2)

    def close(self) -> None:
        self._stop.set()
        self._wake.send(b"")
        self.outputs.put(None)
        self._in.join(timeout=2)
        self._out.join(timeout=2)
        if self._guard is not None:
            self._guard.close()
        self.ctx.destroy(linger=0)

    # ------------------------------------------------------------ input thread
    # The input thread alone uses _poller, _by_sock (dealer -> client index) and _watched
    # (an attached client's monitor socket -> what it watches).

    def _input_loop(self) -> None:
        for input_addr, output_addr in self.static_clients:
            self._connect(input_addr, output_addr, watch=False)
        for sock in (self._handshake, self._handshake_monitor, self._wake_in):
            if sock is not None:
                self._poller.register(sock, zmq.POLLIN)
        while not self._stop.is_set():
            self._drop_unconnected(time.monotonic())
            self._drop_unread()
            for sock, _ in self._poller.poll(_POLL_MS):
                if sock is self._wake_in:
                    break   # close(): _stop is set
                try:
                    self._on_readable(sock)
                except Exception:  # noqa: BLE001  (one bad message or peer must not stop this thread)
                    logger.exception("engine input: dropping a message that could not be handled")

    def _on_readable(self, sock: zmq.Socket) -> None:
        if sock is self._handshake:
            self._on_handshake(sock)
        elif sock is self._handshake_monitor:
            self.handshake_watch.note(parse_monitor_message(sock.recv_multipart())["event"])
        elif sock in self._watched:
            watched = self._watched[sock]
            event = parse_monitor_message(sock.recv_multipart())["event"]
            if event == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                watched.connected = True
            elif event == zmq.EVENT_DISCONNECTED and watched.connected:
                self._drop(sock, "disconnected")
            elif event == zmq.EVENT_CONNECT_RETRIED and not watched.connected:
                # nothing listens where it said (refused): dropped now, not after the timeout,
                # so that a flood of such attaches cannot hold the unconnected slots
                self._drop(sock, "refused the engine's connection")
        else:
            self._on_client_message(sock, self._by_sock[sock])

    def _connect(self, input_addr: str, output_addr: str, watch: bool, client_public: bytes = b"",
                 peer: str = "") -> EngineReady:
        """Connect to a client's two sockets; raises (registering nothing) if either address is bad."""
        auth = CurveClient(self.keys, client_public) if client_public else None
        # attached clients may go away; local ones are watched by their parent
        events = zmq.EVENT_HANDSHAKE_SUCCEEDED | zmq.EVENT_DISCONNECTED | zmq.EVENT_CONNECT_RETRIED if watch else 0
        sock = make_socket(self.ctx, zmq.DEALER, input_addr, bind=False, auth=auth, monitor=events)
        mon = sock.get_monitor_socket() if watch else None
        try:
            push = make_socket(self.ctx, zmq.PUSH, output_addr, bind=False, auth=auth,
                               sndhwm=self.output_hwm if watch else 0)
        except BaseException:
            close_socket(sock, mon)
            raise
        idx = next(self._indices)
        self.outputs.put(("connect", idx, (push, watch)))   # from now on the output thread owns it
        ready = EngineReady(**{f: getattr(self.ready, f) for f in self.ready.__struct_fields__})
        ready.client_index = idx
        sock.send_multipart(self._enc.encode(MsgType.READY.value, ready))
        self._poller.register(sock, zmq.POLLIN)
        self._by_sock[sock] = idx
        self.live.add(idx)
        if mon is not None:
            self._watched[mon] = _Watched(idx, sock, time.monotonic() + ATTACH_CONNECT_TIMEOUT_S, peer)
            self._poller.register(mon, zmq.POLLIN)
        return ready

    def _drop_unconnected(self, now: float) -> None:
        for mon in [m for m, w in self._watched.items() if not w.connected and now > w.deadline]:
            self._drop(mon, "never connected")

    def _drop_unread(self) -> None:
        """Attached clients whose output queue the output thread found full."""
        while not self._unread.empty():
            idx = self._unread.get()
            mon = next((m for m, w in self._watched.items() if w.index == idx), None)
            if mon is not None:
                self._drop(mon, f"does not read its outputs ({self.output_hwm} messages queued)")

    def _drop(self, mon: zmq.Socket, why: str) -> None:
        watched = self._watched.pop(mon)
        logger.info("client %d %s; aborting its requests", watched.index, why)
        self._poller.unregister(mon)
        self._poller.unregister(watched.dealer)
        del self._by_sock[watched.dealer]
        close_socket(watched.dealer, mon)
        self.live.discard(watched.index)
        self.outputs.put(("disconnect", watched.index, None))
        self.inputs.put((CLIENT_GONE, watched.index))

    def _on_client_message(self, sock: zmq.Socket, idx: int) -> None:
        frames = sock.recv_multipart(copy=False)
        kind = bytes(frames[0].buffer)
        try:
            msg = self._decoders[kind].decode(frames)
        except Exception as e:  # a malformed message fails alone
            answer_to = _id_to_answer(frames, kind)
            if answer_to is None:
                logger.warning("client %d: dropping a malformed %r message: %s", idx, kind[:8], e)
                return
            # answered, or the client would wait for this request (or call) forever
            what = "request" if kind == MsgType.ADD.value else "utility call"
            self.inputs.put((MALFORMED[kind], (idx, answer_to, f"malformed {what}: {e}")))
            return
        if kind in (MsgType.ADD.value, MsgType.UTILITY.value):
            msg.client_index = idx
        elif kind == MsgType.ABORT.value:
            msg = (idx, msg)   # a client aborts only its own requests (engine_core/core.py)
        self.inputs.put((kind, msg))

    def _on_handshake(self, sock: zmq.Socket) -> None:
        nonces, enc = self.pending_hellos, self._enc
        frames = sock.recv_multipart(copy=False)
        identity = bytes(frames[0].buffer)
        now = time.monotonic()
        for expired in [i for i, (_, deadline) in nonces.items() if deadline < now]:
            del nonces[expired]   # a HELLO that never came back (at most MAX_PENDING_HELLOS to look at)
        try:
            kind = bytes(frames[1].buffer) if len(frames) > 1 else b""
            if kind == MsgType.HELLO.value:
                nonce = secrets.token_bytes(32)
                nonces.pop(identity, None)
                nonces[identity] = (nonce, now + HELLO_TTL_S)
                while len(nonces) > MAX_PENDING_HELLOS:
                    nonces.popitem(last=False)
                sock.send_multipart([identity, *enc.encode(MsgType.HELLO.value, Hello(
                    nonce, self.auth_key is not None, "", self.keys.public))])
                return
            nonce = nonces.pop(identity, (None, 0.0))[0]
            if kind != MsgType.ATTACH.value or nonce is None:
                raise PermissionError("say HELLO first")
            req: AttachRequest = self._attach_dec.decode(frames[1:])
            if self.auth_key is not None and not hmac.compare_digest(
                    req.auth_proof.encode(), auth_proof(self.auth_key, nonce).encode()):
                raise PermissionError("wrong engine auth key")
            peer = _peer_address(frames[0])
            self._check_room(peer)
            for addr in (req.input_address, req.output_address):
                check_attach_address(addr)
                if addr.startswith("tcp://") and len(req.client_public_key) != 40:
                    raise ValueError("tcp:// addresses need the client's CURVE public key (40 z85 bytes)")
            ready = self._connect(req.input_address, req.output_address, True, req.client_public_key, peer)
        except Exception as e:  # noqa: BLE001  (a bad handshake fails alone)
            logger.warning("refused a client: %s", e)
            sock.send_multipart([identity, *enc.encode(MsgType.REFUSED.value, str(e)[:500])])
            return
        sock.send_multipart([identity, *enc.encode(MsgType.READY.value, ready)])

    def _check_room(self, peer: str) -> None:
        """Attaches are bounded, so that a key holder's flood (of addresses that never answer,
        say) cannot take the engine's file descriptors, nor keep other clients out: unconnected
        ones per peer, and in all but for one slot that only the engine's own host can take (an
        API server restarting beside the engine). Those whose address refuses are dropped at once."""
        if len(self._watched) >= MAX_ATTACHED_CLIENTS:
            raise RuntimeError(f"the engine has {MAX_ATTACHED_CLIENTS} attached clients already")
        unconnected = [w.peer for w in self._watched.values() if not w.connected]
        if unconnected.count(peer) >= MAX_UNCONNECTED_PER_PEER:
            raise RuntimeError(f"{MAX_UNCONNECTED_PER_PEER} of this peer's attached clients are not connected yet: "
                               "try again later")
        if len(unconnected) >= MAX_UNCONNECTED_ATTACHES - (0 if _on_this_host(peer) else 1):
            raise RuntimeError(f"{len(unconnected)} attached clients are not connected yet: try again later")

    # ------------------------------------------------------------ output thread

    def _output_loop(self) -> None:
        enc = Encoder()
        socks: dict[int, zmq.Socket] = {}
        attached: set[int] = set()   # their queues are bounded (self.output_hwm)
        while True:
            item = self.outputs.get()
            if item is None:
                break
            target, kind, msg = item
            if target == "connect":
                socks[kind], watched = msg   # a PUSH socket the input thread connected
                if watched:
                    attached.add(kind)
                continue
            if target == "disconnect":
                attached.discard(kind)
                sock = socks.pop(kind, None)
                if sock is not None:
                    sock.close(linger=0)
                continue
            frames = enc.encode(kind, msg)
            for idx in (list(socks) if target < 0 else [target]):
                if idx in socks:
                    try:   # never blocks
                        socks[idx].send_multipart(frames, copy=False, flags=zmq.NOBLOCK)
                    except zmq.Again:
                        if idx in attached:   # its bounded queue is full: it does not read
                            attached.discard(idx)
                            socks.pop(idx).close(linger=0)
                            self._unread.put(idx)   # the input thread drops it
                        else:   # unbounded: Again means no pipe to that client
                            logger.warning("client %d: output socket has no connection; message dropped", idx)
        for sock in socks.values():   # a moment to deliver ENGINE_DEAD; a client that is gone gets none
            sock.close(linger=_FINAL_LINGER_MS)


def _peer_address(frame: zmq.Frame) -> str:
    """The handshake peer's address (TCP); "" where there is none (ipc://, the engine's host)."""
    try:
        return frame.get("Peer-Address") or ""
    except (zmq.ZMQError, AttributeError):
        return ""


def _on_this_host(peer: str) -> bool:
    return peer in ("", "::1") or peer.startswith("127.")


def _id_to_answer(frames, kind: bytes) -> str | int | None:
    """What the client of a malformed ADD or UTILITY waits on, if that much of it reads: an
    ADD's request id (the first field of EngineCoreRequest), a UTILITY's call id (the second
    field of UtilityRequest). Only the fields up to it are read, so a body with a bad later
    field or bytes after its end still gets its answer."""
    where = {MsgType.ADD.value: (0, str), MsgType.UTILITY.value: (1, int)}.get(kind)
    if where is None or len(frames) < 2:
        return None
    pos, typ = where
    fields = _leading_fields(bytes(frames[1].buffer if hasattr(frames[1], "buffer") else frames[1]), pos + 1)
    if fields is not None and len(fields) > pos and type(fields[pos]) is typ:
        return fields[pos]
    return None


_MSGPACK_INTS = {0xcc: ">B", 0xcd: ">H", 0xce: ">I", 0xcf: ">Q", 0xd0: ">b", 0xd1: ">h", 0xd2: ">i", 0xd3: ">q"}
_MSGPACK_STR_LENGTHS = {0xd9: ">B", 0xda: ">H", 0xdb: ">I"}


def _leading_fields(body: bytes, count: int) -> list | None:
    """The first `count` elements of the msgpack array `body` (fewer if it has fewer), read
    without the rest of it; None unless the body starts as an array whose elements up to
    there are ints or strings."""
    try:
        head = body[0]
        if 0x90 <= head <= 0x9f:
            length, at = head & 0x0f, 1
        elif head in (0xdc, 0xdd):
            fmt = ">H" if head == 0xdc else ">I"
            length, at = struct.unpack_from(fmt, body, 1)[0], 1 + struct.calcsize(fmt)
        else:
            return None
        fields = []
        for _ in range(min(count, length)):
            tag = body[at]
            if tag <= 0x7f or tag >= 0xe0:  # positive and negative fixint
                fields.append(tag if tag <= 0x7f else tag - 0x100)
                at += 1
            elif tag in _MSGPACK_INTS:
                fmt = _MSGPACK_INTS[tag]
                fields.append(struct.unpack_from(fmt, body, at + 1)[0])
                at += 1 + struct.calcsize(fmt)
            else:
                if 0xa0 <= tag <= 0xbf:
                    size, at = tag & 0x1f, at + 1
                elif tag in _MSGPACK_STR_LENGTHS:
                    fmt = _MSGPACK_STR_LENGTHS[tag]
                    size, at = struct.unpack_from(fmt, body, at + 1)[0], at + 1 + struct.calcsize(fmt)
                else:
                    return None
                if at + size > len(body):
                    return None
                fields.append(body[at:at + size].decode())
                at += size
        return fields
    except (IndexError, struct.error, UnicodeDecodeError):
        return None
