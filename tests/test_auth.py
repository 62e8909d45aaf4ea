"""Authenticated engine sockets (ipc/auth.py, docs/protocol.md "Threat model"): raw ZMQ peers
without the key send garbage and forged messages to every TCP socket that carries engine traffic;
nothing changes and the legitimate clients keep working. Malformed handshakes fail alone, the
handshake socket's resources are bounded and HELLO reveals nothing.

The handshake and client-socket properties are checked in process against the engine's real
ClientIO (no model needed); one module-scoped headless engine with an attached `loom serve`
checks the API server's sockets."""
from __future__ import annotations

import logging
import queue
import subprocess
import time

import msgspec
import pytest
import requests
import zmq

from engine_core import client_io
from frontend.engine_client import EngineCoreClient
from engine_core.client_io import ClientIO
from ipc.auth import CLIENT_ROLE, ENGINE_ROLE, CurveClient, derive_keys, new_keys
from ipc.handshake import HandshakeDealer
from ipc.messages import (AttachRequest, EngineCoreOutput, EngineCoreOutputs, EngineCoreRequest, EngineReady,
                          Hello, MsgType)
from ipc.sampling_params import SamplingParams
from ipc.serial import Encoder
from ipc.sockets import free_tcp_port, make_socket
from tests.conftest import Server, child_pids, popen_serve

KEY = "test-auth-key"
ENC = Encoder()
MODEL_PATH = "/very/secret/model/path"


def _frames(kind: MsgType, msg) -> list:
    return [bytes(f) for f in ENC.encode(kind.value, msg)]


def _forgeries() -> list[list[bytes]]:
    """Garbage and well-formed messages of every type a peer could forge."""
    out = EngineCoreOutputs([EngineCoreOutput("forged", [1, 2, 3], "stop")], 0, 0.0)
    add = EngineCoreRequest("forged-add", [1, 2, 3], SamplingParams(max_tokens=2))
    return [[b"\xff" * 64], [b"\x05", b"garbage"], _frames(MsgType.ENGINE_DEAD, "forged death"),
            _frames(MsgType.OUTPUTS, out), _frames(MsgType.ADD, add), _frames(MsgType.ABORT, ["x"]),
            [b""], [b"\x04"]]


def _spray(sock: zmq.Socket, messages: list[list[bytes]]) -> None:
    """Send without blocking: a peer whose handshake was refused may have no pipe to queue on."""
    for frames in messages:
        try:
            sock.send_multipart(frames, flags=zmq.NOBLOCK)
        except zmq.Again:
            pass


def _handshake_dealer(ctx, address: str, key: str | None) -> zmq.Socket:
    auth = CurveClient(derive_keys(key, CLIENT_ROLE), derive_keys(key, ENGINE_ROLE).public) if key else None
    return make_socket(ctx, zmq.DEALER, address, bind=False, auth=auth)


def _ask(sock: zmq.Socket, frames: list, timeout: float = 3.0) -> list[bytes] | None:
    sock.send_multipart(frames)
    if not sock.poll(timeout * 1000):
        return None
    return sock.recv_multipart()


def _hello(sock) -> Hello:
    reply = _ask(sock, _frames(MsgType.HELLO, None))
    assert reply is not None and reply[0] == MsgType.HELLO.value, reply
    return msgspec.msgpack.decode(reply[1], type=Hello)


def _attach_raw(sock, req: AttachRequest) -> tuple[bytes, object]:
    _hello(sock)
    reply = _ask(sock, _frames(MsgType.ATTACH, req))
    assert reply is not None, "no answer to ATTACH"
    return reply[0], msgspec.msgpack.decode(reply[1])


@pytest.fixture(scope="module", params=[None, KEY], ids=["no-key", "key"])
def engine_io(request):
    """The engine's real client I/O (no model): what ADD / ABORT reach the engine lands in `inputs`."""
    address = f"tcp://127.0.0.1:{free_tcp_port()}"
    inputs: queue.Queue = queue.Queue()
    io = ClientIO(EngineReady(128, 10, 16, 0, MODEL_PATH), inputs, [], address, request.param)
    io.start()
    ctx = zmq.Context()
    client = EngineCoreClient.attach(address, request.param, timeout=10)
    _wait_until_connected(io)
    try:
        yield address, io, inputs, request.param, client, ctx
    finally:
        client.close()
        ctx.destroy(linger=0)
        io.close()


def _wait_until_connected(io: ClientIO) -> None:
    """The engine counts an attached client as connected once its input thread reads the
    socket monitor's handshake event, a moment after the client's READY: tests that count
    unconnected attaches start after that (a loaded CI machine once saw the gap)."""
    deadline = time.monotonic() + 10
    while any(not w.connected for w in list(io._watched.values())):
        assert time.monotonic() < deadline, "the attached client never counted as connected"
        time.sleep(0.01)


def _roundtrip(io: ClientIO, inputs: queue.Queue, client: EngineCoreClient, tag: str) -> None:
    """The legitimate client still works both ways: its ADD reaches the engine, outputs reach it."""
    while not inputs.empty():
        inputs.get_nowait()
    client.add_request(EngineCoreRequest(tag, [1, 2], SamplingParams(max_tokens=1)))
    kind, msg = inputs.get(timeout=5)
    assert kind == MsgType.ADD.value and msg.request_id == tag and msg.client_index == client.client_index
    assert inputs.empty(), "something besides the client's own ADD reached the engine"
    io.send(client.client_index, MsgType.OUTPUTS.value,
            EngineCoreOutputs([EngineCoreOutput(tag, [7], "length")], 0, time.time()))
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        outs = client.get_outputs(timeout=1)
        if outs is not None and any(o.request_id == tag for o in outs.outputs):
            assert not client.is_dead
            return
    raise AssertionError("the legitimate client got no output")


def test_hello_reveals_nothing(engine_io):
    address, io, _, key, _, ctx = engine_io
    sock = _handshake_dealer(ctx, address, key)
    try:
        reply = _ask(sock, _frames(MsgType.HELLO, None))
        assert reply is not None
        assert MODEL_PATH.encode() not in b"".join(reply)
        hello = msgspec.msgpack.decode(reply[1], type=Hello)
        assert hello.model == "" and hello.auth_required == (key is not None)
        assert hello.engine_public_key == io.keys.public
    finally:
        sock.close(linger=0)


BAD_ATTACHES = [
    AttachRequest("tcp://[::1", "tcp://127.0.0.1:1", "", new_keys().public),
    AttachRequest("nonsense", "nonsense", "", new_keys().public),
    AttachRequest("tcp://127.0.0.1:notaport", "tcp://127.0.0.1:1", "", new_keys().public),
    AttachRequest("tcp://127.0.0.1:1", "tcp://", "", new_keys().public),
    AttachRequest("tcp://" + "x" * 5000 + ":1", "tcp://127.0.0.1:1", "", new_keys().public),
    AttachRequest("inproc://anything", "inproc://else", "", b""),
    AttachRequest("tcp://127.0.0.1:1", "tcp://127.0.0.1:2", "", b""),          # tcp:// without a CURVE key
    AttachRequest("tcp://127.0.0.1:1", "tcp://127.0.0.1:2", "", b"short key"),
]


def test_malformed_handshakes_fail_alone(engine_io):
    """Each bad ATTACH gets REFUSED; the attached client keeps working and new clients can attach."""
    address, io, inputs, key, client, ctx = engine_io
    from ipc.auth import auth_proof
    sock = _handshake_dealer(ctx, address, key)
    try:
        for bad in BAD_ATTACHES:
            hello = _hello(sock)
            bad.auth_proof = auth_proof(key, hello.nonce) if key else ""
            reply = _ask(sock, _frames(MsgType.ATTACH, bad))
            assert reply is not None and reply[0] == MsgType.REFUSED.value, (bad, reply)
        for junk in ([MsgType.ATTACH.value, b"\xc1garbage"], [MsgType.ATTACH.value], [b"\x7f", b"x"], [b""]):
            _hello(sock)
            reply = _ask(sock, junk)
            assert reply is not None and reply[0] == MsgType.REFUSED.value, (junk, reply)
        # ATTACH without a HELLO first
        reply = _ask(sock, _frames(MsgType.ATTACH, AttachRequest("ipc:///tmp/x", "ipc:///tmp/y")))
        assert reply[0] == MsgType.REFUSED.value and b"HELLO" in reply[1]
    finally:
        sock.close(linger=0)
    assert io.healthy()
    _roundtrip(io, inputs, client, "after-bad-handshakes")
    second = EngineCoreClient.attach(address, key, timeout=10)
    try:
        _roundtrip(io, inputs, second, "second-client")
    finally:
        second.close()


def test_handshake_bounds(engine_io, monkeypatch):
    """Pending nonces are capped and expire; an oversized message is dropped by libzmq."""
    address, io, inputs, key, client, ctx = engine_io
    socks = [_handshake_dealer(ctx, address, key) for _ in range(5)]
    nowhere = _frames(MsgType.ATTACH, AttachRequest("ipc:///nowhere/a", "ipc:///nowhere/b"))
    try:
        monkeypatch.setattr(client_io, "HELLO_TTL_S", 0.3)
        _hello(socks[0])
        time.sleep(0.5)
        _hello(socks[1])   # any handshake message purges what has expired
        refused = _ask(socks[0], nowhere)
        assert refused[0] == MsgType.REFUSED.value and b"HELLO" in refused[1]   # its nonce expired
        monkeypatch.setattr(client_io, "HELLO_TTL_S", 30.0)
        monkeypatch.setattr(client_io, "MAX_PENDING_HELLOS", 3)
        for s in socks:
            _hello(s)
        assert len(io.pending_hellos) <= 3
        refused = _ask(socks[0], nowhere)
        assert refused[0] == MsgType.REFUSED.value and b"HELLO" in refused[1]   # its nonce was evicted
        # a message beyond the handshake socket's MAXMSGSIZE: dropped with its connection, no answer
        assert _ask(socks[3], [MsgType.HELLO.value, b"x" * (client_io.HANDSHAKE_MAX_MSG_BYTES + 1)], 1.0) is None
        assert _hello(socks[4]).nonce
    finally:
        for s in socks:
            s.close(linger=0)
    _roundtrip(io, inputs, client, "after-bounds")


def test_attaches_whose_sockets_never_connect_are_bounded_per_peer(engine_io, monkeypatch):
    """Each ATTACH whose sockets never connect (a listener that never answers: the TCP connect
    succeeds, ZMQ's handshake never does) holds three engine sockets that retry for
    ATTACH_CONNECT_TIMEOUT_S: past MAX_UNCONNECTED_PER_PEER one peer's next is refused, and the
    attached client keeps working."""
    import socket as pysocket

    address, io, inputs, key, client, ctx = engine_io
    from ipc.auth import auth_proof
    monkeypatch.setattr(client_io, "MAX_UNCONNECTED_PER_PEER", 2)
    silent = pysocket.socket()
    silent.bind(("127.0.0.1", 0))
    silent.listen(64)   # never accepted, never answered
    port = silent.getsockname()[1]
    sock = _handshake_dealer(ctx, address, key)
    try:
        replies = []
        for i in range(3):
            hello = _hello(sock)
            req = AttachRequest(f"tcp://127.0.0.1:{port}", f"tcp://127.0.0.1:{port}",
                                auth_proof(key, hello.nonce) if key else "", b"0" * 40)
            replies.append(_ask(sock, _frames(MsgType.ATTACH, req)))
        assert [r[0] for r in replies] == [MsgType.READY.value] * 2 + [MsgType.REFUSED.value]
        assert b"this peer's" in replies[2][1]
    finally:
        sock.close(linger=0)
        silent.close()   # now their connections are refused: dropped at once
    _wait_until_connected(io)
    _roundtrip(io, inputs, client, "after-unconnected-attaches")


def test_an_attach_flood_to_refusing_addresses_keeps_no_one_out(engine_io):
    """Issue 54: 40 attaches to addresses where nothing listens are dropped as their connects are
    refused (not after 30 s), so a legitimate EngineCoreClient.attach succeeds within 2 s."""
    address, io, inputs, key, client, ctx = engine_io
    from ipc.auth import auth_proof
    sock = _handshake_dealer(ctx, address, key)
    try:
        for i in range(40):
            hello = _hello(sock)
            req = AttachRequest(f"ipc:///nowhere/in{i}", f"ipc:///nowhere/out{i}",
                                auth_proof(key, hello.nonce) if key else "")
            _ask(sock, _frames(MsgType.ATTACH, req))
    finally:
        sock.close(linger=0)
    t0 = time.monotonic()
    other = EngineCoreClient.attach(address, key, timeout=2)
    try:
        assert time.monotonic() - t0 < 2.0
    finally:
        other.close()
    deadline = time.monotonic() + 10
    while other.client_index in io.live:   # its going reaches the engine (and `inputs`) first
        assert time.monotonic() < deadline
        time.sleep(0.01)
    _wait_until_connected(io)
    _roundtrip(io, inputs, client, "after-flood")


def test_no_key_gets_nothing_from_a_keyed_engine(engine_io):
    address, io, inputs, key, client, ctx = engine_io
    if key is None:
        pytest.skip("the engine has no key: any local peer may attach (docs/protocol.md)")
    failed_before = io.handshake_watch.failed
    refused_before = io._guard.refused
    plain = _handshake_dealer(ctx, address, None)
    wrong = _handshake_dealer(ctx, address, "wrong key")
    # knows the engine's (derived) server key but not the client key: refused by the ZAP handler
    zap = make_socket(ctx, zmq.DEALER, address, bind=False,
                      auth=CurveClient(new_keys(), derive_keys(key, ENGINE_ROLE).public))
    try:
        for s in (plain, wrong, zap):
            _spray(s, [_frames(MsgType.HELLO, None), *_forgeries()])
            assert not s.poll(1000), "a peer without the key got an answer"
    finally:
        for s in (plain, wrong, zap):
            s.close(linger=0)
    with pytest.raises(PermissionError):
        EngineCoreClient.attach(address, None, timeout=5)
    with pytest.raises(PermissionError):
        EngineCoreClient.attach(address, "wrong key", timeout=5)
    assert io.handshake_watch.failed > failed_before and io._guard.refused > refused_before
    assert inputs.empty()
    _roundtrip(io, inputs, client, "after-no-key")


def test_a_handshake_that_failed_before_the_first_send_is_refused_at_once(engine_io):
    """A keyless attach to a keyed engine, whose ZMTP handshake has already failed when the HELLO
    is sent (a slow thread between connect and send; a CI run hung here). libzmq then reports no
    event to a monitor attached after connect(), and may hold no connection, so a send blocked
    forever; HandshakeDealer watches from before it connects and sends only to a connection."""
    address, io, inputs, key, client, ctx = engine_io
    if key is None:
        pytest.skip("the engine has no key: any local peer may attach (docs/protocol.md)")
    for delay in (0.3, 1.0):
        start = time.monotonic()
        with HandshakeDealer(address, None, "the engine") as dealer:
            time.sleep(delay)
            with pytest.raises(PermissionError):
                dealer.ask(_frames(MsgType.HELLO, None), 5, "no answer")
        assert time.monotonic() - start < delay + 2, "the failed handshake was not reported at once"
    _roundtrip(io, inputs, client, "after-late-send")


def test_failed_handshakes_log_a_line_per_interval(engine_io, caplog):
    """A peer without the key can fail handshakes as fast as it connects: each is counted, but
    they are logged once per LOG_EVERY_S with the count, not a line each."""
    address, io, inputs, key, client, ctx = engine_io
    if key is None:
        pytest.skip("the engine has no key: any local peer may attach (docs/protocol.md)")
    before = io.handshake_watch.failed
    with caplog.at_level(logging.WARNING, logger="ipc.auth"):
        for _ in range(30):
            s = _handshake_dealer(ctx, address, "wrong key")
            _spray(s, [_frames(MsgType.HELLO, None)])
            s.close(linger=0)
        deadline = time.monotonic() + 10
        while io.handshake_watch.failed < before + 30 and time.monotonic() < deadline:
            time.sleep(0.05)
    assert io.handshake_watch.failed >= before + 30
    assert len([r for r in caplog.records if "failed the handshake" in r.getMessage()]) <= 1
    _roundtrip(io, inputs, client, "after-log-flood")


def test_forged_frames_to_an_attached_client(engine_io):
    """The client's own tcp:// ROUTER and PULL: peers without the engine's key are dropped, counted
    and logged; a forged ENGINE_DEAD or OUTPUTS never reaches the client."""
    address, io, inputs, key, client, ctx = engine_io
    peers = []
    for target, kind in ((client.input_address, zmq.DEALER), (client.output_address, zmq.PUSH)):
        peers.append(make_socket(ctx, kind, target, bind=False))   # no CURVE at all
        peers.append(make_socket(ctx, kind, target, bind=False,    # knows the client's key, not the engine's
                                 auth=CurveClient(new_keys(), client.keys.public)))
    for p in peers:
        _spray(p, _forgeries())
    time.sleep(1.0)
    for _ in range(5):
        assert client.get_outputs(timeout=0.2) is None   # nothing forged arrives
    assert not client.is_dead
    for p in peers:
        p.close(linger=0)
    time.sleep(0.3)
    assert client.get_outputs(timeout=0.3) is None and not client.is_dead   # their departure is not the engine's
    assert client.guard.refused >= 2 and client.handshake_watch.failed >= 2
    _roundtrip(io, inputs, client, "after-forgeries")


# ------------------------------------------------------------------ a real attached API server

def _listening_tcp_ports(pid: int) -> set[int]:
    out = subprocess.run(["ss", "-Hltnp"], capture_output=True, text=True).stdout
    return {int(line.split()[3].rsplit(":", 1)[1]) for line in out.splitlines() if f"pid={pid}," in line}


@pytest.fixture(scope="module")
def attached_server(tiny_model_dir):
    """A headless engine with a key, and a `loom serve` whose API server attaches to it."""
    address = f"tcp://127.0.0.1:{free_tcp_port()}"
    engine = popen_serve(tiny_model_dir, "--headless", "--engine-address", address, "--engine-auth-key", KEY,
                         "--max-model-len", "256")
    api = Server(tiny_model_dir, "--engine-address", address, "--max-model-len", "256",
                 env={"LOOM_ENGINE_AUTH_KEY": KEY})
    try:
        deadline = time.monotonic() + 120
        while True:   # the API server retries attaching until the engine is up
            try:
                api.wait_healthy(timeout=5)
                break
            except (TimeoutError, RuntimeError):
                if time.monotonic() > deadline or engine.poll() is not None:
                    raise
                if api.proc.poll() is not None:
                    api = Server(tiny_model_dir, "--engine-address", address, "--max-model-len", "256",
                                 env={"LOOM_ENGINE_AUTH_KEY": KEY})
        yield address, api
    finally:
        api.stop()
        engine.terminate()
        try:
            engine.wait(20)
        except subprocess.TimeoutExpired:
            engine.kill()


def _complete(url: str) -> str:
    r = requests.post(url + "/v1/completions", timeout=60,
                      json={"prompt": "Hello world", "max_tokens": 6, "temperature": 0, "ignore_eos": True})
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["text"]


def test_forged_frames_to_an_attached_api_server(attached_server):
    address, api = attached_server
    before = _complete(api.url)
    (server_pid,) = child_pids(api.proc.pid)
    ports = _listening_tcp_ports(server_pid) - {api.port}
    assert len(ports) == 2, ports   # its input ROUTER and output PULL
    ctx = zmq.Context()
    peers = []
    try:
        for port in ports:
            for kind in (zmq.DEALER, zmq.PUSH):
                peers.append(make_socket(ctx, kind, f"tcp://127.0.0.1:{port}", bind=False))
                peers.append(make_socket(ctx, kind, f"tcp://127.0.0.1:{port}", bind=False,
                                         auth=CurveClient(new_keys(), new_keys().public)))
        peers.append(_handshake_dealer(ctx, address, None))   # and the engine's handshake socket
        for p in peers:
            _spray(p, _forgeries())
        time.sleep(1.5)
        for p in peers:
            p.close(linger=0)
        time.sleep(0.5)
        assert requests.get(api.url + "/health", timeout=5).status_code == 200
        assert _complete(api.url) == before
        assert api.proc.poll() is None
    finally:
        ctx.destroy(linger=0)

