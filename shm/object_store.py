"""Shared-memory object store: one writer (an API server, or the offline LLM), N readers (the
workers), for the processed multimodal tensors (pixel values, grid sizes).

The writer puts each item once under its content hash; an item already stored is only
referenced again. The request that crosses ZMQ carries (segment name, entry address); the
workers map the segment and wrap the tensors with np.frombuffer, copying nothing.

Segment layout (little endian)::

    [0, 64)        header: magic u64, capacity u64, n_readers u32
    [64, 128)      one "mapped" byte per reader (at most 64 readers)
    [128, cap)     entries, 64-byte aligned, allocated as a ring
    entry:         u64 size, u64 issued, u64 released[n_readers], u32 meta_len, meta (msgpack:
                   [[key, dtype, shape, data offset], ...]), then the arrays (64-byte aligned)

Reference counting across processes without locks: `issued` is written by the writer only
(one per request that references the entry), `released[r]` by reader r only (one per request
it is done with; the engine core tells every worker when a request is gone, whether or not
it ever ran). The readers are every worker of every engine core (reader dp_rank x TP + rank),
but a request reaches one engine's TP workers: an entry is free once the releases add up to
TP x issued. The writer evicts the oldest entries first, and only free ones, when it needs room
(stepping over an entry still in use).

Lifetime: the writer creates the segment (registered with the resource tracker, which
unlinks it if the writer is SIGKILLed) and unlinks it as soon as every reader has mapped it
(mappings stay valid), or at close(). Names carry the run id that `loom serve` or `LLM`
puts in the environment, which children inherit: two servers on one host never clash.
"""
from __future__ import annotations

import bisect
import mmap
import os
import secrets
import struct
import threading
from multiprocessing import resource_tracker

import _posixshmem
import msgspec
import numpy as np

from ipc import envs

_MAGIC = 0x45524F545347_4D4D  # "MMGSTORE"-ish tag
_HEADER = struct.Struct("<QQI")
_MAPPED_OFF = 64
_MAX_READERS = 64
_DATA_START = 128
_ALIGN = 64
RUN_ID_ENV = "LOOM_RUN_ID"


def run_id() -> str:
    """This run's id: inherited from the parent's environment, or made here (and exported so
    that the processes started from here inherit it)."""
    rid = envs.LOOM_RUN_ID
    if not rid:
        rid = os.environ[RUN_ID_ENV] = f"{os.getpid()}{secrets.token_hex(4)}"
    return rid


def segment_name(client_index: int) -> str:
    return f"loom_mm_{run_id()}_c{client_index}"


def is_entry_handle(name: str, addr: int) -> bool:
    """Whether (name, addr) could be an entry of a store segment: a store's name and an aligned
    address past the header. The engine checks every handle an ADD carries (a worker reads and
    releases them). Whether the segment exists cannot be asked of /dev/shm: a segment is
    unlinked once every worker has mapped it."""
    return name.startswith("loom_mm_") and "/" not in name and addr % _ALIGN == 0 and addr >= _DATA_START


def _round_up(x: int, a: int = _ALIGN) -> int:
    return (x + a - 1) // a * a


class StoreFull(RuntimeError):
    """No room: every entry that would have to go is still in use (or the item is larger
    than the store)."""


class ObjectStoreWriter:
    def __init__(self, name: str, capacity: int, n_readers: int, readers_per_request: int | None = None):
        """n_readers: every worker of every engine core (data parallel x tensor parallel);
        readers_per_request: the workers of one engine, which alone see a request (default: all)."""
        if not 1 <= n_readers <= _MAX_READERS:
            raise ValueError(f"n_readers must be in [1, {_MAX_READERS}]")
        self.name, self.capacity, self.n_readers = name, _round_up(capacity), n_readers
        self.readers_per_request = readers_per_request or n_readers
        self._lock = threading.Lock()   # the API server processes in a thread pool
        self._entries: dict[int, str] = {}   # addr -> key
        self._addrs: list[int] = []          # the entries' addresses, sorted: the ring walk bisects them
        self._by_key: dict[str, int] = {}
        self._head = _DATA_START
        self._linked = False
        self._closed = False
        fd = _posixshmem.shm_open("/" + name, os.O_CREAT | os.O_EXCL | os.O_RDWR, mode=0o600)
        self._linked = True
        resource_tracker.register("/" + name, "shared_memory")  # unlinked even if we are SIGKILLed
        try:
            os.ftruncate(fd, self.capacity)
            self._mm = mmap.mmap(fd, self.capacity)
        except BaseException:
            os.close(fd)
            self._unlink()
            raise
        os.close(fd)
        self._buf = memoryview(self._mm)
        _HEADER.pack_into(self._buf, 0, _MAGIC, self.capacity, n_readers)

    # ------------------------------------------------------------ writer API

    def lookup(self, key: str) -> int | None:
        """Reference an item already stored (counts one more request); None if absent."""
        with self._lock:
            addr = self._by_key.get(key)
            if addr is not None:
                self._issued(addr)[0] += 1
            return addr

    def put(self, key: str, arrays: dict[str, np.ndarray]) -> int:
        """Store arrays under key (or reference the stored copy); the entry's address. The arrays
        are copied in outside the lock, so that the API server's media threads copy at once (an HD
        image is ~22 MB of fp32 patches, and the copy faults in fresh pages): the entry is taken
        and held by this request first, and lookups find it once it is whole."""
        metas, off = [], 0
        for k, a in arrays.items():
            metas.append([k, a.dtype.str, list(a.shape), off])
            off = _round_up(off + a.nbytes)
        with self._lock:
            self._check_open()
            addr = self._by_key.get(key)
            if addr is not None:
                self._issued(addr)[0] += 1
                return addr
            meta = msgspec.msgpack.encode(metas)
            head = 24 + 8 * self.n_readers
            data_off = _round_up(head + 4 + len(meta))
            size = _round_up(data_off + off)
            addr = self._alloc(size)
            buf = self._buf
            struct.pack_into("<QQ", buf, addr, size, 1)   # (issued once: in use, never evicted meanwhile)
            buf[addr + 16:addr + 16 + 8 * self.n_readers] = bytes(8 * self.n_readers)
            struct.pack_into("<I", buf, addr + head, len(meta))
            buf[addr + head + 4:addr + head + 4 + len(meta)] = meta
            self._entries[addr] = key
            bisect.insort(self._addrs, addr)
        for (k, _, _, o), a in zip(metas, arrays.values()):
            dst = np.frombuffer(buf, dtype=a.dtype, count=a.size, offset=addr + data_off + o)
            dst[:] = np.ascontiguousarray(a).reshape(-1)
        with self._lock:
            # (a put of the same item meanwhile may have made its own copy first: both are whole,
            # each held by its own request; lookups find the first)
            self._by_key.setdefault(key, addr)
            self.maybe_unlink()
        return addr

    def unref(self, addr: int) -> None:
        """Take back one reference of a request that never reached the engine."""
        with self._lock:
            if not self._closed and addr in self._entries:
                self._issued(addr)[0] -= 1

    def num_entries(self) -> int:
        return len(self._entries)

    def num_in_use(self) -> int:
        """Entries some request still references (the others may be evicted)."""
        with self._lock:
            return sum(not self._is_free(a) for a in self._entries)

    def used_bytes(self) -> int:
        return sum(self._size(a) for a in self._entries)

    # ------------------------------------------------------------ internals

    def _issued(self, addr: int) -> np.ndarray:
        return np.frombuffer(self._buf, dtype="<i8", count=1, offset=addr + 8)

    def _size(self, addr: int) -> int:
        return struct.unpack_from("<Q", self._buf, addr)[0]

    def _is_free(self, addr: int) -> bool:
        counts = np.frombuffer(self._buf, dtype="<i8", count=1 + self.n_readers, offset=addr + 8)
        return int(counts[1:].sum()) >= int(counts[0]) * self.readers_per_request

    def _alloc(self, size: int) -> int:
        """Next fit along the ring from the head: the first stretch of `size` bytes whose entries
        are all free is taken, and those entries evicted (oldest first, as the ring goes round).
        An entry still in use is stepped over, not waited for: a long request's image at the
        ring's tail held up every new image (for seconds, then a 503) with the store nearly empty."""
        if size > self.capacity - _DATA_START:
            raise StoreFull(f"an item of {size} bytes does not fit the store ({self.capacity} bytes)")
        start, walked = self._head, 0
        while walked <= self.capacity:   # one lap, and a stretch more
            if start + size > self.capacity:
                walked += self.capacity - start
                start = _DATA_START
            end = start + size
            in_the_way = self._overlapping(start, end)
            busy = [a for a in in_the_way if not self._is_free(a)]
            if not busy:
                for a in in_the_way:
                    key = self._entries.pop(a)
                    if self._by_key.get(key) == a:   # (not a second copy's: see put)
                        del self._by_key[key]
                    del self._addrs[bisect.bisect_left(self._addrs, a)]
                self._head = end
                return start
            past = max(a + self._size(a) for a in busy)
            walked += past - start
            start = past
        raise StoreFull("the multimodal store is full of items still in use")

    def _overlapping(self, start: int, end: int) -> list[int]:
        """The entries in [start, end): entries do not overlap, so at most the one before `start`
        reaches into it, then those that begin before `end`."""
        i = bisect.bisect_left(self._addrs, start)
        if i > 0 and self._addrs[i - 1] + self._size(self._addrs[i - 1]) > start:
            i -= 1
        j = bisect.bisect_left(self._addrs, end, lo=i)
        return self._addrs[i:j]

    def maybe_unlink(self) -> None:
        """Unlink the segment once every reader has mapped it (cheap: call it as outputs come)."""
        if self._linked and not self._closed and all(self._buf[_MAPPED_OFF:_MAPPED_OFF + self.n_readers]):
            self._unlink()  # every reader has it mapped: nothing can leak from here on

    def _unlink(self) -> None:
        if self._linked:
            self._linked = False
            try:
                _posixshmem.shm_unlink("/" + self.name)
            except FileNotFoundError:
                pass
            resource_tracker.unregister("/" + self.name, "shared_memory")

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("the multimodal store is closed")

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._unlink()
        try:
            self._buf.release()
            self._mm.close()
        except BufferError:  # a view is still alive; the GC unmaps it
            pass

    def __del__(self):
        try:
            self.close()
        except Exception:
            pass


class ObjectStoreReader:
    """A worker's side: maps segments as handles arrive, hands out zero-copy views."""

    def __init__(self, rank: int):
        self.rank = rank
        self._segments: dict[str, tuple[mmap.mmap, memoryview, int]] = {}   # name -> (mm, buf, n_readers)
        self._closed = False

    def _segment(self, name: str):
        seg = self._segments.get(name)
        if seg is None:
            if not name.startswith("loom_mm_"):
                raise ValueError(f"not a multimodal store segment: {name!r}")
            fd = _posixshmem.shm_open("/" + name, os.O_RDWR, mode=0o600)
            try:
                size = os.fstat(fd).st_size
                mm = mmap.mmap(fd, size)
            finally:
                os.close(fd)
            buf = memoryview(mm)
            magic, cap, n_readers = _HEADER.unpack_from(buf, 0) if size >= _DATA_START else (0, 0, 0)
            if magic != _MAGIC or cap != size or self.rank >= n_readers:
                buf.release()
                mm.close()
                raise ValueError(f"shm segment {name} is not a store for reader {self.rank}")
            buf[_MAPPED_OFF + self.rank] = 1
            seg = self._segments[name] = (mm, buf, n_readers)
        return seg

    def get(self, name: str, addr: int) -> dict[str, np.ndarray]:
        """The entry's arrays, as read-only views of the shared memory."""
        _, buf, n = self._segment(name)
        head = 24 + 8 * n
        (meta_len,) = struct.unpack_from("<I", buf, addr + head)
        metas = msgspec.msgpack.decode(bytes(buf[addr + head + 4:addr + head + 4 + meta_len]))
        data_off = _round_up(head + 4 + meta_len)
        out = {}
        for key, dtype, shape, off in metas:
            count = int(np.prod(shape)) if shape else 1
            a = np.frombuffer(buf, dtype=np.dtype(dtype), count=count, offset=addr + data_off + off)
            out[key] = a.reshape(shape)
        return out

    def release(self, name: str, addr: int) -> None:
        """This reader is done with one request's reference to the entry."""
        _, buf, n = self._segment(name)
        if not _DATA_START <= addr <= len(buf) - 24 - 8 * n:
            raise ValueError(f"no entry at {addr} of {name}")
        np.frombuffer(buf, dtype="<i8", count=1, offset=addr + 16 + 8 * self.rank)[0] += 1

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        for mm, buf, _ in self._segments.values():
            try:
                buf.release()
                mm.close()
            except BufferError:  # a view is still alive; the GC unmaps it
                pass
        self._segments.clear()
