"""ZMQ helpers: private ipc:// directories and socket construction."""
from __future__ import annotations

import os
import shutil
import socket
import tempfile
import time
from dataclasses import dataclass

import zmq


def make_ipc_dir() -> str:
    """A private (0700) directory for this run's ipc:// socket files."""
    return tempfile.mkdtemp(prefix="loom-ipc-")


def remove_ipc_dir(path: str | None) -> None:
    """Remove the directory; retried for up to a second, because a child still exiting can add a
    socket file while rmtree walks it (rmdir then fails with ENOTEMPTY)."""
    if not path:
        return
    for _ in range(50):
        shutil.rmtree(path, ignore_errors=True)
        if not os.path.exists(path):
            return
        time.sleep(0.02)


def ipc_address(ipc_dir: str, name: str) -> str:
    return f"ipc://{os.path.join(ipc_dir, name)}"


def make_socket(ctx: zmq.Context, kind: int, address: str, bind: bool, *,
                identity: bytes | None = None, linger: int = 0, auth=None,
                max_msg_size: int | None = None, sndhwm: int = 0, monitor: int = 0) -> zmq.Socket:
    """`auth`: an ipc/auth.py CurveServer / CurveClient, applied before bind / connect.
    `sndhwm`: messages queued before a send raises zmq.Again (0: no bound).
    `monitor`: the socket events to watch, from before it connects (a handshake can end before a
    monitor attached after connect() exists, and is then never reported); `sock.get_monitor_socket()`
    returns that monitor, and `close_socket(sock, monitor)` closes both.
    A bad address raises zmq.ZMQError and leaves no socket behind."""
    sock = ctx.socket(kind)
    sock.setsockopt(zmq.LINGER, linger)
    # Unbounded queues between our own processes: backpressure is the scheduler's job, and
    # dropping a message is a bug. (An attached client's outputs are bounded: client_io.py.)
    sock.setsockopt(zmq.SNDHWM, sndhwm)
    sock.setsockopt(zmq.RCVHWM, 0)
    if identity is not None:
        sock.setsockopt(zmq.IDENTITY, identity)
    if max_msg_size is not None:
        sock.setsockopt(zmq.MAXMSGSIZE, max_msg_size)
    if auth is not None:
        auth.apply(sock)
    if monitor:
        sock.get_monitor_socket(monitor)
    try:
        if bind:
            sock.bind(address)
        else:
            sock.connect(address)
    except BaseException:
        close_socket(sock, sock.get_monitor_socket() if monitor else None)
        raise
    return sock


def close_socket(sock: zmq.Socket, monitor: zmq.Socket | None = None) -> None:
    """Close a socket, and its monitor."""
    if monitor is not None:
        sock.disable_monitor()
        monitor.close(linger=0)
    sock.close(linger=0)


@dataclass
class Rendezvous:
    """Where the tensor-parallel ranks meet: the engine core's TCPStore (workers/distributed.py)."""
    host: str
    port: int
    world_size: int


def bind_rendezvous(host: str, port: int) -> socket.socket:
    """A socket listening on (host, port) (0: a free port) for the ranks' TCPStore. Bound before
    torch is imported, so the engine core starts its workers first and serves the store on this
    socket once it has imported torch (workers/distributed.serve_rendezvous); ranks that
    connect before that wait in the backlog."""
    family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][0]
    return socket.create_server((host, port), family=family, backlog=socket.SOMAXCONN)


def free_tcp_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]
