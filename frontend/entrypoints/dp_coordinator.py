"""The head's data-parallel coordinator (in the `loom serve` parent, on a thread): remote engine
cores register their handshake addresses over TCP, and the head's API servers read them over a
private ipc socket. The protocol and the peers' side of it are in ipc/data_parallel.py."""
from __future__ import annotations

import hmac
import logging
import secrets
import threading

import msgspec
import zmq

from ipc.auth import CurveServer, PeerGuard, auth_proof, derive_keys
from ipc.data_parallel import DP_HEAD_ROLE, DP_RANK_ROLE
from ipc.handshake import HANDSHAKE_MAX_MSG_BYTES
from ipc.messages import EngineRegistration, Hello, MsgType
from ipc.serial import Decoder, Encoder
from ipc.sockets import make_socket

logger = logging.getLogger(__name__)


class DPCoordinator:
    """The head's registry of remote engine cores: registered over TCP (with the key), read by the
    head's own API servers over a private ipc socket."""

    def __init__(self, rpc_address: str, lookup_address: str, remote_ranks: range, auth_key: str | None):
        self.ctx = zmq.Context()
        self.remote_ranks = remote_ranks
        self.auth_key = auth_key or None
        self.addresses: dict[int, str] = {}
        self.guard, auth = None, None
        if self.auth_key:   # only holders of the key complete the handshake
            self.guard = PeerGuard(self.ctx, "DP coordinator", (derive_keys(self.auth_key, DP_RANK_ROLE).public,))
            auth = CurveServer(derive_keys(self.auth_key, DP_HEAD_ROLE))
        # a port in use fails here
        self.rpc = make_socket(self.ctx, zmq.ROUTER, rpc_address, bind=True, auth=auth,
                               max_msg_size=HANDSHAKE_MAX_MSG_BYTES)
        self.lookup = make_socket(self.ctx, zmq.ROUTER, lookup_address, bind=True)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="dp-coordinator", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=2)
        if self.guard is not None:
            self.guard.close()
        self.ctx.destroy(linger=0)

    def _loop(self) -> None:
        enc, reg_dec = Encoder(), Decoder(EngineRegistration)
        nonces: dict[bytes, bytes] = {}
        waiting: list[bytes] = []            # API servers asking before every remote rank registered
        poller = zmq.Poller()
        poller.register(self.rpc, zmq.POLLIN)
        poller.register(self.lookup, zmq.POLLIN)
        while not self._stop.is_set():
            for sock, _ in poller.poll(200):
                frames = sock.recv_multipart(copy=False)
                if sock is self.lookup:
                    waiting.append(bytes(frames[0].buffer))
                else:
                    self._on_rpc(frames, enc, reg_dec, nonces)
            if waiting and len(self.addresses) == len(self.remote_ranks):
                body = msgspec.msgpack.encode(self.addresses)
                for identity in waiting:
                    self.lookup.send_multipart([identity, body])
                waiting.clear()

    def _on_rpc(self, frames, enc, reg_dec, nonces) -> None:
        identity, kind = bytes(frames[0].buffer), bytes(frames[1].buffer)
        if kind == MsgType.HELLO.value:
            if len(nonces) > 1024:   # knocks that never registered
                nonces.clear()
            nonces[identity] = nonce = secrets.token_bytes(32)
            self.rpc.send_multipart([identity, *enc.encode(MsgType.HELLO.value,
                                                           Hello(nonce, self.auth_key is not None))])
            return
        nonce = nonces.pop(identity, None)
        try:
            if kind != MsgType.REGISTER.value or nonce is None:
                raise PermissionError("say HELLO first")
            reg: EngineRegistration = reg_dec.decode(frames[1:])
            if self.auth_key is not None and not hmac.compare_digest(
                    reg.auth_proof, auth_proof(self.auth_key, nonce)):
                raise PermissionError("wrong engine auth key")
            if reg.engine_index not in self.remote_ranks:
                raise PermissionError(f"rank {reg.engine_index} is not a remote rank of this head "
                                      f"({self.remote_ranks.start}..{self.remote_ranks.stop - 1})")
            if reg.engine_index in self.addresses:
                raise PermissionError(f"rank {reg.engine_index} has already registered")
            if not reg.handshake_address.startswith("tcp://"):
                raise ValueError(f"not a tcp:// address: {reg.handshake_address!r}")
        except Exception as e:  # noqa: BLE001  (a bad peer is refused; the head keeps serving)
            logger.warning("refused a data-parallel engine: %s", e)
            self.rpc.send_multipart([identity, *enc.encode(MsgType.REFUSED.value, str(e))])
            return
        self.addresses[reg.engine_index] = reg.handshake_address
        logger.info("data-parallel rank %d registered (%s)", reg.engine_index, reg.handshake_address)
        self.rpc.send_multipart([identity, *enc.encode(MsgType.READY.value, None)])
