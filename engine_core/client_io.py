"""The engine core's side of its clients: input and output threads, the
handshake socket for clients attaching from elsewhere, and their departure.

Clients given at start-up (the API servers of `loom serve`, the offline LLM)
are connected at once. Others knock on the handshake ROUTER:

    client -> HELLO                   engine -> HELLO(nonce, auth_required)
    client -> ATTACH(addresses, proof) engine connects, READY on the client's input,
                                       and READY on the handshake socket as the answer
                                       (or REFUSED(reason) on the handshake socket)

The engine stamps every ADD and UTILITY with the index of the connection it
came on, so a client can only act as itself. A client whose connection drops
is reported as ("CLIENT_GONE", index) on the input queue.
"""
from __future__ import annotations

import hashlib
import hmac
import itertools
import logging
import queue
import secrets
import threading

import zmq
from zmq.utils.monitor import parse_monitor_message

from ipc.messages import AttachRequest, EngineCoreRequest, EngineReady, Hello, MsgType, UtilityRequest
from ipc.serial import Decoder, Encoder
from ipc.sockets import make_socket

logger = logging.getLogger(__name__)
CLIENT_GONE = b"client-gone"


def auth_proof(key: str, nonce: bytes) -> str:
    return hmac.new(key.encode(), nonce, hashlib.sha256).hexdigest()


class ClientIO:
    def __init__(self, ready: EngineReady, inputs: queue.Queue, clients: list[tuple[str, str]],
                 handshake_address: str | None = None, auth_key: str | None = None):
        self.ctx = zmq.Context()
        self.ready = ready
        self.inputs = inputs
        self.static_clients = clients
        self.handshake_address = handshake_address
        self.auth_key = auth_key or None
        self.outputs: queue.Queue = queue.Queue()
        self._indices = itertools.count()
        self.live: set[int] = set()          # client indices connected now
        self._stop = threading.Event()
        self._in = threading.Thread(target=self._input_loop, name="engine-input", daemon=True)
        self._out = threading.Thread(target=self._output_loop, name="engine-output", daemon=True)
        self._handshake = None
        if handshake_address:  # bind now, so a bad address fails start-up
            self._handshake = make_socket(self.ctx, zmq.ROUTER, handshake_address, bind=True)

    @property
    def handshake_endpoint(self) -> str | None:
        """The handshake address as bound (a "tcp://host:*" address picks a free port)."""
        return self._handshake.getsockopt_string(zmq.LAST_ENDPOINT) if self._handshake is not None else None

    def start(self) -> None:
        self._out.start()
        self._in.start()

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
        self.outputs.put(None)
        self._in.join(timeout=2)
        self._out.join(timeout=2)
        self.ctx.destroy(linger=0)

    # ------------------------------------------------------------ input thread

    def _input_loop(self) -> None:
        enc = Encoder()
        decoders = {MsgType.ADD.value: Decoder(EngineCoreRequest), MsgType.ABORT.value: Decoder(list[str]),
                    MsgType.UTILITY.value: Decoder(UtilityRequest)}
        attach_dec = Decoder(AttachRequest)
        poller = zmq.Poller()
        by_sock: dict[zmq.Socket, int] = {}
        monitors: dict[zmq.Socket, tuple[int, zmq.Socket, list]] = {}
        nonces: dict[bytes, bytes] = {}

        def connect(input_addr: str, output_addr: str, watch: bool) -> None:
            idx = next(self._indices)
            sock = make_socket(self.ctx, zmq.DEALER, input_addr, bind=False)
            self.outputs.put(("connect", idx, output_addr))
            ready = EngineReady(**{f: getattr(self.ready, f) for f in self.ready.__struct_fields__})
            ready.client_index = idx
            sock.send_multipart(enc.encode(MsgType.READY.value, ready))
            poller.register(sock, zmq.POLLIN)
            by_sock[sock] = idx
            self.live.add(idx)
            if watch:  # attached clients may go away; local ones are watched by their parent
                mon = sock.get_monitor_socket(zmq.EVENT_HANDSHAKE_SUCCEEDED | zmq.EVENT_DISCONNECTED)
                monitors[mon] = (idx, sock, [False])
                poller.register(mon, zmq.POLLIN)
            return ready

        for input_addr, output_addr in self.static_clients:
            connect(input_addr, output_addr, watch=False)
        if self._handshake is not None:
            poller.register(self._handshake, zmq.POLLIN)

        while not self._stop.is_set():
            for sock, _ in poller.poll(200):
                if sock is self._handshake:
                    self._on_handshake(sock, enc, attach_dec, nonces, connect)
                elif sock in monitors:
                    idx, dealer, connected = monitors[sock]
                    event = parse_monitor_message(sock.recv_multipart())["event"]
                    if event == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                        connected[0] = True
                    elif event == zmq.EVENT_DISCONNECTED and connected[0]:
                        logger.info("client %d disconnected; aborting its requests", idx)
                        poller.unregister(sock)
                        poller.unregister(dealer)
                        del monitors[sock], by_sock[dealer]
                        dealer.disable_monitor()
                        sock.close(linger=0)
                        dealer.close(linger=0)
                        self.live.discard(idx)
                        self.outputs.put(("disconnect", idx, None))
                        self.inputs.put((CLIENT_GONE, idx))
                else:
                    self._on_client_message(sock, by_sock[sock], decoders)

    def _on_client_message(self, sock: zmq.Socket, idx: int, decoders: dict) -> None:
        frames = sock.recv_multipart(copy=False)
        kind = bytes(frames[0].buffer)
        try:
            msg = decoders[kind].decode(frames)
        except Exception as e:  # a malformed message fails alone
            logger.warning("client %d: dropping a malformed %r message: %s", idx, kind, e)
            return
        if kind in (MsgType.ADD.value, MsgType.UTILITY.value):
            msg.client_index = idx
        self.inputs.put((kind, msg))

    def _on_handshake(self, sock, enc, attach_dec, nonces, connect) -> None:
        frames = sock.recv_multipart(copy=False)
        identity, kind = bytes(frames[0].buffer), bytes(frames[1].buffer)
        if kind == MsgType.HELLO.value:
            nonce = secrets.token_bytes(32)
            nonces[identity] = nonce
            sock.send_multipart([identity, *enc.encode(MsgType.HELLO.value,
                                                       Hello(nonce, self.auth_key is not None, self.ready.model))])
            return
        nonce = nonces.pop(identity, None)
        try:
            if kind != MsgType.ATTACH.value or nonce is None:
                raise PermissionError("say HELLO first")
            req: AttachRequest = attach_dec.decode(frames[1:])
            if self.auth_key is not None and not hmac.compare_digest(
                    req.auth_proof, auth_proof(self.auth_key, nonce)):
                raise PermissionError("wrong engine auth key")
        except Exception as e:
            logger.warning("refused a client: %s", e)
            sock.send_multipart([identity, *enc.encode(MsgType.REFUSED.value, str(e))])
            return
        ready = connect(req.input_address, req.output_address, watch=True)
        sock.send_multipart([identity, *enc.encode(MsgType.READY.value, ready)])

    # ------------------------------------------------------------ output thread

    def _output_loop(self) -> None:
        enc = Encoder()
        socks: dict[int, zmq.Socket] = {}
        while True:
            item = self.outputs.get()
            if item is None:
                break
            target, kind, msg = item
            if target == "connect":
                socks[kind] = make_socket(self.ctx, zmq.PUSH, msg, bind=False, linger=2000)
                continue
            if target == "disconnect":
                sock = socks.pop(kind, None)
                if sock is not None:
                    sock.close(linger=0)
                continue
            frames = enc.encode(kind, msg)
            for idx in (list(socks) if target < 0 else [target]):
                if idx in socks:
                    socks[idx].send_multipart(frames, copy=False)
        for sock in socks.values():
            sock.close()
