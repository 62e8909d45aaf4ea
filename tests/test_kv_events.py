"""KV-cache events: a subscriber written from vLLM's documented wire format (its structs are copied
here, not imported from Loom) rebuilds the block pool's exact set of cached hashes through random
requests with evictions, preemptions and reset_prefix_cache, also after a replay; the engine's
BlockStored events carry a request's tokens and Loom's own hashes; CURVE off loopback."""
from __future__ import annotations

import random
import socket
import time
from typing import Any

import msgspec
import pytest
import zmq

from engine_core.kv_cache_manager import hash_block
from engine_core.kv_events import (KV_EVENTS_ROLE, KV_EVENTS_SUBSCRIBER_ROLE, KVEventBatch, KVEventsConfig,
                                   ZmqEventPublisher, offset_endpoint_port)
from engine_core.kv_offload import CPUTier
from engine_core.scheduler import Scheduler
from ipc.auth import derive_keys
from tests.test_scheduler import cfg, fake_step, req


# ---- vLLM's structs (vllm/distributed/kv_events.py), as a router written from its docs defines them


class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


class KVCacheEvent(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, tag=True):
    pass


class BlockStored(KVCacheEvent):
    block_hashes: list[bytes | int]
    parent_block_hash: bytes | int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[tuple[Any, ...] | None] | None = None


class BlockRemoved(KVCacheEvent):
    block_hashes: list[bytes | int]
    medium: str | None


class AllBlocksCleared(KVCacheEvent):
    pass


class VllmKVEventBatch(EventBatch):
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]


DECODER = msgspec.msgpack.Decoder(type=VllmKVEventBatch)


class Router:
    """What a prefix-aware router keeps: the set of cached block hashes, from the stream alone."""

    def __init__(self):
        self.media: dict[str, dict[bytes, list[int]]] = {"GPU": {}, "CPU": {}}   # medium -> hash -> its tokens
        self.next_seq = 0
        self.removed = self.cleared = 0

    def apply(self, seq: int, payload: bytes) -> None:
        assert seq == self.next_seq, f"gap: got {seq}, expected {self.next_seq}"
        self.next_seq = seq + 1
        for ev in DECODER.decode(payload).events:
            if isinstance(ev, BlockStored):
                assert len(ev.token_ids) == ev.block_size * len(ev.block_hashes)
                blocks = self.media[ev.medium]
                for i, h in enumerate(ev.block_hashes):
                    assert h not in blocks
                    blocks[h] = ev.token_ids[i * ev.block_size:(i + 1) * ev.block_size]
            elif isinstance(ev, BlockRemoved):
                for h in ev.block_hashes:
                    del self.media[ev.medium][h]
                self.removed += len(ev.block_hashes)
            else:
                for blocks in self.media.values():
                    blocks.clear()
                self.cleared += 1

    @property
    def blocks(self) -> dict[bytes, list[int]]:
        return self.media["GPU"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _subscribe(ctx: zmq.Context, endpoint: str, pub: ZmqEventPublisher, topic: bytes = b"",
               curve: tuple | None = None) -> zmq.Socket:
    """A SUB socket past the slow-joiner window: empty batches go out until one arrives (they take
    sequence numbers; the caller reads from the seq after the last one)."""
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.LINGER, 0)
    if curve:
        sub.curve_secretkey, sub.curve_publickey, sub.curve_serverkey = curve
    sub.setsockopt(zmq.SUBSCRIBE, topic)
    sub.connect(endpoint)
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        pub.publish(KVEventBatch(time.time(), []))
        if sub.poll(50):
            return sub
    raise AssertionError("the subscriber never received a batch")


def _drain(sub: zmq.Socket, timeout_ms: int = 200) -> None:
    """Read the warm-up batches still on their way."""
    while sub.poll(timeout_ms):
        sub.recv_multipart()


def _recv(sub: zmq.Socket) -> tuple[int, bytes]:
    assert sub.poll(3000), "a published batch did not arrive"
    _, seq, payload = sub.recv_multipart()
    return int.from_bytes(seq, "big"), payload


@pytest.fixture
def zctx():
    ctx = zmq.Context()
    yield ctx
    ctx.destroy(linger=0)


def _publisher(tmp_path, **kw) -> ZmqEventPublisher:
    conf = KVEventsConfig.parse({"enable_kv_cache_events": True, "publisher": "zmq",
                                 "endpoint": f"ipc://{tmp_path}/pub", "replay_endpoint": f"ipc://{tmp_path}/replay",
                                 "topic": "kv-events", **kw})
    return ZmqEventPublisher(conf)


@pytest.mark.parametrize("cpu_slots", [0, 10])
def test_router_rebuilds_the_cache_through_evictions_preemptions_and_resets(tmp_path, zctx, cpu_slots):
    """Random requests on a small pool (so blocks are evicted and requests preempted): after every
    batch the router's GPU set equals the pool's cached hashes (and its CPU set the CPU tier's, with
    one), and a replay rebuilds them too."""
    pub = _publisher(tmp_path)
    try:
        sub = _subscribe(zctx, f"ipc://{tmp_path}/pub", pub, b"kv-events")
        _drain(sub)
        s = Scheduler(cfg(max_num_seqs=4, max_num_batched_tokens=32), 24)
        s.kv.pool.kv_events = []
        tier = None
        if cpu_slots:
            tier = s.kv.pool.cpu_tier = CPUTier(cpu_slots)
            tier.kv_events = s.kv.pool.kv_events
        router = Router()
        rng = random.Random(0)
        prefixes = [[rng.randrange(1, 50) for _ in range(rng.randrange(4, 20))] for _ in range(6)]
        first_seq = None
        for n in range(400):
            p = rng.choice(prefixes) + [rng.randrange(1, 50) for _ in range(rng.randrange(1, 12))]
            s.add_request(req(f"r{n}", p, max_tokens=rng.randrange(1, 6)))
            for _ in range(rng.randrange(1, 4)):
                fake_step(s, token=rng.randrange(1, 50))
            if n % 97 == 96:
                while s.has_unfinished():
                    fake_step(s)
                assert s.reset_prefix_cache(keep_cpu_tier=n % 2 == 0)
            events = s.kv.pool.take_events()
            if events:
                pub.publish(KVEventBatch(time.time(), events))
                seq, payload = _recv(sub)
                if first_seq is None:
                    first_seq = router.next_seq = seq
                router.apply(seq, payload)
                assert set(router.blocks) == set(s.kv.pool.cached)
                assert set(router.media["CPU"]) == (set(tier.slots) if tier else set())
        assert router.next_seq > first_seq + 100
        assert router.removed > 50 and router.cleared >= (2 if tier else 4)   # evictions and resets did happen

        # replay from a chosen sequence number onto a router that saw everything before it
        cut = first_seq + (router.next_seq - first_seq) // 2
        replayed = Router()
        dealer = zctx.socket(zmq.DEALER)
        dealer.setsockopt(zmq.LINGER, 0)
        dealer.connect(f"ipc://{tmp_path}/replay")
        dealer.send_multipart([b"", first_seq.to_bytes(8, "big")])
        frames = []
        while True:
            assert dealer.poll(3000)
            _, seq, payload = dealer.recv_multipart()
            if seq == (-1).to_bytes(8, "big", signed=True):
                break
            frames.append((int.from_bytes(seq, "big"), payload))
        assert frames[0][0] == first_seq and frames[-1][0] == router.next_seq - 1
        replayed.next_seq = first_seq
        for seq, payload in frames:
            replayed.apply(seq, payload)
        assert replayed.media == router.media
        if tier:
            assert tier.num_loaded > 0 and tier.num_stored > 0
        # and from the cut only: exactly the batches from there
        dealer.send_multipart([b"", cut.to_bytes(8, "big")])
        seqs = []
        while True:
            _, seq, _ = dealer.recv_multipart()
            if seq == (-1).to_bytes(8, "big", signed=True):
                break
            seqs.append(int.from_bytes(seq, "big"))
        assert seqs == list(range(cut, router.next_seq))
    finally:
        pub.shutdown()


def test_events_record_stores_removals_and_clears():
    """The pool's own records: tokens and chained hashes of a request's full blocks, the eviction of
    each cached block, and AllBlocksCleared."""
    s = Scheduler(cfg(), 6)
    s.kv.pool.kv_events = []
    prompt = list(range(100, 113))   # 13 tokens: 3 full blocks of 4
    s.add_request(req("a", prompt, max_tokens=1))
    while s.has_unfinished():
        fake_step(s)
    (stored,) = [e for e in s.kv.pool.take_events()]
    h0 = hash_block(None, prompt[:4])
    h1 = hash_block(h0, prompt[4:8])
    assert stored.block_hashes == [h0, h1, hash_block(h1, prompt[8:12])]
    assert stored.parent_block_hash is None and stored.token_ids == prompt[:12] and stored.block_size == 4
    # a different prompt of 6 blocks evicts all three
    s.add_request(req("b", list(range(200, 221)), max_tokens=1))
    while s.has_unfinished():
        fake_step(s)
    removed = [h for e in s.kv.pool.take_events() if type(e).__name__ == "BlockRemoved" for h in e.block_hashes]
    assert sorted(removed) == sorted(stored.block_hashes)
    assert s.reset_prefix_cache()
    assert [type(e).__name__ for e in s.kv.pool.take_events()] == ["AllBlocksCleared"]


def test_config_and_port_offsets():
    assert offset_endpoint_port("tcp://*:5557", 2) == "tcp://*:5559"
    assert offset_endpoint_port("tcp://[::1]:5557", 1) == "tcp://[::1]:5558"
    assert offset_endpoint_port("ipc:///tmp/x", 1) == "ipc:///tmp/x_dp1"
    assert offset_endpoint_port("tcp://*:5557", 0) == "tcp://*:5557"
    assert not KVEventsConfig.parse({}).active
    assert KVEventsConfig.parse({"enable_kv_cache_events": True}).active   # zmq by default when enabled
    assert not KVEventsConfig.parse({"enable_kv_cache_events": True, "publisher": "null"}).active
    for bad in ({"publisher": "kafka"}, {"endpoint": "http://x"}, {"buffer_steps": 0}, {"enable": True}):
        with pytest.raises(ValueError):
            KVEventsConfig.parse(bad)


def test_curve_off_loopback_admits_only_key_holders(zctx):
    port = _free_port()
    conf = KVEventsConfig.parse({"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": f"tcp://*:{port}"})
    pub = ZmqEventPublisher(conf, auth_key="secret")
    try:
        server = derive_keys("secret", KV_EVENTS_ROLE).public
        mine = derive_keys("secret", KV_EVENTS_SUBSCRIBER_ROLE)
        sub = _subscribe(zctx, f"tcp://127.0.0.1:{port}", pub, curve=(mine.secret, mine.public, server))
        wrong = derive_keys("other", KV_EVENTS_SUBSCRIBER_ROLE)
        bad = zctx.socket(zmq.SUB)
        bad.setsockopt(zmq.LINGER, 0)
        bad.curve_secretkey, bad.curve_publickey, bad.curve_serverkey = wrong.secret, wrong.public, server
        bad.setsockopt(zmq.SUBSCRIBE, b"")
        bad.connect(f"tcp://127.0.0.1:{port}")
        plain = zctx.socket(zmq.SUB)
        plain.setsockopt(zmq.LINGER, 0)
        plain.setsockopt(zmq.SUBSCRIBE, b"")
        plain.connect(f"tcp://127.0.0.1:{port}")
        time.sleep(0.3)
        for _ in range(5):
            pub.publish(KVEventBatch(time.time(), []))
        assert sub.poll(1000)
        assert not bad.poll(300) and not plain.poll(50)
    finally:
        pub.shutdown()


def test_engine_publishes_the_blocks_of_a_request(model_factory, tmp_path, zctx):
    """Through LLM in-process: the request's full blocks arrive with its tokens and Loom's hashes,
    and reset_prefix_cache sends AllBlocksCleared."""
    from frontend import LLM, SamplingParams
    endpoint = f"ipc://{tmp_path}/ev"
    sub = zctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.setsockopt(zmq.LINGER, 0)
    sub.connect(endpoint)   # ipc: connect before bind is fine, the first batch is not lost once bound
    prompt = list(range(10, 31))   # 21 tokens: 5 full blocks of 4
    with LLM(model_factory("qwen3"), multiprocess=False, max_model_len=64, block_size=4,
             kv_events_config={"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": endpoint}) as llm:
        time.sleep(0.3)
        out = llm.generate([{"prompt_token_ids": prompt}], SamplingParams(temperature=0, max_tokens=3,
                                                                          ignore_eos=True), use_tqdm=False)
        assert llm.reset_prefix_cache()
        llm.generate([{"prompt_token_ids": prompt}], SamplingParams(max_tokens=1), use_tqdm=False)
        events = []
        while sub.poll(1000):
            _, _, payload = sub.recv_multipart()
            events += DECODER.decode(payload).events
    tokens = prompt + list(out[0].outputs[0].token_ids)
    hashes, parent = [], None
    for i in range(len(tokens) // 4):
        parent = hash_block(parent, tokens[i * 4:(i + 1) * 4])
        hashes.append(parent)
    clear = next(i for i, e in enumerate(events) if isinstance(e, AllBlocksCleared))
    before = [h for e in events[:clear] if isinstance(e, BlockStored) for h in e.block_hashes]
    assert before == hashes[:len(before)] and len(before) >= 5
    assert [t for e in events[:clear] if isinstance(e, BlockStored) for t in e.token_ids] == tokens[:4 * len(before)]
    after = [h for e in events[clear:] if isinstance(e, BlockStored) for h in e.block_hashes]
    assert after[:5] == hashes[:5]
