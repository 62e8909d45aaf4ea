"""The shared-memory broadcast ring (shm/broadcast_ring.py) with real spawned
reader processes."""
from __future__ import annotations

import multiprocessing as mp
import os
import shutil
import signal
import tempfile
import time

import pytest

from shm.broadcast_ring import BroadcastRing, ReaderGone, RingClosed
from tests import _ring_readers as rr

CTX = mp.get_context("spawn")


@pytest.fixture
def ipc_dir():
    d = tempfile.mkdtemp(prefix="loom-ring-test-")
    yield d
    shutil.rmtree(d, ignore_errors=True)


def _loom_shm() -> set[str]:
    return {n for n in os.listdir("/dev/shm") if "loom" in n}


def _our_shm(pid: int) -> set[str]:
    """Segments a writer in process `pid` made (other Loom runs on this host
    may create their own meanwhile, so a global before/after diff could flake)."""
    return {n for n in _loom_shm() if f"_{pid}_" in n}


def _cpu_seconds(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    # fields[0] is state (field 3); utime, stime are fields 14, 15
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _start(target, *args):
    p = CTX.Process(target=target, args=args, daemon=True)
    p.start()
    return p


def _reap(procs):
    for p in procs:
        if p.is_alive():
            p.kill()
        p.join(5)


def test_three_readers_in_order_with_overflow_and_wraparound(ipc_dir):
    n_readers, n_msgs, big = 3, 400, 200_000
    ring = BroadcastRing.create(n_readers, ipc_dir, max_chunk_bytes=64 * 1024, n_chunks=4)
    handle = ring.handle()
    shm_name = handle.shm_name
    assert "loom" in shm_name and shm_name in _loom_shm()
    procs, conns = [], []
    try:
        for r in range(n_readers):
            parent, child = CTX.Pipe(duplex=False)
            # reader 2 is slow, so the writer hits backpressure
            procs.append(_start(rr.reader_verify, handle, r, big, 20 if r == 2 else 0, child))
            child.close()
            conns.append(parent)
        ring.wait_until_ready(timeout=30)
        # every reader mapped it: the name is gone already, and so are the ipc files
        assert shm_name not in _loom_shm()
        assert os.listdir(ipc_dir) == []
        for i in range(n_msgs):
            frames = rr.make_message(i, big)
            if i % 3 == 0:  # other buffer types are accepted too
                frames = [bytearray(f) if j % 2 else memoryview(f) for j, f in enumerate(frames)]
            ring.enqueue(frames, timeout=20)
        ring.close()
        results = []
        for c in conns:
            assert c.poll(30), "reader did not report"
            results.append(c.recv())
        assert results == [(n_msgs, None)] * n_readers
    finally:
        ring.close()
        _reap(procs)
    assert _our_shm(os.getpid()) == set()
    assert os.listdir(ipc_dir) == []


def test_timeouts_and_close(ipc_dir):
    ring = BroadcastRing.create(1, ipc_dir, max_chunk_bytes=1024, n_chunks=2)
    reader = BroadcastRing.attach(ring.handle(), 0)
    try:
        lonely = BroadcastRing.create(2, ipc_dir)
        with pytest.raises(TimeoutError, match=r"readers \[0, 1\]"):
            lonely.wait_until_ready(timeout=0.2)
        lonely.close()
        ring.wait_until_ready(timeout=5)
        t0 = time.monotonic()
        with pytest.raises(TimeoutError):
            reader.dequeue(timeout=0.2)
        assert 0.19 <= time.monotonic() - t0 < 2.0
        with pytest.raises(TimeoutError):
            reader.dequeue(timeout=0)
        ring.enqueue([b"a"])
        ring.enqueue([b"b" * 5000])
        with pytest.raises(TimeoutError):  # ring full (2 chunks), nobody reads
            ring.enqueue([b"c"], timeout=0.2)
        assert reader.dequeue(timeout=1) == [b"a"]
        assert [bytes(f) for f in reader.dequeue(timeout=1)] == [b"b" * 5000]
        ring.enqueue([b"c"], timeout=1)
        ring.close()
        assert reader.dequeue(timeout=1) == [b"c"]  # still readable after close
        with pytest.raises(RingClosed):
            reader.dequeue(timeout=1)
    finally:
        ring.close()
        reader.close()
    assert os.listdir(ipc_dir) == []


def test_writer_closed_before_ready_cleans_up(ipc_dir):
    ring = BroadcastRing.create(2, ipc_dir)
    handle = ring.handle()
    reader = BroadcastRing.attach(handle, 0)  # binds its notify socket file
    try:
        assert handle.shm_name in _loom_shm() and len(os.listdir(ipc_dir)) == 2
    finally:
        ring.close()
    assert handle.shm_name not in _loom_shm() and os.listdir(ipc_dir) == []
    with pytest.raises(RingClosed):
        reader.dequeue(timeout=1)
    reader.close()


def test_enqueue_cut_short_after_publishing(ipc_dir, monkeypatch):
    """SIGTERM raises SystemExit wherever the engine's main thread is: an enqueue stopped just
    after it published its message must not publish the next one under the same sequence
    number (the readers would skip it: the engine's shutdown call never reached a worker)."""
    import shm.broadcast_ring as br
    ring = BroadcastRing.create(1, ipc_dir, max_chunk_bytes=4096)
    parent, child = CTX.Pipe(duplex=False)
    proc = _start(rr.reader_verify, ring.handle(), 0, 4096, 0, child)
    child.close()
    fence, calls = br._fence, [0]

    def fence_then_stop():
        fence()
        calls[0] += 1
        if calls[0] == 3:  # enqueue's third fence: the sequence number is stored
            raise SystemExit(0)
    try:
        ring.wait_until_ready(timeout=30)
        ring.enqueue(rr.make_message(0, 4096))
        monkeypatch.setattr(br, "_fence", fence_then_stop)
        with pytest.raises(SystemExit):
            ring.enqueue(rr.make_message(1, 4096))
        monkeypatch.setattr(br, "_fence", fence)
        for i in range(2, 40):
            ring.enqueue(rr.make_message(i, 4096), timeout=10)
        ring.close()
        assert parent.poll(30)
        assert parent.recv() == (40, None)
    finally:
        ring.close()
        _reap([proc])


def test_idle_reader_sleeps_and_wakes(ipc_dir):
    ring = BroadcastRing.create(1, ipc_dir)
    parent, child = CTX.Pipe(duplex=False)
    proc = _start(rr.reader_idle, ring.handle(), 0, child)
    child.close()
    try:
        ring.wait_until_ready(timeout=30)
        assert parent.poll(30)
        pid = parent.recv()
        time.sleep(0.3)  # past the spin phase, into dequeue's blocking wait
        c0, t0 = _cpu_seconds(pid), time.monotonic()
        time.sleep(1.0)
        used = (_cpu_seconds(pid) - c0) / (time.monotonic() - t0)
        assert used < 0.3, f"idle reader used {used:.0%} of a core"
        ring.enqueue([b"wake", b"up"])
        assert parent.poll(10), "sleeping reader was not woken"
        assert parent.recv() == [b"wake", b"up"]
    finally:
        ring.close()
        _reap([proc])


def test_dead_reader_fails_writer_fast(ipc_dir):
    ring = BroadcastRing.create(2, ipc_dir, max_chunk_bytes=1024, n_chunks=2)
    procs = [_start(rr.reader_attach_and_wait, ring.handle(), r) for r in range(2)]
    try:
        ring.wait_until_ready(timeout=30)
        procs[1].kill()
        procs[1].join(5)
        t0 = time.monotonic()
        with pytest.raises(ReaderGone):
            for _ in range(10):  # the 3rd enqueue needs chunk 0 back
                ring.enqueue([b"x"], timeout=10)
        assert time.monotonic() - t0 < 5
    finally:
        ring.close()
        _reap(procs)


def test_sigkill_leaves_nothing_behind(ipc_dir):
    parent, child = CTX.Pipe(duplex=False)
    writer = _start(rr.writer_then_sleep, 1, ipc_dir, child)
    child.close()
    reader = None
    try:
        assert parent.poll(30)
        handle = parent.recv()
        reader = _start(rr.reader_attach_and_wait, handle, 0)
        assert parent.poll(30) and parent.recv() == "ready"
        os.kill(writer.pid, signal.SIGKILL)
        os.kill(reader.pid, signal.SIGKILL)
        writer.join(5)
        reader.join(5)
        assert _our_shm(writer.pid) == set()
        assert os.listdir(ipc_dir) == []
    finally:
        _reap([p for p in (writer, reader) if p is not None])
