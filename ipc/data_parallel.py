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
on top. The coordinator lives in the head's `loom serve` parent, on a thread
(frontend/entrypoints/dp_coordinator.py); this module holds what its peers share: where a rank
stands, how a remote engine core registers, and how a head API server looks the ranks up.
"""
from __future__ import annotations

import dataclasses
import os

import msgspec
import zmq

from ipc.auth import CurveClient, auth_proof, derive_keys
from ipc.handshake import HandshakeDealer
from ipc.messages import EngineRegistration, Hello, MsgType
from ipc.serial import Decoder, Encoder
from ipc.sockets import make_socket

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
