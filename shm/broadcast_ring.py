"""One-writer / N-reader broadcast ring over POSIX shared memory.

The engine core (the one writer) sends each step's batch to its N workers (the
readers, separate processes) through this ring.

Layout of the shared-memory segment (all integers little endian)::

    [0, 64)            header: magic, version, n_readers, n_chunks,
                       max_chunk_bytes, closed flag
    [64, ...)          sleep flags: one byte per reader (1 = that reader is, or
                       is about to be, blocked on the notify socket), padded
    n_chunks x meta    per chunk (64-byte aligned): u64 seq, then one "read"
                       flag byte per reader (padding bytes stay 1)
    n_chunks x data    per chunk (page aligned start, 64-byte stride):
                       u32 kind, u32 n_frames, u64 len[n_frames], frame bytes

Messages are numbered 1, 2, 3, ...; message ``s`` lives in chunk
``(s - 1) % n_chunks``.  A chunk's ``seq`` word doubles as the "written"
flag: reader r knows message ``s`` is complete when the chunk's seq equals
``s`` (no ABA problem, unlike a boolean flag), and sets its own read flag when
it has copied the message out.  The writer reuses a chunk only when every
reader's read flag is 1 (backpressure).

Writer, per message:  wait all read flags == 1 -> clear read flags -> write
header + data -> fence -> store seq -> fence -> if any reader sleeps, notify.
Reader: load seq == expected -> fence -> copy data -> fence -> set read flag.

Messages that do not fit a chunk go over a ZMQ PUB socket ("overflow"); the
chunk then carries only an overflow marker, so the order of messages is that of
the chunks.  Idle readers spin for ``spin_s`` then block on a second PUB/SUB
pair ("notify"): a reader sets its sleep flag, fences, re-checks the chunk,
then polls the notify socket; the writer stores seq, fences, then reads the
sleep flags and sends a one-byte notify if any is set.  That is the Dekker
pattern (store; full fence; load on both sides), so one of the two always sees
the other and no wakeup is lost; as a belt and braces a sleeping reader also
re-checks the ring every ``_SLEEP_RECHECK_S``.

Memory ordering.  CPython gives no atomics, but each load/store here is a
separate C call (struct.pack_into, memoryview slice assignment) that the C
compiler cannot reorder across.  For the CPU, :func:`_fence` acquires and
releases a ``threading.Lock``, the trick vLLM's shm_broadcast uses: the
uncontended lock is a POSIX semaphore whose sem_wait/sem_post are ``lock``-
prefixed atomic read-modify-writes on x86 (full barriers) and acquire/release
atomics on aarch64.  On x86 (TSO) only the Dekker store->load order actually
needs it; the other fences are for weaker CPUs and cost ~0.1 us each.

Slow joiners.  Both PUB sockets are XPUBs with XPUB_VERBOSE.  A reader maps
the segment, connects its two SUB sockets and subscribes first to b"" (all
messages) and then to a private topic ``b"\\xfeloom-rank-<r>"``.  The writer's
:meth:`BroadcastRing.wait_until_ready` waits for that private subscription on
both XPUBs: since a pipe delivers subscriptions in order, by then every reader
is subscribed to everything, so nothing published afterwards can be lost.  It
then unlinks the segment and the two ipc:// files (the mappings and the
connections stay), so even a SIGKILL of every process leaves nothing behind.
Readers that close or die cause the XPUB to emit the unsubscription of their
private topic, which lets a writer blocked on backpressure fail fast.

Nothing is pickled; the handle (:class:`RingHandle`) is a msgspec Struct of
str/int fields (picklable for multiprocessing spawn args, or msgpack/json
encodable).
"""
from __future__ import annotations

import mmap
import os
import secrets
import struct
import threading
import time
from multiprocessing import resource_tracker
from typing import Sequence, Union

import _posixshmem  # CPython's POSIX shm_open/shm_unlink (what SharedMemory uses)
import msgspec
import zmq

__all__ = ["BroadcastRing", "RingHandle", "RingClosed", "ReaderGone"]

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
_OVF_HDR = struct.Struct("<cQI")  # b"o", seq, n_frames (first frame of an overflow msg)
_NOTIFY = b"\x00"
_RANK_TOPIC = b"\xfeloom-rank-%d"
_SLEEP_RECHECK_S = 0.2  # a sleeping reader re-checks the ring this often anyway
_SUN_PATH_MAX = 107

_fence_lock = threading.Lock()


def _fence() -> None:
    """Full memory barrier (see module docstring)."""
    _fence_lock.acquire()
    _fence_lock.release()


def _round_up(x: int, a: int) -> int:
    return (x + a - 1) // a * a


class RingClosed(EOFError):
    """The writer closed the ring and every message before the close was read."""


class ReaderGone(ConnectionError):
    """The writer waits for a reader that has closed its end or died."""


class RingHandle(msgspec.Struct, frozen=True):
    """Everything a reader process needs to attach (pass it to a spawned child)."""
    shm_name: str
    n_readers: int
    n_chunks: int
    max_chunk_bytes: int
    notify_addr: str
    overflow_addr: str


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

    def seq_off(self, idx: int) -> int:
        return self.meta_off + idx * self.meta_stride

    def data(self, idx: int) -> int:
        return self.data_off + idx * self.chunk_stride


class BroadcastRing:
    """Shared-memory broadcast ring; build with :meth:`create` (writer) or
    :meth:`attach` (reader), not the constructor."""

    def __init__(self) -> None:  # pragma: no cover - use create()/attach()
        raise TypeError("use BroadcastRing.create(...) or BroadcastRing.attach(...)")

    # ------------------------------------------------------------------ setup
    @classmethod
    def create(cls, n_readers: int, ipc_dir: str, max_chunk_bytes: int = 1 << 20,
               n_chunks: int = 16, spin_s: float = 0.0005,
               linger_s: float = 2.0) -> "BroadcastRing":
        """Writer side: create the segment and bind the two XPUB sockets
        (ipc:// files inside ``ipc_dir``, which must exist)."""
        if n_readers < 1 or n_chunks < 1:
            raise ValueError("n_readers and n_chunks must be >= 1")
        if max_chunk_bytes < 64:
            raise ValueError("max_chunk_bytes must be >= 64")
        self = object.__new__(cls)
        self._init_common(_Layout(n_readers, n_chunks, max_chunk_bytes), spin_s)
        self._is_writer = True
        self._rank = -1
        token = f"{os.getpid()}_{secrets.token_hex(6)}"
        self._shm_name = f"loom_ring_{token}"
        self._ipc_paths = [os.path.join(ipc_dir, f"loom-ring-{token}-{k}")
                           for k in ("notify", "ovf")]
        for p in self._ipc_paths:
            if len(os.fsencode(p)) > _SUN_PATH_MAX:
                raise ValueError(f"ipc path too long for a unix socket: {p!r}")
        self._next_seq = 1
        self._ready = False
        self._gone: set[int] = set()
        self._linger_ms = int(linger_s * 1000)
        self._create_segment()
        try:
            self._ctx = zmq.Context(io_threads=1)
            self._notify = self._ctx.socket(zmq.XPUB)
            self._ovf = self._ctx.socket(zmq.XPUB)
            for s, path in ((self._notify, self._ipc_paths[0]), (self._ovf, self._ipc_paths[1])):
                s.setsockopt(zmq.XPUB_VERBOSE, 1)
                s.setsockopt(zmq.LINGER, 0)
                s.bind(f"ipc://{path}")
            # notifies may be dropped when a reader's queue is full (it isn't
            # sleeping then); overflow messages must never be dropped.  Their
            # number is bounded by n_chunks through the ring's backpressure.
            self._notify.setsockopt(zmq.SNDHWM, 1000)
            self._ovf.setsockopt(zmq.SNDHWM, 0)
            self._ovf.setsockopt(zmq.LINGER, self._linger_ms)
        except BaseException:
            self._teardown()
            raise
        return self

    def _create_segment(self) -> None:
        L = self._L
        fd = _posixshmem.shm_open("/" + self._shm_name, os.O_CREAT | os.O_EXCL | os.O_RDWR, mode=0o600)
        self._shm_linked = True
        # crash before wait_until_ready(): the resource tracker unlinks it
        resource_tracker.register("/" + self._shm_name, "shared_memory")
        try:
            os.ftruncate(fd, L.size)
            try:  # reserve the pages now: ENOSPC here instead of SIGBUS later
                os.posix_fallocate(fd, 0, L.size)
            except OSError as e:
                if e.errno not in (95, 22):  # EOPNOTSUPP / EINVAL: fs can't; go on
                    raise
            self._mm = mmap.mmap(fd, L.size)
        except BaseException:
            os.close(fd)
            self._unlink_segment()
            raise
        os.close(fd)
        self._buf = memoryview(self._mm)
        buf = self._buf
        _HEADER.pack_into(buf, 0, _MAGIC, _VERSION, L.n_readers, L.n_chunks, 0, L.max_chunk_bytes)
        for i in range(L.n_chunks):  # every chunk starts "read by all" (free)
            off = L.seq_off(i)
            buf[off + 8: off + 8 + L.flag_bytes] = b"\x01" * L.flag_bytes

    @classmethod
    def attach(cls, handle: RingHandle, reader_rank: int, spin_s: float = 0.0005) -> "BroadcastRing":
        """Reader side: map the segment and subscribe.  Does not block on the
        writer; the writer's wait_until_ready() sees this reader afterwards."""
        if not 0 <= reader_rank < handle.n_readers:
            raise ValueError(f"reader_rank {reader_rank} not in [0, {handle.n_readers})")
        self = object.__new__(cls)
        L = _Layout(handle.n_readers, handle.n_chunks, handle.max_chunk_bytes)
        self._init_common(L, spin_s)
        self._is_writer = False
        self._rank = reader_rank
        self._shm_name = handle.shm_name
        self._shm_linked = False  # the reader never unlinks
        self._ipc_paths = []
        self._next_seq = 1
        # Map through shm_open + mmap, not SharedMemory: SharedMemory would
        # register the name with this process's resource tracker, which would
        # then unlink it / warn about a "leak" when the reader exits.
        fd = _posixshmem.shm_open("/" + handle.shm_name, os.O_RDWR, mode=0o600)
        try:
            size = os.fstat(fd).st_size
            if size < L.size:
                raise ValueError(f"shm segment {handle.shm_name} is {size} bytes, expected {L.size}")
            self._mm = mmap.mmap(fd, L.size)
        finally:
            os.close(fd)
        self._buf = memoryview(self._mm)
        try:
            magic, version, n_r, n_c, _, mcb = _HEADER.unpack_from(self._buf, 0)
            if (magic, version, n_r, n_c, mcb) != (_MAGIC, _VERSION, L.n_readers, L.n_chunks, L.max_chunk_bytes):
                raise ValueError("shm segment header does not match the handle")
            self._my_sleep = L.sleep_off + reader_rank
            self._ctx = zmq.Context(io_threads=1)
            self._notify = self._ctx.socket(zmq.SUB)
            self._ovf = self._ctx.socket(zmq.SUB)
            self._notify.setsockopt(zmq.RCVHWM, 1000)
            self._ovf.setsockopt(zmq.RCVHWM, 0)
            topic = _RANK_TOPIC % reader_rank
            for s, addr in ((self._notify, handle.notify_addr), (self._ovf, handle.overflow_addr)):
                s.setsockopt(zmq.LINGER, 0)
                s.connect(addr)
                s.setsockopt(zmq.SUBSCRIBE, b"")   # first: everything
                s.setsockopt(zmq.SUBSCRIBE, topic)  # then: "rank r is subscribed"
        except BaseException:
            self._teardown()
            raise
        return self

    def _init_common(self, L: _Layout, spin_s: float) -> None:
        self._L = L
        self._spin_s = spin_s
        self._closed = False
        self._ctx = None
        self._notify = None
        self._ovf = None
        self._mm = None
        self._buf = None
        self._hdr_structs: dict[int, struct.Struct] = {}

    def handle(self) -> RingHandle:
        """The descriptor to give to each reader (writer only)."""
        self._check_writer()
        return RingHandle(shm_name=self._shm_name, n_readers=self._L.n_readers,
                          n_chunks=self._L.n_chunks, max_chunk_bytes=self._L.max_chunk_bytes,
                          notify_addr=f"ipc://{self._ipc_paths[0]}",
                          overflow_addr=f"ipc://{self._ipc_paths[1]}")

    def wait_until_ready(self, timeout: float | None = None) -> None:
        """Writer: return once every reader has attached (mapped the segment
        and subscribed to both sockets); then unlink the segment and the ipc
        files.  Raises TimeoutError naming the missing ranks."""
        self._check_writer()
        if self._ready:
            return
        n = self._L.n_readers
        want = {_RANK_TOPIC % r: r for r in range(n)}
        seen = {id(self._notify): set(), id(self._ovf): set()}
        deadline = None if timeout is None else time.monotonic() + timeout
        poller = zmq.Poller()
        poller.register(self._notify, zmq.POLLIN)
        poller.register(self._ovf, zmq.POLLIN)
        while any(len(s) < n for s in seen.values()):
            if deadline is None:
                wait_ms = None
            else:
                left = deadline - time.monotonic()
                if left <= 0:
                    missing = sorted(set(range(n)) - set.intersection(*seen.values()))
                    raise TimeoutError(f"broadcast ring: readers {missing} did not attach "
                                       f"within {timeout} s")
                wait_ms = max(1, int(left * 1000))
            for sock, _ in poller.poll(wait_ms):
                while True:
                    try:
                        msg = sock.recv(zmq.NOBLOCK)
                    except zmq.Again:
                        break
                    if msg[:1] == b"\x01" and msg[1:] in want:
                        seen[id(sock)].add(want[msg[1:]])
        self._ready = True
        # Every reader has mapped the segment and connected: drop the names.
        self._unlink_segment()
        for p in self._ipc_paths:
            _unlink_quiet(p)

    # --------------------------------------------------------------- writer
    def enqueue(self, frames: Sequence[Frame], timeout: float | None = None) -> None:
        """Broadcast one message (a list of byte frames) to every reader.
        Blocks while the slowest reader is ``n_chunks`` messages behind;
        raises TimeoutError after ``timeout`` s of that, ReaderGone if a
        reader closed/died meanwhile."""
        if not self._ready:
            self._check_writer()
            raise RuntimeError("call wait_until_ready() before enqueue()")
        if self._closed:
            raise RuntimeError("ring is closed")
        L = self._L
        buf = self._buf
        seq = self._next_seq
        idx = (seq - 1) % L.n_chunks
        seq_off = L.seq_off(idx)
        if L.flags_struct.unpack_from(buf, seq_off + 8) != L.all_read:
            self._wait_free(seq_off, timeout)
        _fence()  # readers' reads of the old data happen-before our writes
        buf[seq_off + 8: seq_off + 8 + L.n_readers] = bytes(L.n_readers)

        views = []
        lens = []
        total = 0
        for f in frames:
            m = f if type(f) is memoryview else memoryview(f)
            if m.ndim != 1 or m.format != "B":
                m = m.cast("B")
            views.append(m)
            lens.append(m.nbytes)
            total += m.nbytes
        nf = len(views)
        hs = self._hdr_structs.get(nf)
        if hs is None:
            hs = self._hdr_structs[nf] = struct.Struct(f"<II{nf}Q")
        off = L.data(idx)
        if hs.size + total <= L.max_chunk_bytes:
            hs.pack_into(buf, off, _KIND_INLINE, nf, *lens)
            p = off + hs.size
            for m, n in zip(views, lens):
                buf[p:p + n] = m
                p += n
        else:
            _CHUNK_HDR.pack_into(buf, off, _KIND_OVERFLOW, nf)
            parts = [_OVF_HDR.pack(b"o", seq, nf)]
            # zero-copy only for immutable bytes; anything else the caller
            # could modify while zmq still sends it
            parts.extend(f if type(f) is bytes else m for f, m in zip(frames, views))
            copy = [True] + [not (type(f) is bytes and len(f) >= 65536) for f in frames]
            last = len(parts) - 1
            for i, part in enumerate(parts):
                self._ovf.send(part, zmq.SNDMORE if i < last else 0, copy=copy[i])
        _fence()  # data before seq
        _U64.pack_into(buf, seq_off, seq)
        _fence()  # seq store before the sleep-flag load (Dekker)
        if any(L.flags_struct.unpack_from(buf, L.sleep_off)):
            try:
                self._notify.send(_NOTIFY, zmq.NOBLOCK)
            except zmq.Again:
                pass
        self._next_seq = seq + 1

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
                time.sleep(0)
            else:
                time.sleep(nap)
                nap = min(nap * 2, 1e-3)

    def _check_gone(self, seq_off: int) -> None:
        """Collect unsubscriptions of rank topics (a reader closed or died)."""
        for sock in (self._ovf, self._notify):
            while True:
                try:
                    msg = sock.recv(zmq.NOBLOCK)
                except zmq.Again:
                    break
                if msg[:1] == b"\x00" and msg[1:].startswith(b"\xfeloom-rank-"):
                    self._gone.add(int(msg[len(b"\x00\xfeloom-rank-"):]))
        flags = self._buf[seq_off + 8: seq_off + 8 + self._L.n_readers].tobytes()
        blocking = sorted(r for r in self._gone if flags[r] == 0)
        if blocking:
            raise ReaderGone(f"broadcast ring: readers {blocking} closed or died")

    # --------------------------------------------------------------- reader
    def dequeue(self, timeout: float | None = None) -> list[Union[bytes, memoryview]]:
        """Next message, as a list of frames (``bytes`` for messages that fit
        a chunk, read-only ``memoryview`` for overflow ones).  Raises
        TimeoutError if nothing arrives within ``timeout`` s (the message is
        not consumed then) and RingClosed once the writer closed and
        everything sent before was read."""
        if self._is_writer:
            raise RuntimeError("dequeue() on the writer side")
        if self._closed:
            raise RuntimeError("ring is closed")
        L = self._L
        buf = self._buf
        seq = self._next_seq
        idx = (seq - 1) % L.n_chunks
        seq_off = L.seq_off(idx)
        deadline = None if timeout is None else time.monotonic() + timeout
        if _U64.unpack_from(buf, seq_off)[0] != seq:
            self._wait_written(seq_off, seq, deadline)
        _fence()  # seq before data
        off = L.data(idx)
        kind, nf = _CHUNK_HDR.unpack_from(buf, off)
        if kind == _KIND_INLINE:
            lens = struct.unpack_from(f"<{nf}Q", buf, off + 8)
            p = off + 8 + 8 * nf
            frames = []
            for n in lens:
                frames.append(buf[p:p + n].tobytes())
                p += n
        else:
            frames = self._recv_overflow(seq, nf, deadline)
        _fence()  # data copied before the read flag
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
                               f"(expected seq {seq}, got {got_seq})")
        return [p.buffer for p in parts[1:]]

    def _wait_written(self, seq_off: int, seq: int, deadline: float | None) -> None:
        buf = self._buf
        unpack = _U64.unpack_from
        now = time.monotonic()
        spin_end = now + self._spin_s
        if deadline is not None:
            spin_end = min(spin_end, deadline)
        # phase 1: spin (yielding the GIL and the core)
        while now < spin_end:
            time.sleep(0)
            if unpack(buf, seq_off)[0] == seq:
                return
            now = time.monotonic()
        # phase 2: announce we sleep, re-check, block on the notify socket
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
                if self._notify.poll(max(1, int(wait_s * 1000 + 0.999))):
                    while True:  # drain (stale notifies only cause a re-check)
                        try:
                            self._notify.recv(zmq.NOBLOCK)
                        except zmq.Again:
                            break
        finally:
            buf[self._my_sleep] = 0

    # ---------------------------------------------------------------- close
    @property
    def is_writer(self) -> bool:
        return self._is_writer

    @property
    def rank(self) -> int:
        """Reader rank (-1 for the writer)."""
        return self._rank

    def close(self) -> None:
        """Both sides; idempotent.  The writer marks the ring closed (readers
        get RingClosed after draining), lets pending overflow messages go out
        for up to ``linger_s``, and removes the segment and ipc files if
        wait_until_ready() has not already."""
        if self._closed:
            return
        self._closed = True
        if self._is_writer and self._buf is not None:
            _fence()
            self._buf[_CLOSED_OFF] = 1
            _fence()
            try:
                self._notify.send(_NOTIFY, zmq.NOBLOCK)
            except (zmq.ZMQError, AttributeError):
                pass
        self._teardown()

    def _teardown(self) -> None:
        for name in ("_notify", "_ovf"):
            s = getattr(self, name, None)
            if s is not None:
                s.close()
                setattr(self, name, None)
        if self._ctx is not None:
            self._ctx.term()  # waits for overflow messages up to linger_s
            self._ctx = None
        if self._is_writer:
            self._unlink_segment()
            for p in self._ipc_paths:
                _unlink_quiet(p)
        if self._buf is not None:
            self._buf.release()
            self._buf = None
        if self._mm is not None:
            try:
                self._mm.close()
            except BufferError:  # someone still holds a view; GC will unmap it
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
        try:
            if not self._closed and self._is_writer:
                self._unlink_segment()
        except Exception:
            pass


def _unlink_quiet(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
