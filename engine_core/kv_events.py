"""KV-cache events: which blocks the prefix cache holds, published over ZMQ in vLLM's wire format,
so that a prefix-aware router (Dynamo's KV router, llm-d's indexer) tracks Loom's cache exactly.

The block pool is the single source of truth: it records a BlockStored when a full block's hash is
committed, a BlockRemoved when a cached block is evicted (handed out again), and AllBlocksCleared on
reset_prefix_cache. The engine core takes the step's events and hands them as one KVEventBatch to
ZmqEventPublisher, whose thread encodes and sends them: nothing of the publishing runs in the step.

Wire format (vLLM's vllm/distributed/kv_events.py): multipart [topic, seq (8 bytes big-endian),
msgpack(KVEventBatch)]; a batch is the array [ts, [event, ...], data_parallel_rank] and an event a
tagged array ["BlockStored", block_hashes, parent_block_hash, token_ids, block_size, lora_id, medium,
lora_name]. Block hashes are the 32-byte digests of engine_core/kv_cache_manager.py hash_block.
A replay ROUTER answers [b"", start seq (8 bytes)] with every buffered [seq, payload] from there,
then [-1 (8 bytes signed), b""]."""
from __future__ import annotations

import logging
import queue
import threading
from collections import deque
from dataclasses import dataclass, replace
from itertools import count
from typing import Any

import msgspec
import zmq

from ipc.auth import CurveServer, PeerGuard, derive_keys

logger = logging.getLogger(__name__)

MEDIUM_GPU, MEDIUM_CPU = "GPU", "CPU"
# CURVE roles of the event sockets, keys derived from --engine-auth-key (ipc/auth.py)
KV_EVENTS_ROLE, KV_EVENTS_SUBSCRIBER_ROLE = "loom-kv-events", "loom-kv-events-subscriber"
LOOPBACK_HOSTS = ("127.0.0.1", "localhost", "::1")


class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


class KVCacheEvent(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, tag=True):
    """Base of the events; the tag is the class name, as vLLM's."""


class BlockStored(KVCacheEvent):
    block_hashes: list[bytes]          # consecutive blocks of one request, oldest first
    parent_block_hash: bytes | None    # the hash of the block before the first (None: it starts the prompt)
    token_ids: list[int]               # block_size tokens per block, concatenated
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None              # (required in vLLM's newest structs: always sent)
    # per block: the image content hashes that hash_block took as extra keys (None: text only)
    extra_keys: list[tuple[Any, ...] | None] | None = None


class BlockRemoved(KVCacheEvent):
    block_hashes: list[bytes]
    medium: str | None


class AllBlocksCleared(KVCacheEvent):
    pass


class KVEventBatch(EventBatch):
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]


@dataclass(frozen=True)
class KVEventsConfig:
    """--kv-events-config, vLLM's fields and defaults."""
    enable_kv_cache_events: bool = False
    publisher: str | None = None         # "zmq" or "null"; None: zmq when enabled (vLLM's default)
    endpoint: str = "tcp://*:5557"       # bind when it has a wildcard (or ipc://), else connect
    replay_endpoint: str | None = None
    buffer_steps: int = 10_000           # batches kept for replay
    hwm: int = 100_000
    max_queue_size: int = 100_000
    topic: str = ""

    @classmethod
    def parse(cls, d: dict) -> "KVEventsConfig":
        """The flag's JSON object; a ValueError names what is wrong."""
        known = set(cls.__dataclass_fields__)
        unknown = sorted(set(d) - known)
        if unknown:
            raise ValueError(f"--kv-events-config: unknown field(s) {unknown} (known: {sorted(known)})")
        cfg = cls(**d)
        if cfg.publisher is None:
            cfg = replace(cfg, publisher="zmq" if cfg.enable_kv_cache_events else "null")
        if cfg.publisher not in ("zmq", "null"):
            raise ValueError(f"--kv-events-config: publisher must be 'zmq' or 'null', got {cfg.publisher!r}")
        if cfg.buffer_steps < 1 or cfg.hwm < 0 or cfg.max_queue_size < 1:
            raise ValueError("--kv-events-config: buffer_steps and max_queue_size must be at least 1, hwm at least 0")
        for ep in (cfg.endpoint, cfg.replay_endpoint):
            if ep is not None and not ep.startswith(("tcp://", "ipc://", "inproc://")):
                raise ValueError(f"--kv-events-config: endpoint {ep!r} must start with tcp://, ipc:// or inproc://")
        return cfg

    @property
    def active(self) -> bool:
        return self.enable_kv_cache_events and self.publisher == "zmq"


def offset_endpoint_port(endpoint: str | None, data_parallel_rank: int) -> str | None:
    """Data-parallel rank r publishes on port + r (inproc/ipc: a _dp{r} suffix), as vLLM."""
    if not endpoint or data_parallel_rank == 0:
        return endpoint
    if endpoint.startswith("tcp://"):
        base, port = endpoint.rsplit(":", 1)
        return f"{base}:{int(port) + data_parallel_rank}"
    return f"{endpoint}_dp{data_parallel_rank}"


def _binds(endpoint: str) -> bool:
    """vLLM's rule: bind a wildcard or local transport, connect to a named host."""
    return "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://"))


def _off_loopback(endpoint: str) -> bool:
    if not endpoint.startswith("tcp://"):
        return False
    host = endpoint[len("tcp://"):].rsplit(":", 1)[0].strip("[]")
    return host not in LOOPBACK_HOSTS


class ZmqEventPublisher:
    """PUB socket plus an optional replay ROUTER, both owned by one thread fed through a queue."""

    END_SEQ = (-1).to_bytes(8, "big", signed=True)
    SHUTDOWN_TIMEOUT_S = 1.0

    def __init__(self, config: KVEventsConfig, data_parallel_rank: int = 0, auth_key: str | None = None):
        self.config = config
        self.data_parallel_rank = data_parallel_rank
        self.endpoint = offset_endpoint_port(config.endpoint, data_parallel_rank)
        self.replay_endpoint = offset_endpoint_port(config.replay_endpoint, data_parallel_rank)
        self._topic = config.topic.encode()
        self._queue: queue.Queue[KVEventBatch | None] = queue.Queue(maxsize=config.max_queue_size)
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=config.buffer_steps)
        self._seq = count()
        self.dropped = 0
        # its own context: the ZAP handler (PeerGuard) of a CURVE publisher covers this context only
        self._ctx = zmq.Context()
        self._guard: PeerGuard | None = None
        curve = self._curve(auth_key)
        self._pub = self._ctx.socket(zmq.PUB)
        self._pub.setsockopt(zmq.LINGER, 0)
        self._pub.set_hwm(config.hwm)
        self._replay: zmq.Socket | None = None
        try:
            self._open(self._pub, self.endpoint, curve)
            if self.replay_endpoint:
                self._replay = self._ctx.socket(zmq.ROUTER)
                self._replay.setsockopt(zmq.LINGER, 0)
                self._open(self._replay, self.replay_endpoint, curve)
        except zmq.ZMQError:
            self._close_sockets()
            raise
        self._thread = threading.Thread(target=self._run, name="kv-events-publisher", daemon=True)
        self._thread.start()
        logger.info("KV-cache events on %s%s%s", self.endpoint,
                    f" (replay {self.replay_endpoint})" if self.replay_endpoint else "",
                    " with CURVE" if curve else "")

    def _curve(self, auth_key: str | None) -> CurveServer | None:
        """CURVE, admitting only holders of the engine's auth key, when a socket is off loopback and a key
        is set (the engine protocol's threat model); without a key the stream is plain, as vLLM's."""
        off = [ep for ep in (self.endpoint, self.replay_endpoint) if ep and _off_loopback(ep)]
        if not off:
            return None
        if not auth_key:
            logger.warning("KV-cache events on %s are readable by anyone who reaches it: set --engine-auth-key "
                           "to require CURVE", off[0])
            return None
        self._guard = PeerGuard(self._ctx, "kv-events", (derive_keys(auth_key, KV_EVENTS_SUBSCRIBER_ROLE).public,))
        return CurveServer(derive_keys(auth_key, KV_EVENTS_ROLE))

    @staticmethod
    def _open(sock: zmq.Socket, endpoint: str, curve: CurveServer | None) -> None:
        if curve is not None:
            curve.apply(sock)
        if _binds(endpoint):
            sock.bind(endpoint)
        else:
            sock.connect(endpoint)

    def publish(self, batch: KVEventBatch) -> None:
        """From the engine loop: never blocks; a full queue drops the batch (and says so)."""
        if batch.data_parallel_rank is None:
            batch.data_parallel_rank = self.data_parallel_rank
        try:
            self._queue.put_nowait(batch)
        except queue.Full:
            self.dropped += 1
            if self.dropped == 1 or self.dropped % 1000 == 0:
                logger.warning("KV-cache event queue full: %d batches dropped", self.dropped)

    def _run(self) -> None:
        encoder = msgspec.msgpack.Encoder()
        while True:
            if self._replay is not None and self._replay.poll(0):
                try:
                    self._serve_replay()
                except Exception:   # a malformed request must not stop the stream
                    logger.exception("KV-cache events: replay request failed")
            try:
                batch = self._queue.get(timeout=0.05)
            except queue.Empty:
                continue
            if batch is None:
                return
            seq = next(self._seq)
            payload = encoder.encode(batch)
            try:
                self._pub.send_multipart((self._topic, seq.to_bytes(8, "big"), payload))
            except zmq.ZMQError:
                logger.exception("KV-cache events: send failed")
            self._buffer.append((seq, payload))

    def _serve_replay(self) -> None:
        frames = self._replay.recv_multipart()
        if len(frames) != 3:
            logger.warning("KV-cache events: a replay request of %d frames ignored", len(frames))
            return
        client, _, start = frames
        start_seq = int.from_bytes(start, "big")
        for seq, payload in list(self._buffer):
            if seq >= start_seq:
                self._replay.send_multipart((client, b"", seq.to_bytes(8, "big"), payload))
        self._replay.send_multipart((client, b"", self.END_SEQ, b""))

    def shutdown(self) -> None:
        """Send what is queued (up to a second), then close the sockets."""
        try:
            self._queue.put(None, timeout=self.SHUTDOWN_TIMEOUT_S)
        except queue.Full:
            pass
        self._thread.join(timeout=self.SHUTDOWN_TIMEOUT_S)
        self._close_sockets()

    def _close_sockets(self) -> None:
        for sock in (self._pub, self._replay):
            if sock is not None:
                sock.close(linger=0)
        if self._guard is not None:
            self._guard.close()
        self._ctx.term()


def make_publisher(raw: dict, data_parallel_rank: int, auth_key: str | None) -> ZmqEventPublisher | None:
    cfg = KVEventsConfig.parse(raw) if raw else KVEventsConfig()
    return ZmqEventPublisher(cfg, data_parallel_rank, auth_key) if cfg.active else None
