"""Reader entry points for tests/test_broadcast_ring.py (module level, so that
multiprocessing 'spawn' children can import them)."""
from __future__ import annotations

import os
import struct
import time

from shm.broadcast_ring import BroadcastRing, RingClosed


def payload(i: int, n: int) -> bytes:
    return (struct.pack("<I", i) * (n // 4 + 1))[:n]


def make_message(i: int, big_size: int) -> list[bytes]:
    """Deterministic message i: mostly small, every 7th bigger than a chunk,
    now and then empty or with an empty frame."""
    if i % 50 == 13:
        return []
    head = b"msg-%d" % i
    if i % 7 == 3:
        return [head, payload(i, big_size + i), b""]
    if i % 11 == 5:
        return [head, b"", payload(i, 10)]
    return [head, payload(i, 100 + (i * 37) % 900)]


def reader_verify(handle, rank: int, big_size: int, slow_every: int, conn) -> None:
    """Dequeue until RingClosed, checking every message; report (count, error)."""
    ring = BroadcastRing.attach(handle, rank)
    count, error = 0, None
    try:
        while True:
            try:
                got = ring.dequeue(timeout=20.0)
            except RingClosed:
                break
            want = make_message(count, big_size)
            if [bytes(f) for f in got] != want:
                error = f"message {count}: got {[bytes(f)[:16] for f in got]}"
                break
            count += 1
            if slow_every and count % slow_every == 0:
                time.sleep(0.002)  # a slow reader: exercises backpressure
    except Exception as e:  # report instead of dying silently
        error = f"{type(e).__name__}: {e}"
    finally:
        ring.close()
    conn.send((count, error))
    conn.close()


def reader_idle(handle, rank: int, conn) -> None:
    """Attach, report our pid, block in dequeue(None), report what arrived."""
    ring = BroadcastRing.attach(handle, rank)
    try:
        conn.send(os.getpid())
        got = ring.dequeue(timeout=None)
        conn.send([bytes(f) for f in got])
    finally:
        ring.close()
        conn.close()


def reader_attach_and_wait(handle, rank: int) -> None:
    """Attach and sit there (the test kills us)."""
    ring = BroadcastRing.attach(handle, rank)  # keep it referenced
    time.sleep(60)
    ring.close()


def writer_then_sleep(n_readers: int, ipc_dir: str, conn) -> None:
    """A writer process: create, hand out the handle, wait for the readers,
    report, then sit there (the test kills us)."""
    ring = BroadcastRing.create(n_readers, ipc_dir, max_chunk_bytes=4096, n_chunks=4)
    conn.send(ring.handle())
    ring.wait_until_ready(timeout=20.0)
    conn.send("ready")
    time.sleep(60)
