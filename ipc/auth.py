"""Authenticated ZMQ sockets over TCP: CurveZMQ keys, and a ZAP handler that admits only known peers.

Every TCP socket that carries engine traffic is a CURVE socket (docs/protocol.md, "Threat model"):

- the engine's handshake ROUTER, when the engine has an `--engine-auth-key`: its keys, and the
  one key its clients may hold, are derived from that key (`derive_keys`), so only holders of
  the key can complete the ZMTP handshake at all;
- the input ROUTER and output PULL that a client binds when it attaches from elsewhere: fresh
  keys per client (`new_keys`); the engine learns the client's public key in ATTACH and the
  client admits only the engine's public key, learned in HELLO.

A peer that fails the handshake never gets a frame to our code: libzmq drops the connection.
`PeerGuard` (the ZAP handler of one context) counts and logs the peers it refuses;
`HandshakeWatch` counts and logs the failed handshakes a socket's monitor reports (peers that
do not speak CURVE, or do not know the server key, are refused by libzmq before ZAP).
"""
from __future__ import annotations

import hashlib
import hmac
import logging
import time
from dataclasses import dataclass

import zmq
from zmq.auth.thread import ThreadAuthenticator
from zmq.utils import z85

logger = logging.getLogger(__name__)

# Monitor events of a failed handshake (the socket then drops the connection).
HANDSHAKE_FAILED = (zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
                    | zmq.EVENT_HANDSHAKE_FAILED_AUTH)


@dataclass(frozen=True)
class CurveKeys:
    public: bytes   # z85, 40 bytes
    secret: bytes   # z85, 40 bytes


def derive_keys(auth_key: str, role: str) -> CurveKeys:
    """A Curve25519 key pair that every holder of `auth_key` derives alike (HKDF-SHA256, RFC 5869,
    with the role as info), so that the key alone is all a deployment distributes."""
    prk = hmac.new(b"loom-curve-v1", auth_key.encode(), hashlib.sha256).digest()
    raw = hmac.new(prk, role.encode() + b"\x01", hashlib.sha256).digest()
    secret = z85.encode(raw)
    return CurveKeys(zmq.curve_public(secret), secret)


def new_keys() -> CurveKeys:
    public, secret = zmq.curve_keypair()
    return CurveKeys(public, secret)


# Roles of the keys derived from --engine-auth-key.
ENGINE_ROLE, CLIENT_ROLE = "loom-engine", "loom-client"


@dataclass(frozen=True)
class CurveServer:
    """A socket that accepts CURVE clients (set before bind)."""
    keys: CurveKeys

    def apply(self, sock: zmq.Socket) -> None:
        sock.curve_secretkey = self.keys.secret
        sock.curve_publickey = self.keys.public
        sock.curve_server = True


@dataclass(frozen=True)
class CurveClient:
    """A socket that talks CURVE to a server whose public key it knows (set before connect)."""
    keys: CurveKeys
    server_public: bytes

    def apply(self, sock: zmq.Socket) -> None:
        sock.curve_secretkey = self.keys.secret
        sock.curve_publickey = self.keys.public
        sock.curve_serverkey = self.server_public


LOG_EVERY_S = 10.0   # a peer can fail handshakes at will: one line per this, with the running count


class _EveryFew:
    """Whether to log now: the first time, then at most once per LOG_EVERY_S."""

    def __init__(self):
        self._next = 0.0

    def __call__(self) -> bool:
        now = time.monotonic()
        if now < self._next:
            return False
        self._next = now + LOG_EVERY_S
        return True


class PeerGuard:
    """The ZAP handler of one ZMQ context: CURVE peers whose public key was `allow`ed get in,
    others are refused, counted and logged. Sockets of the context without CURVE are not
    affected (libzmq asks ZAP about NULL-mechanism peers only when a ZAP domain is set)."""

    def __init__(self, ctx: zmq.Context, name: str, allowed: tuple[bytes, ...] = ()):
        self.name = name
        self.allowed: set[bytes] = set(allowed)
        self.refused = 0
        self._log_now = _EveryFew()
        # ThreadAuthenticator needs a blocking context: a shadow of an asyncio one shares its ZAP endpoint.
        sync_ctx = ctx if type(ctx) is zmq.Context else zmq.Context(shadow=ctx.underlying)
        self._auth = ThreadAuthenticator(sync_ctx, log=logging.getLogger(__name__ + ".zap"))
        self._auth.start()
        self._auth.configure_curve_callback("*", credentials_provider=self)

    def allow(self, public: bytes) -> None:
        self.allowed.add(public)

    def callback(self, domain: str, client_key: bytes) -> bool:
        """ThreadAuthenticator's credentials provider (runs in its thread)."""
        if client_key in self.allowed:
            return True
        self.refused += 1
        if self._log_now():
            logger.warning("%s: refused a peer with an unknown CURVE key (%d refused so far)", self.name, self.refused)
        return False

    def close(self) -> None:
        self._auth.stop()


class HandshakeWatch:
    """Counts and logs the failed handshakes that a socket monitor reports."""

    def __init__(self, name: str):
        self.name = name
        self.failed = 0
        self._log_now = _EveryFew()

    def note(self, event: int) -> bool:
        """True if `event` was a failed handshake (the DISCONNECTED that follows it is that peer's)."""
        if not event & HANDSHAKE_FAILED:
            return False
        self.failed += 1
        if self._log_now():
            logger.warning("%s: dropped a peer that failed the handshake (%d so far)", self.name, self.failed)
        return True


def auth_proof(key: str, nonce: bytes) -> str:
    """The HMAC a peer sends back for a handshake's nonce: proof that it holds the key."""
    return hmac.new(key.encode(), nonce, hashlib.sha256).hexdigest()


# CURVE roles of the TP broadcast ring's remote readers (shm/broadcast_ring.py), keys from the auth key
RING_ROLE, READER_ROLE = "loom-tp-ring", "loom-tp-reader"


def ring_curve_server(auth_key: str | None) -> CurveServer | None:
    """The ring's overflow/remote socket on the engine core's side; None without a key."""
    return CurveServer(derive_keys(auth_key, RING_ROLE)) if auth_key else None


def ring_curve_client(auth_key: str | None) -> CurveClient | None:
    """A remote ring reader's (a worker on another node) side; None without a key."""
    if not auth_key:
        return None
    return CurveClient(derive_keys(auth_key, READER_ROLE), derive_keys(auth_key, RING_ROLE).public)
