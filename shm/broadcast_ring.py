"""One-writer / N-reader broadcast ring over POSIX shared memory.

The engine core (the one writer) sends each step's batch to its N workers (the
readers, separate processes) through this ring.

Layout of the shared-memory segment (all integers little endian)::

    [0, 64)            header: magic, version, n_readers, n_chunks,
                       max_chunk_bytes; the writer's "closed" flag at 40
    [64, ...)          sleep flags: one byte per reader (1 = that reader is, or
                       is about to be, blocked on its notify socket), padded
    n_chunks x meta    per chunk (64-byte aligned): u64 seq, then one "read"
                       flag byte per reader (padding bytes stay 1)
    n_chunks x data    per chunk (page-aligned start, 64-byte stride):
                       u32 kind, u32 n_frames, u64 len[n_frames], frame bytes

Messages are numbered 1, 2, 3, ...; message ``s`` lives in chunk
``(s - 1) % n_chunks``.  A chunk's ``seq`` word is its "written" flag: reader
r knows message ``s`` is complete when the chunk's seq equals ``s`` (no ABA
problem, unlike a boolean), and sets its own read flag once it has copied the
message out.  The writer reuses a chunk only when every reader's read flag is
1 (backpressure: the writer is at most ``n_chunks`` messages ahead).

Writer, per message:  wait all read flags == 1 -> clear them -> write header +
data -> fence -> store seq -> fence -> notify each reader whose sleep flag is
set.  Reader:  load seq == expected -> fence -> copy data out -> fence -> set
its read flag.

Big messages.  A message that does not fit a chunk goes over a ZMQ PUB socket
("overflow"); the chunk then carries only an overflow marker, so the order of
messages is that of the chunks.  Overflow messages are never dropped (HWM 0);
their number in flight is bounded by ``n_chunks``.

Idle readers.  A reader spins (``os.sched_yield``) for ``spin_s``, then sets
its sleep flag, fences, re-checks the chunk and blocks in poll() on its own
AF_UNIX datagram socket; the writer stores seq, fences, reads the sleep flags
and sends one byte to each sleeping reader.  That is the Dekker pattern
(store; full fence; load on both sides), so one of the two always sees the
other's store and no wakeup is lost; as belt and braces a sleeping reader also
re-checks the ring every ``_SLEEP_RECHECK_S`` (5 wakeups/s: ~0% CPU).  A
plain datagram socket rather than a ZMQ PUB: measured on a 16-core host, the
wake-up latency was ~40 us median against ~250 us through ZMQ (whose I/O
threads add two more thread wake-ups on the way).

Memory ordering.  CPython has no atomics, but each load/store here is a
separate C call (struct.pack_into, memoryview slice assignment) that the C
compiler cannot reorder across.  For the CPU, :func:`_fence` acquires and
releases a ``threading.Lock``, as vLLM's shm_broadcast does: the uncontended
lock is a POSIX semaphore whose sem_wait/sem_post are ``lock``-prefixed atomic
read-modify-writes on x86 (full barriers) and acquire/release atomics on
aarch64.  On x86 (TSO) only the Dekker store->load order strictly needs it;
the other fences are for weaker CPUs and cost ~0.1 us each.

Attach handshake (ZMQ slow joiners).  The overflow socket is an XPUB with
XPUB_VERBOSE.  A reader maps the segment, binds its notify socket, connects its
SUB and subscribes first to b"" (everything) and then to a private topic
``b"\\xfeloom-rank-<r>"``.  The writer's :meth:`BroadcastRing.wait_until_ready`
waits for every private subscription: a pipe delivers subscriptions in order,
so by then every reader receives everything published afterwards.  It then
connects to the readers' notify sockets and unlinks the segment and every
ipc file (mappings and connections stay), so even a SIGKILL of every process
leaves nothing in /dev/shm or ``ipc_dir``.  When a reader closes or dies, its
SUB pipe ends and the XPUB emits the unsubscription of its private topic,
which lets a writer blocked on backpressure raise :class:`ReaderGone`.

Readers on other nodes.  They cannot map the segment, so a ring created with
``remote=RemoteSpec(...)`` also publishes every message on a TCP XPUB (vLLM's
MessageQueue does the same: local readers use shared memory, remote ones a
socket).  A :class:`RemoteReader` subscribes (b"" then its rank topic, as local
readers do on the overflow socket) and :meth:`wait_until_ready` waits for the
remote ranks' topics too.  With an auth key the XPUB is a CURVE server whose
keys, and the one client key it admits (ZAP), derive from the key
(ipc/auth.py), so only holders of the key can read the steps.  A remote reader
raises RingClosed when its connection to the writer drops (ZMTP heartbeats
catch a silent peer).

Nothing is pickled.  The handle (:class:`RingHandle`) is a msgspec Struct of
str/int fields: picklable for multiprocessing spawn args, or msgpack-encodable.
"""
from __future__ import annotations

import mmap
import os
import secrets
import select
import socket
import struct
import threading
import time
from multiprocessing import resource_tracker
from typing import Sequence, Union

import _posixshmem  # CPython's POSIX shm_open/shm_unlink (what SharedMemory uses)
import msgspec
import zmq

from ipc.auth import READER_ROLE, PeerGuard, derive_keys, ring_curve_client, ring_curve_server

__all__ = ["BroadcastRing", "RingHandle", "RingClosed", "ReaderGone", "RemoteSpec", "RemoteHandle",
           "RemoteReader", "attach_reader"]

Frame = Union[bytes, bytearray, memoryview]

_MAGIC = 0x474E4952_4D4F4F4C  # b"LOOMRING" little endian
_VERSION = 1
_HEADER = struct.Struct("<QIIIIQ")  # magic, version, n_readers, n_chunks, pad, max_chunk_bytes
_CLOSED_OFF = 40  # u8: writer closed
_SLEEP_OFF = 64
_KIND_INLINE = 0
_KIND_OVERFLOW = 1
_U64 = struct.Struct("<Q")
_CHUNK_HDR = struct.Struct("<II")  # kind, n_frames
_OVF_HDR = struct.Struct("<cQI")  # b"o", seq, n_frames: first frame of an overflow message
_RANK_TOPIC = b"\xfeloom-rank-%d"
_SLEEP_RECHECK_S = 0.2  # a sleeping reader re-checks the ring this often anyway
_SUN_PATH_MAX = 107

_fence_lock = threading.Lock()


def _fence() -> None:
    """Full memory barrier (see the module docstring)."""
    _fence_lock.acquire()
    _fence_lock.release()


def _byte_views(frames: "Sequence[Frame]") -> tuple[list[memoryview], list[int]]:
    """Each frame as a flat unsigned-byte view (no copy), and their lengths."""
    views = []
    lens = []
    for f in frames:
        m = f if type(f) is memoryview else memoryview(f)
        if m.ndim != 1 or m.format != "B":
            m = m.cast("B")
        views.append(m)
        lens.append(m.nbytes)
    return views, lens


def _round_up(x: int, a: int) -> int:
    return (x + a - 1) // a * a


class RingClosed(EOFError):
    """The writer closed the ring and every message sent before was read."""


class ReaderGone(ConnectionError):
    """The writer waits for a reader that has closed its end or died."""


class RingHandle(msgspec.Struct, frozen=True):
    """Everything a reader needs to attach; pass it to the spawned child."""
    shm_name: str
    n_readers: int
    n_chunks: int
    max_chunk_bytes: int
    overflow_addr: str  # ipc://... of the writer's XPUB
    notify_prefix: str  # reader r binds its datagram socket at notify_prefix + str(r)


class RemoteSpec(msgspec.Struct, frozen=True):
    """Writer side of the readers on other nodes: where to publish, and whose topics to wait for."""
    address: str               # tcp://HOST:PORT to bind
    ranks: tuple[int, ...]     # the remote readers' ranks
    auth_key: str | None = None


class RemoteHandle(msgspec.Struct, frozen=True):
    """Everything a reader on another node needs: the writer's TCP XPUB (and the key)."""
    address: str               # tcp://HOST:PORT to connect to
    auth_key: str | None = None


_HEARTBEAT_MS = 1000


class _Layout:
    def __init__(self, n_readers: int, n_chunks: int, max_chunk_bytes: int) -> None:
        self.n_readers = n_readers
        self.n_chunks = n_chunks
        self.max_chunk_bytes = max_chunk_bytes
        self.flag_bytes = _round_up(n_readers, 8)  # flags are read 8 at a time
        self.sleep_off = _SLEEP_OFF
        self.meta_off = _round_up(_SLEEP_OFF + self.flag_bytes, 64)
        self.meta_stride = _round_up(8 + self.flag_bytes, 64)
        self.data_off = _round_up(self.meta_off + n_chunks * self.meta_stride, 4096)
        self.chunk_stride = _round_up(max_chunk_bytes, 64)
        self.size = self.data_off + n_chunks * self.chunk_stride
        self.flags_struct = struct.Struct(f"<{self.flag_bytes // 8}Q")
        self.all_read = (0x0101010101010101,) * (self.flag_bytes // 8)

    def chunk_of(self, seq: int) -> tuple[int, int]:
        """(chunk index, offset of its sequence word) of message number `seq` (from 1)."""
        idx = (seq - 1) % self.n_chunks
        return idx, self.seq_off(idx)

    def seq_off(self, idx: int) -> int:
        return self.meta_off + idx * self.meta_stride

    def data(self, idx: int) -> int:
        return self.data_off + idx * self.chunk_stride


class BroadcastRing:
    """Shared-memory broadcast ring.  Build it with :meth:`create` (the
    writer) or :meth:`attach` (a reader), not with the constructor."""

    def __init__(self) -> None:  # pragma: no cover
        raise TypeError("use BroadcastRing.create(...) or BroadcastRing.attach(...)")

    def _init_common(self, L: _Layout, spin_s: float, is_writer: bool, rank: int) -> None:
        self._L = L
        self._spin_s = spin_s
        self._is_writer = is_writer
        self._rank = rank
        self._closed = False
        self._ready = False
        self._next_seq = 1
        self._shm_linked = False  # only the writer ever unlinks the segment
        self._ctx = None
        self._ovf = None
        self._remote = None   # the XPUB of readers on other nodes (writer)
        self._remote_ranks: tuple[int, ...] = ()
        self._guard = None
        self._mm = None
        self._buf = None
        self._ipc_paths: list[str] = []  # files this side removes
        self._hdr_structs: dict[int, struct.Struct] = {}

    # ------------------------------------------------------------------ setup
    @classmethod
    def create(cls, n_readers: int, ipc_dir: str, max_chunk_bytes: int = 1 << 20,
               n_chunks: int = 16, spin_s: float = 0.0005,
               linger_s: float = 2.0, remote: RemoteSpec | None = None) -> "BroadcastRing":
        """Writer side: create the segment and bind the overflow XPUB (socket
        files go in ``ipc_dir``, which must exist).  ``linger_s`` bounds how
        long close() waits for unsent overflow messages.  ``remote``: also
        publish every message for readers on other nodes."""
        if n_readers < 1 or n_chunks < 1:
            raise ValueError("n_readers and n_chunks must be >= 1")
        if max_chunk_bytes < 64:
            raise ValueError("max_chunk_bytes must be >= 64")
        self = object.__new__(cls)
        self._init_common(_Layout(n_readers, n_chunks, max_chunk_bytes), spin_s, True, -1)
        token = f"{os.getpid()}_{secrets.token_hex(6)}"
        self._shm_name = f"loom_ring_{token}"
        self._ovf_path = os.path.join(ipc_dir, f"loom-ring-{token}-ovf")
        self._notify_prefix = os.path.join(ipc_dir, f"loom-ring-{token}-wake")
        self._ipc_paths = [self._ovf_path] + [self._notify_prefix + str(r) for r in range(n_readers)]
        for p in self._ipc_paths:
            if len(os.fsencode(p)) > _SUN_PATH_MAX:
                raise ValueError(f"ipc path too long for a unix socket: {p!r}")
        self._gone: set[int] = set()
        self._wake: list[socket.socket] = []
        self._create_segment()
        try:
            self._ctx = zmq.Context(io_threads=1)
            self._ovf = self._ctx.socket(zmq.XPUB)
            self._ovf.setsockopt(zmq.XPUB_VERBOSE, 1)
            self._ovf.setsockopt(zmq.SNDHWM, 0)  # never drop; bounded by n_chunks
            self._ovf.setsockopt(zmq.LINGER, int(linger_s * 1000))
            self._ovf.bind(f"ipc://{self._ovf_path}")
            if remote is not None:
                self._bind_remote(remote, linger_s)
        except BaseException:
            self._teardown()
            raise
        return self

    def _bind_remote(self, remote: RemoteSpec, linger_s: float) -> None:
        self._remote_ranks = tuple(remote.ranks)
        if remote.auth_key:
            self._guard = PeerGuard(self._ctx, "tensor-parallel step broadcast",
                                    (derive_keys(remote.auth_key, READER_ROLE).public,))
        sock = self._remote = self._ctx.socket(zmq.XPUB)
        sock.setsockopt(zmq.XPUB_VERBOSE, 1)
        sock.setsockopt(zmq.SNDHWM, 0)  # never drop a step
        sock.setsockopt(zmq.LINGER, int(linger_s * 1000))
        sock.setsockopt(zmq.HEARTBEAT_IVL, _HEARTBEAT_MS)
        sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, 10 * _HEARTBEAT_MS)
        server = ring_curve_server(remote.auth_key)
        if server is not None:
            server.apply(sock)
        sock.bind(remote.address)

    def _create_segment(self) -> None:
        L = self._L
        name = "/" + self._shm_name
        fd = _posixshmem.shm_open(name, os.O_CREAT | os.O_EXCL | os.O_RDWR, mode=0o600)
        self._shm_linked = True
        # If we die before wait_until_ready() unlinks it, the tracker does.
        resource_tracker.register(name, "shared_memory")
        try:
            os.ftruncate(fd, L.size)
            try:  # reserve the pages now: ENOSPC here rather than SIGBUS later
                os.posix_fallocate(fd, 0, L.size)
            except OSError as e:
                if e.errno not in (95, 22):  # EOPNOTSUPP / EINVAL: cannot, go on
                    raise
            self._mm = mmap.mmap(fd, L.size)
        except BaseException:
            os.close(fd)
            self._unlink_segment()
            raise
        os.close(fd)
        self._buf = buf = memoryview(self._mm)
        _HEADER.pack_into(buf, 0, _MAGIC, _VERSION, L.n_readers, L.n_chunks, 0, L.max_chunk_bytes)
        for i in range(L.n_chunks):  # every chunk starts out "read by all" (free)
            off = L.seq_off(i) + 8
            buf[off:off + L.flag_bytes] = b"\x01" * L.flag_bytes

    @classmethod
    def attach(cls, handle: RingHandle, reader_rank: int, spin_s: float = 0.0005) -> "BroadcastRing":
        """Reader side: map the segment, bind the notify socket, subscribe.
        Does not wait for the writer; its wait_until_ready() sees us later."""
        if not 0 <= reader_rank < handle.n_readers:
            raise ValueError(f"reader_rank {reader_rank} not in [0, {handle.n_readers})")
        self = object.__new__(cls)
        L = _Layout(handle.n_readers, handle.n_chunks, handle.max_chunk_bytes)
        self._init_common(L, spin_s, False, reader_rank)
        self._shm_name = handle.shm_name
        self._wake_sock = None
        # shm_open + mmap rather than SharedMemory: SharedMemory would register
        # the name with this process's resource tracker, which would unlink it
        # and warn about a "leak" when this reader exits.
        fd = _posixshmem.shm_open("/" + handle.shm_name, os.O_RDWR, mode=0o600)
        try:
            size = os.fstat(fd).st_size
            if size < L.size:
                raise ValueError(f"shm segment {handle.shm_name} has {size} bytes, expected {L.size}")
            self._mm = mmap.mmap(fd, L.size)
        finally:
            os.close(fd)
        self._buf = memoryview(self._mm)
        try:
            magic, version, n_r, n_c, _, mcb = _HEADER.unpack_from(self._buf, 0)
            if (magic, version, n_r, n_c, mcb) != (_MAGIC, _VERSION, L.n_readers, L.n_chunks,
                                                   L.max_chunk_bytes):
                raise ValueError("shm segment header does not match the handle")
            self._my_sleep = L.sleep_off + reader_rank
            path = handle.notify_prefix + str(reader_rank)
            self._wake_sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
            self._wake_sock.setblocking(False)
            self._wake_sock.bind(path)
            self._ipc_paths = [path]  # normally the writer unlinks it first
            self._wake_poll = select.poll()
            self._wake_poll.register(self._wake_sock.fileno(), select.POLLIN)
            self._ctx = zmq.Context(io_threads=1)
            self._ovf = self._ctx.socket(zmq.SUB)
            self._ovf.setsockopt(zmq.RCVHWM, 0)
            self._ovf.setsockopt(zmq.LINGER, 0)
            self._ovf.connect(handle.overflow_addr)
            self._ovf.setsockopt(zmq.SUBSCRIBE, b"")  # first: everything
            self._ovf.setsockopt(zmq.SUBSCRIBE, _RANK_TOPIC % reader_rank)  # then: "r is in"
        except BaseException:
            self._teardown()
            raise
        return self

    def handle(self) -> RingHandle:
        """The descriptor for the readers (writer only)."""
        self._check_writer()
        return RingHandle(shm_name=self._shm_name, n_readers=self._L.n_readers,
                          n_chunks=self._L.n_chunks, max_chunk_bytes=self._L.max_chunk_bytes,
                          overflow_addr=f"ipc://{self._ovf_path}",
                          notify_prefix=self._notify_prefix)

    def wait_until_ready(self, timeout: float | None = None) -> None:
        """Writer: return once every reader has attached; then unlink the
        segment and all ipc files.  Raises TimeoutError naming the missing
        ranks (the ring stays usable: call it again, or close())."""
        self._check_writer()
        if self._ready:
            return
        n = self._L.n_readers
        want = {b"\x01" + _RANK_TOPIC % r: r for r in range(n)}
        seen = getattr(self, "_seen", set())
        self._seen = seen
        deadline = None if timeout is None else time.monotonic() + timeout
        while len(seen) < n:
            if deadline is None:
                wait_ms = -1
            else:
                left = deadline - time.monotonic()
                if left <= 0:
                    missing = sorted(set(range(n)) - seen)
                    raise TimeoutError(f"broadcast ring: readers {missing} did not attach "
                                       f"within {timeout} s")
                wait_ms = max(1, int(left * 1000))
            if self._ovf.poll(wait_ms):
                while True:
                    try:
                        msg = self._ovf.recv(zmq.NOBLOCK)
                    except zmq.Again:
                        break
                    if msg in want:
                        seen.add(want[msg])
        self._wait_remote(deadline, timeout)
        # Reader r bound its notify socket before subscribing, so it exists.
        for r in range(n):
            s = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
            s.connect(self._notify_prefix + str(r))
            s.setblocking(False)
            self._wake.append(s)
        self._ready = True
        # Everyone has mapped / connected: drop the names now.
        self._unlink_segment()
        for p in self._ipc_paths:
            _unlink_quiet(p)

    def _wait_remote(self, deadline: float | None, timeout: float | None) -> None:
        """Until every remote reader's rank topic has arrived (it then gets all that follows)."""
        want = {b"\x01" + _RANK_TOPIC % r: r for r in self._remote_ranks}
        seen = self._remote_seen = getattr(self, "_remote_seen", set())
        while len(seen) < len(want):
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                missing = sorted(set(want.values()) - seen)
                raise TimeoutError(f"broadcast ring: remote readers {missing} did not attach within {timeout} s")
            if self._remote.poll(-1 if left is None else max(1, int(left * 1000))):
                msg = self._remote.recv()
                if msg in want:
                    seen.add(want[msg])

    # --------------------------------------------------------------- writer
    def enqueue(self, frames: Sequence[Frame], timeout: float | None = None) -> None:
        """Broadcast one message (a sequence of bytes-like frames) to every
        reader.  Blocks while the slowest reader is ``n_chunks`` messages
        behind: TimeoutError after ``timeout`` s of that, ReaderGone as soon
        as a reader it waits for has closed or died."""
        if not self._ready or self._closed:
            self._check_writer()
            raise RuntimeError("ring is closed" if self._closed
                               else "call wait_until_ready() before enqueue()")
        seq, idx, seq_off = self._claim_chunk(timeout)
        views, lens = _byte_views(frames)
        self._write_chunk(seq, idx, views, lens)
        if self._remote is not None:
            # copied, as overflow frames are; ZMQ keeps the order of the steps per reader
            self._remote.send_multipart(views, copy=True)
        self._publish(seq, seq_off)

    def _claim_chunk(self, timeout: float | None) -> tuple[int, int, int]:
        """The next message's (seq, chunk index, seq offset), once every reader has read the
        chunk's last message; its read flags are cleared for the new one."""
        L = self._L
        buf = self._buf
        seq = self._next_seq
        idx, seq_off = L.chunk_of(seq)
        if _U64.unpack_from(buf, seq_off)[0] == seq:
            # published by an enqueue that an exception (SIGTERM's SystemExit in the engine)
            # cut short before it counted it: the readers have it, so this message is the next
            self._next_seq = seq = seq + 1
            idx, seq_off = L.chunk_of(seq)
        if L.flags_struct.unpack_from(buf, seq_off + 8) != L.all_read:
            self._wait_free(seq_off, timeout)
        _fence()  # the readers' loads of the old data happen before our stores
        buf[seq_off + 8: seq_off + 8 + L.n_readers] = bytes(L.n_readers)
        return seq, idx, seq_off

    def _write_chunk(self, seq: int, idx: int, views: list[memoryview], lens: list[int]) -> None:
        """The frames inline in the chunk when they fit, else a header here and the frames
        on the overflow socket."""
        buf = self._buf
        nf = len(views)
        hs = self._hdr_structs.get(nf)
        if hs is None:
            hs = self._hdr_structs[nf] = struct.Struct(f"<II{nf}Q")
        off = self._L.data(idx)
        if hs.size + sum(lens) <= self._L.max_chunk_bytes:
            hs.pack_into(buf, off, _KIND_INLINE, nf, *lens)
            p = off + hs.size
            for m, n in zip(views, lens):
                buf[p:p + n] = m
                p += n
            return
        _CHUNK_HDR.pack_into(buf, off, _KIND_OVERFLOW, nf)
        sock = self._ovf
        sock.send(_OVF_HDR.pack(b"o", seq, nf), zmq.SNDMORE if nf else 0)
        # Always copied: zero-copy sends would let the caller modify a
        # buffer zmq is still sending, and go through pyzmq's garbage-
        # collector thread, which can hang context teardown / exit.
        for i, m in enumerate(views):
            sock.send(m, zmq.SNDMORE if i < nf - 1 else 0)

    def _publish(self, seq: int, seq_off: int) -> None:
        """Store the seq that makes the message visible, then wake the readers that sleep."""
        buf = self._buf
        _fence()  # data before seq
        _U64.pack_into(buf, seq_off, seq)
        _fence()  # seq store before the sleep-flag loads (Dekker)
        if any(self._L.flags_struct.unpack_from(buf, self._L.sleep_off)):
            self._wake_sleepers()
        self._next_seq = seq + 1

    def _wake_sleepers(self, everyone: bool = False) -> None:
        flags = self._buf[self._L.sleep_off: self._L.sleep_off + self._L.n_readers].tobytes()
        for r, s in enumerate(self._wake):
            if everyone or flags[r]:
                try:
                    s.send(b"\x00")
                except OSError:  # buffer full (it has wakeups queued) / reader gone
                    pass

    def _wait_free(self, seq_off: int, timeout: float | None) -> None:
        L = self._L
        buf = self._buf
        now = time.monotonic()
        deadline = None if timeout is None else now + timeout
        spin_end = now + self._spin_s
        nap = 2e-5
        next_check = now
        while L.flags_struct.unpack_from(buf, seq_off + 8) != L.all_read:
            now = time.monotonic()
            if now >= next_check:
                self._check_gone(seq_off)
                next_check = now + 0.01
            if deadline is not None and now >= deadline:
                raise TimeoutError("broadcast ring: readers did not free a chunk in time")
            if now < spin_end:
                os.sched_yield()
            else:
                time.sleep(nap)
                nap = min(nap * 2, 1e-3)

    def _check_gone(self, seq_off: int) -> None:
        """Collect unsubscriptions of rank topics (a reader closed or died)."""
        prefix = b"\x00" + _RANK_TOPIC.replace(b"%d", b"")
        while True:
            try:
                msg = self._ovf.recv(zmq.NOBLOCK)
            except zmq.Again:
                break
            if msg.startswith(prefix):
                self._gone.add(int(msg[len(prefix):]))
        if self._gone:
            flags = self._buf[seq_off + 8: seq_off + 8 + self._L.n_readers].tobytes()
            blocking = sorted(r for r in self._gone if flags[r] == 0)
            if blocking:
                raise ReaderGone(f"broadcast ring: readers {blocking} closed or died")

    # --------------------------------------------------------------- reader
    def ready(self) -> bool:
        """Whether dequeue() would return at once (a cheap check for polling loops)."""
        return _U64.unpack_from(self._buf, self._L.chunk_of(self._next_seq)[1])[0] == self._next_seq

    def dequeue(self, timeout: float | None = None) -> list[Union[bytes, memoryview]]:
        """The next message, as a list of frames: ``bytes`` for a message that
        fit a chunk, read-only ``memoryview`` for an overflow one.  Raises
        TimeoutError when nothing arrives within ``timeout`` s (nothing is
        consumed then) and RingClosed once the writer has closed and every
        message it sent before was read."""
        if self._is_writer or self._closed:
            raise RuntimeError("dequeue() on a closed ring" if self._closed
                               else "dequeue() on the writer side")
        L = self._L
        buf = self._buf
        seq = self._next_seq
        idx, seq_off = L.chunk_of(seq)
        deadline = None if timeout is None else time.monotonic() + timeout
        if _U64.unpack_from(buf, seq_off)[0] != seq:
            self._wait_written(seq_off, seq, deadline)
        _fence()  # seq before data
        off = L.data(idx)
        kind, nf = _CHUNK_HDR.unpack_from(buf, off)
        if kind == _KIND_INLINE:
            p = off + 8 + 8 * nf
            frames = []
            for n in struct.unpack_from(f"<{nf}Q", buf, off + 8):
                frames.append(buf[p:p + n].tobytes())
                p += n
        else:
            frames = self._recv_overflow(seq, nf, deadline)
        _fence()  # data copied out before the read flag
        buf[seq_off + 8 + self._rank] = 1
        self._next_seq = seq + 1
        return frames

    def _recv_overflow(self, seq: int, nf: int, deadline: float | None) -> list:
        sock = self._ovf
        if deadline is not None:
            left = deadline - time.monotonic()
            if not sock.poll(max(0, int(left * 1000))):
                raise TimeoutError("broadcast ring: overflow message did not arrive in time")
        parts = sock.recv_multipart(copy=False)
        tag, got_seq, got_nf = _OVF_HDR.unpack(parts[0].bytes)
        if tag != b"o" or got_seq != seq or got_nf != nf or len(parts) != nf + 1:
            raise RuntimeError(f"broadcast ring: overflow stream out of sync "
                               f"(expected message {seq}, got {got_seq})")
        return [p.buffer for p in parts[1:]]

    def _wait_written(self, seq_off: int, seq: int, deadline: float | None) -> None:
        buf = self._buf
        unpack = _U64.unpack_from
        now = time.monotonic()
        spin_end = now + self._spin_s
        if deadline is not None:
            spin_end = min(spin_end, deadline)
        # Phase 1: spin.  sched_yield, not time.sleep(0): the latter costs
        # 50-100 us on some kernels (timer slack), sched_yield < 1 us.
        while now < spin_end:
            os.sched_yield()
            if unpack(buf, seq_off)[0] == seq:
                return
            now = time.monotonic()
        # Phase 2: announce that we sleep, re-check, block in poll().
        buf[self._my_sleep] = 1
        try:
            while True:
                _fence()  # sleep-flag store before the seq load (Dekker)
                if unpack(buf, seq_off)[0] == seq:
                    return
                if buf[_CLOSED_OFF]:
                    _fence()
                    if unpack(buf, seq_off)[0] == seq:
                        return
                    raise RingClosed("broadcast ring closed by the writer")
                if deadline is None:
                    wait_s = _SLEEP_RECHECK_S
                else:
                    left = deadline - time.monotonic()
                    if left <= 0:
                        raise TimeoutError("broadcast ring: no message within the timeout")
                    wait_s = min(left, _SLEEP_RECHECK_S)
                if self._wake_poll.poll(max(1, int(wait_s * 1000 + 0.999))):
                    try:  # drain; a stale wakeup only costs a re-check
                        while self._wake_sock.recv(64):
                            pass
                    except BlockingIOError:
                        pass
        finally:
            buf[self._my_sleep] = 0

    # ---------------------------------------------------------------- close
    @property
    def is_writer(self) -> bool:
        return self._is_writer

    @property
    def rank(self) -> int:
        """The reader's rank; -1 on the writer."""
        return self._rank

    def close(self) -> None:
        """Both sides; idempotent.  The writer flags the ring closed and wakes
        every reader (they get RingClosed once drained), waits up to
        ``linger_s`` for unsent overflow messages, and removes the segment and
        ipc files if wait_until_ready() has not already."""
        if self._closed:
            return
        self._closed = True
        if self._is_writer and self._buf is not None:
            _fence()
            self._buf[_CLOSED_OFF] = 1
            _fence()
            self._wake_sleepers(everyone=True)
        self._teardown()

    def _teardown(self) -> None:
        if self._ovf is not None:
            self._ovf.close()
            self._ovf = None
        if self._remote is not None:
            self._remote.close()
            self._remote = None
        if self._guard is not None:
            self._guard.close()
            self._guard = None
        if self._ctx is not None:
            self._ctx.term()  # the writer's waits for overflow messages (linger)
            self._ctx = None
        for s in getattr(self, "_wake", ()):
            s.close()
        if getattr(self, "_wake_sock", None) is not None:
            self._wake_sock.close()
            self._wake_sock = None
        self._unlink_segment()
        for p in self._ipc_paths:
            _unlink_quiet(p)
        if self._buf is not None:
            self._buf.release()
            self._buf = None
        if self._mm is not None:
            try:
                self._mm.close()
            except BufferError:  # a view is still alive somewhere; GC unmaps it
                pass
            self._mm = None

    def _unlink_segment(self) -> None:
        if self._shm_linked:
            self._shm_linked = False
            try:
                _posixshmem.shm_unlink("/" + self._shm_name)
            except FileNotFoundError:
                pass
            resource_tracker.unregister("/" + self._shm_name, "shared_memory")

    def _check_writer(self) -> None:
        if not self._is_writer:
            raise RuntimeError("writer-side method called on a reader")

    def __enter__(self) -> "BroadcastRing":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self) -> None:
        # Dropped without close(): never block here on unsent overflow messages.
        try:
            if not self._closed:
                if self._ovf is not None:
                    self._ovf.setsockopt(zmq.LINGER, 0)
                self.close()
        except Exception:
            pass


class RemoteReader:
    """A reader on another node: the ring's messages from the writer's TCP XPUB, with the
    reader side of BroadcastRing's interface (ready, dequeue, close)."""

    def __init__(self, handle: RemoteHandle, rank: int):
        self._rank = rank
        self._ctx = zmq.Context(io_threads=1)
        self._sub = self._ctx.socket(zmq.SUB)
        self._sub.setsockopt(zmq.RCVHWM, 0)
        self._sub.setsockopt(zmq.LINGER, 0)
        self._sub.setsockopt(zmq.HEARTBEAT_IVL, _HEARTBEAT_MS)
        self._sub.setsockopt(zmq.HEARTBEAT_TIMEOUT, 10 * _HEARTBEAT_MS)
        client = ring_curve_client(handle.auth_key)
        if client is not None:
            client.apply(self._sub)
        # a dropped connection (the writer died, or stopped answering heartbeats) ends the ring
        self._monitor = self._sub.get_monitor_socket(zmq.EVENT_DISCONNECTED)
        self._sub.connect(handle.address)
        self._sub.setsockopt(zmq.SUBSCRIBE, b"")
        self._sub.setsockopt(zmq.SUBSCRIBE, _RANK_TOPIC % rank)
        self._poller = zmq.Poller()
        self._poller.register(self._sub, zmq.POLLIN)
        self._poller.register(self._monitor, zmq.POLLIN)
        self._closed = False

    @property
    def rank(self) -> int:
        return self._rank

    def ready(self) -> bool:
        return bool(self._sub.poll(0))

    def dequeue(self, timeout: float | None = None) -> list[bytes]:
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            left = None if deadline is None else max(0, int((deadline - time.monotonic()) * 1000))
            events = dict(self._poller.poll(left))
            if self._sub in events:
                return self._sub.recv_multipart()
            if self._monitor in events:
                self._monitor.recv_multipart()
                raise RingClosed("broadcast ring: the connection to the writer's node dropped")
            if deadline is not None and time.monotonic() >= deadline:
                raise TimeoutError("broadcast ring: no message within the timeout")

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._sub.disable_monitor()
        self._monitor.close()
        self._sub.close()
        self._ctx.term()


def attach_reader(handle: "RingHandle | RemoteHandle", rank: int, spin_s: float = 0.0005):
    """A reader of the ring: shared memory on the writer's node (spinning spin_s before it
    sleeps), the TCP XPUB elsewhere."""
    if isinstance(handle, RemoteHandle):
        return RemoteReader(handle, rank)
    return BroadcastRing.attach(handle, rank, spin_s)


def _unlink_quiet(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
