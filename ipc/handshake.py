"""The asking side of a handshake over a DEALER: HELLO, then one request, each answered.

Two peers use it (docs/protocol.md): an API server or router attaching to an engine core
(frontend/engine_client.py, `attach_handshake`), and a remote data-parallel rank registering with
the head (frontend/entrypoints/dp_coordinator.py, `register_with_head`).

Against a CURVE socket, a peer without the right key fails the ZMTP handshake, and libzmq drops
that connection for good: a DEALER left with no connection then blocks on send, and nothing
arrives. So the socket's monitor is attached before it connects (a handshake that fails first is
still reported), every send waits only while the connection can still come up, and a failed
handshake is a PermissionError at once rather than a hang or a timeout.
"""
from __future__ import annotations

import time

import zmq
from zmq.utils.monitor import parse_monitor_message

from ipc.auth import HANDSHAKE_FAILED, CurveClient
from ipc.sockets import close_socket, make_socket

HANDSHAKE_MAX_MSG_BYTES = 64 * 1024   # HELLO and ATTACH are small: anything bigger is dropped by libzmq


class HandshakeDealer:
    """One handshake's DEALER, with a context of its own; use it in a `with` block."""

    def __init__(self, address: str, auth: CurveClient | None, peer: str):
        """peer: who we ask ("the engine", "the head"), for the PermissionError when the ZMTP
        handshake fails."""
        self.refused = (f"{peer} refused our connection: wrong engine auth key, or a key on one side only "
                        "(--engine-auth-key / LOOM_ENGINE_AUTH_KEY)")
        self.ctx = zmq.Context()
        try:
            self.sock = make_socket(self.ctx, zmq.DEALER, address, bind=False, auth=auth, monitor=HANDSHAKE_FAILED)
        except BaseException:   # a bad address: make_socket left no socket, so nothing holds the context
            self.ctx.term()
            raise
        self.monitor = self.sock.get_monitor_socket()

    def __enter__(self) -> "HandshakeDealer":
        return self

    def __exit__(self, *exc) -> None:
        close_socket(self.sock, self.monitor)
        self.ctx.term()

    def ask(self, frames: list, timeout: float, what: str) -> list[zmq.Frame]:
        """Send frames, and return the answer. PermissionError as soon as the handshake fails;
        TimeoutError(what) when nothing comes within timeout seconds."""
        deadline = time.monotonic() + timeout
        self._wait(zmq.POLLOUT, deadline, what)
        self.sock.send_multipart(frames, zmq.NOBLOCK)
        self._wait(zmq.POLLIN, deadline, what)
        return self.sock.recv_multipart(copy=False)

    def _wait(self, event: int, deadline: float, what: str) -> None:
        poller = zmq.Poller()
        poller.register(self.sock, event)
        poller.register(self.monitor, zmq.POLLIN)
        while (left := deadline - time.monotonic()) > 0:
            ready = dict(poller.poll(left * 1000))
            if self.monitor in ready and self._handshake_failed():
                raise PermissionError(self.refused)
            if self.sock in ready:
                return
        raise TimeoutError(what)

    def _handshake_failed(self) -> bool:
        """The monitor's next event: whether it says the ZMTP (CURVE) handshake failed."""
        return bool(parse_monitor_message(self.monitor.recv_multipart())["event"] & HANDSHAKE_FAILED)
