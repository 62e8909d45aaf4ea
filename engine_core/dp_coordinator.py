"""Data parallelism across nodes: how engine cores on other nodes join the head's API servers.

    remote engine core  -> HELLO                         head (DP coordinator, --data-parallel-rpc-port)
                        <- Hello(nonce, auth_required)
                        -> REGISTER(rank, handshake address, HMAC(key, nonce))
                        <- READY | REFUSED(reason)
    head's API servers  -> (private ipc socket) which ranks are where?   <- {rank: handshake address}
    head's API servers  -> the usual attach handshake at each address, with the same key (client_io.py)

So a remote engine is attached exactly as `--engine-address` attaches one: the engine checks the
API server's key, and the coordinator checks the engine's key before any API server trusts the
address it gave. With a key, the rpc port is a CURVE socket (ipc/auth.py) whose keys derive from
it, so a peer without the key never gets a frame to the coordinator; the HMAC proof is checked
on top. The coordinator lives in the head's `loom serve` parent, on a thread.
"""
from __future__ import annotations

import dataclasses
import hmac
import logging
import os
import secrets
import threading

import msgspec
import zmq

from engine_core.client_io import HANDSHAKE_MAX_MSG_BYTES, auth_proof
from ipc.auth import CurveClient, CurveServer, PeerGuard, derive_keys
from ipc.handshake import HandshakeDealer
from ipc.messages import EngineRegistration, Hello, MsgType
from ipc.serial import Decoder, Encoder
from ipc.sockets import make_socket

logger = logging.getLogger(__name__)

# Roles of the CURVE keys derived from --engine-auth-key for the rpc port.
DP_HEAD_ROLE, DP_RANK_ROLE = "loom-dp-head", "loom-dp-rank"


@dataclasses.dataclass
class DPRank:
    """Where one engine core stands among the data-parallel ranks."""
    rank: int                            # its engine index, 0 .. data_parallel_size - 1
    local_rank: int                      # its index among the engines of this node (picks its GPUs)
    register_address: str | None = None  # the head's rpc port, for an engine on another node


def select_devices(local_rank: int, tp_size: int) -> None:
    """Each rank sees only its own GPUs: the local_rank-th group of tp_size among those visible."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    ids = [d for d in visible.split(",") if d] if visible else None
    first = local_rank * tp_size
    if ids is None:
        mine = [str(i) for i in range(first, first + tp_size)]
    else:
        mine = ids[first:first + tp_size]
        if len(mine) < tp_size:
            raise RuntimeError(f"data-parallel local rank {local_rank} needs GPUs {first}..{first + tp_size - 1} "
                               f"of CUDA_VISIBLE_DEVICES={visible}")
    os.environ["CUDA_VISIBLE_DEVICES"] = ",".join(mine)


def register_with_head(head_address: str, rank: int, handshake_address: str, auth_key: str | None,
                       timeout: float = 900.0) -> None:
    """From a remote engine core, once it is ready: tell the head where to attach."""
    auth = None
    if auth_key:
        auth = CurveClient(derive_keys(auth_key, DP_RANK_ROLE), derive_keys(auth_key, DP_HEAD_ROLE).public)
    enc = Encoder()
    with HandshakeDealer(head_address, auth, "the head") as dealer:
        frames = dealer.ask(enc.encode(MsgType.HELLO.value, None), timeout,
                            f"the head's DP coordinator did not answer at {head_address}")
        hello: Hello = Decoder(Hello).decode(frames)
        if hello.auth_required and not auth_key:
            raise PermissionError("the head requires an auth key (--engine-auth-key / LOOM_ENGINE_AUTH_KEY)")
        proof = auth_proof(auth_key, hello.nonce) if auth_key else ""
        frames = dealer.ask(enc.encode(MsgType.REGISTER.value, EngineRegistration(rank, handshake_address, proof)),
                            timeout, f"the head's DP coordinator at {head_address} did not answer the registration")
        if bytes(frames[0].buffer) == MsgType.REFUSED.value:
            raise PermissionError(f"the head refused data-parallel rank {rank}: "
                                  f"{msgspec.msgpack.decode(frames[1].buffer)}")


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


def lookup_remote_engines(lookup_address: str, timeout: float = 900.0) -> dict[int, str]:
    """In a head API server: the handshake addresses of every remote rank, once all have registered."""
    ctx = zmq.Context()
    sock = make_socket(ctx, zmq.DEALER, lookup_address, bind=False)
    try:
        sock.send(b"")
        if not sock.poll(timeout * 1000):
            raise TimeoutError(f"the remote data-parallel ranks did not all register in {timeout:.0f}s")
        return {int(k): v for k, v in msgspec.msgpack.decode(sock.recv()).items()}
    finally:
        sock.close(linger=0)
        ctx.term()
