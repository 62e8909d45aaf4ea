"""The shared-memory object store: zero-copy reads, references, oldest-first eviction only of
entries every reader is done with, unlink once every reader has mapped it, idempotent close."""
from __future__ import annotations

import os

import numpy as np
import pytest

from shm.object_store import ObjectStoreReader, ObjectStoreWriter, StoreFull, segment_name


def _name(tag: str) -> str:
    return segment_name(0) + f"_{tag}_{os.getpid()}"


def test_put_get_zero_copy_and_reference():
    w = ObjectStoreWriter(_name("a"), 1 << 20, n_readers=2)
    r0, r1 = ObjectStoreReader(0), ObjectStoreReader(1)
    try:
        px = np.arange(12, dtype=np.float32).reshape(3, 4)
        addr = w.put("k", {"pixel_values": px, "grid": np.array([1, 2, 3])})
        assert w.put("k", {"pixel_values": px}) == addr and w.lookup("k") == addr  # only referenced
        got = r0.get(w.name, addr)
        np.testing.assert_array_equal(got["pixel_values"], px)
        np.testing.assert_array_equal(got["grid"], [1, 2, 3])
        assert not got["pixel_values"].flags.owndata  # a view of the shared memory
        assert os.path.exists(f"/dev/shm/{w.name}")
        r1.get(w.name, addr)
        w.maybe_unlink()
        assert not os.path.exists(f"/dev/shm/{w.name}"), "every reader mapped it: unlinked"
    finally:
        for x in (r0, r1, w):
            x.close()
            x.close()  # idempotent


def test_oldest_first_eviction_only_when_every_reader_is_done():
    w = ObjectStoreWriter(_name("b"), 64 << 10, n_readers=2)
    r0, r1 = ObjectStoreReader(0), ObjectStoreReader(1)
    try:
        big = np.zeros(5000, dtype=np.float32)   # 20 kB: three fit in 64 kB
        addrs = [w.put(f"k{i}", {"x": big + i}) for i in range(3)]
        with pytest.raises(StoreFull):
            w.put("k3", {"x": big})              # nobody is done with anything
        r0.release(w.name, addrs[0])
        with pytest.raises(StoreFull):
            w.put("k3", {"x": big})              # reader 1 still uses k0
        r1.release(w.name, addrs[0])
        w.put("k3", {"x": big + 3})              # k0, the oldest, goes
        assert w.lookup("k0") is None and w.lookup("k1") == addrs[1]
        np.testing.assert_array_equal(r0.get(w.name, addrs[1])["x"], big + 1)  # untouched
        with pytest.raises(StoreFull, match="does not fit"):
            w.put("huge", {"x": np.zeros(1 << 20, np.uint8)})
    finally:
        for x in (r0, r1, w):
            x.close()


def test_an_entry_still_in_use_is_stepped_over():
    """A long request's image at the ring's tail: newer images take the room around it (they
    waited behind it for seconds, then got a 503, with the store nearly empty)."""
    w = ObjectStoreWriter(_name("d"), 64 << 10, n_readers=1)
    r = ObjectStoreReader(0)
    try:
        item = np.zeros(2500, dtype=np.float32)   # 10 kB: five fit in 64 kB
        held = w.put("held", {"x": item + 7})
        for i in range(40):   # eight laps of the ring, each item released when done
            addr = w.put(f"k{i}", {"x": item + i})
            assert r.get(w.name, addr)["x"][0] == i
            r.release(w.name, addr)
        np.testing.assert_array_equal(r.get(w.name, held)["x"], item + 7)   # untouched throughout
        assert w.lookup("held") == held
        held2 = w.put("held2", {"x": item + 8})   # two held: what is left still cycles
        for i in range(40, 80):
            r.release(w.name, w.put(f"k{i}", {"x": item + i}))
        np.testing.assert_array_equal(r.get(w.name, held2)["x"], item + 8)
        with pytest.raises(StoreFull, match="in use"):   # nothing free anywhere: still refused
            for i in range(10):
                w.put(f"pin{i}", {"x": item})
    finally:
        r.close()
        w.close()


def test_close_unlinks_and_bounded_size_under_many_items():
    w = ObjectStoreWriter(_name("c"), 256 << 10, n_readers=1)
    r = ObjectStoreReader(0)
    try:
        for i in range(1000):  # 1,000 requests of distinct tiny images, each released when done
            addr = w.put(f"img{i}", {"x": np.full(1000, i, np.float32)})
            assert r.get(w.name, addr)["x"][0] == i
            r.release(w.name, addr)
        assert w.used_bytes() <= 256 << 10 and w.num_entries() < 100
    finally:
        r.close()
        w.close()
    assert not os.path.exists(f"/dev/shm/{w.name}")


def test_a_reader_refuses_a_segment_too_small_for_a_header():
    """An attached client may name any loom_mm_* segment; one shorter than the header was a
    struct.error in the worker's release, which ended the engine."""
    name = _name("tiny")
    with open(f"/dev/shm/{name}", "wb") as f:
        f.write(b"\0" * 10)
    r = ObjectStoreReader(0)
    try:
        with pytest.raises(ValueError):
            r.release(name, 128)
    finally:
        r.close()
        os.unlink(f"/dev/shm/{name}")


def test_concurrent_puts_copy_at_once_and_each_entry_is_whole():
    """Media threads put at once (the copies run outside the store's lock): every entry reads back
    whole; two puts of one item made at once may each make a copy, held by its own request,
    and lookups find one; evicting either copy leaves the other's lookup intact."""
    import threading
    w = ObjectStoreWriter(_name("e"), 8 << 20, n_readers=1)
    r = ObjectStoreReader(0)
    try:
        items = {f"k{i % 6}": np.full((256, 256), i % 6, dtype=np.float32) for i in range(6)}
        addrs: dict[int, tuple[str, int]] = {}
        start = threading.Barrier(12)

        def put(i):
            key = f"k{i % 6}"
            start.wait()
            addrs[i] = key, w.put(key, {"pixel_values": items[key]})
        threads = [threading.Thread(target=put, args=(i,)) for i in range(12)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        for key, addr in addrs.values():
            np.testing.assert_array_equal(r.get(w.name, addr)["pixel_values"], items[key])
        for key in items:
            found = w.lookup(key)   # (a reference, given back)
            assert found in {a for k, a in addrs.values() if k == key}
            r.release(w.name, found)
        for key, addr in addrs.values():   # every request done with its entry: all may be evicted
            r.release(w.name, addr)
        for i in range(40):   # the ring goes round: every old entry (and any second copy) is evicted
            r.release(w.name, w.put(f"new{i}", {"pixel_values": np.zeros((256, 256), dtype=np.float32)}))
        assert all(w.lookup(k) is None for k in items)
    finally:
        r.close()
        w.close()
