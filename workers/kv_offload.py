"""HostKVTier: the worker's side of the CPU tier of the KV cache (engine_core/kv_offload.py owns
which hash sits in which slot): one host tensor per layer for keys and one for values, pinned on
CUDA, each slot one block of this rank's heads, and the copies of a step's KVTransfers.

On CUDA the copies run on two side streams, one per direction, so that a step's stores (D2H) and
loads (H2D) share the link's two directions: a re-hit's step stores the blocks it evicts and loads
the prompt's blocks over them (the bench's 32k re-hit: 4.2 GB each way, ~85 ms each at ~50 GB/s;
one stream ran them one after the other). Both streams start after an event recorded on the
compute stream when the step is launched (the stores read blocks every earlier step has written,
before this step writes over them) and after the previous step's copies. They go layer by layer
(in chunks of blocks within a layer): a layer's loads follow its stores on the other stream (they
may write the blocks those read, or read the slots those write; other layers' copies touch other
tensors), so the loads run a layer behind the stores. An event after each layer's copies lets a
forward run in piecewise CUDA graphs wait for each layer right before its first use (wait_layer):
the copies of layer L run under the compute of layers before L (a multi-turn request's 27k tokens
of loads under the prefill of its new turn; the stores of a 0%-hit prefill's evictions under its
own forward). Other forwards wait for all the copies first (wait_forward). Either way the step's
input preparation is not queued behind them. The host tensors and
the KV cache live as long as the worker, so no tensor crosses streams that the allocator could
reuse early. Into and out of pinned memory the copies are asynchronous: the host never waits for
them. On CPU they are plain copies, in the order the streams issue them."""
from __future__ import annotations

import contextlib
import logging
from dataclasses import dataclass

import torch

from ipc.messages import KVTransfers

logger = logging.getLogger(__name__)
_DIRECT_RUNS = 8        # at most this many runs of consecutive blocks and slots in a chunk: copied directly
_CHUNK_BLOCKS = 256     # blocks per chunk (Llama-3.1-8B: 8 MiB per layer's keys or values)

Chunk = tuple[list[int], list[int]]   # (GPU blocks, host slots) copied together


@dataclass
class _ChunkPlan:
    runs: list[tuple[int, int, int]]   # direct: (block, slot, length); staged: (slot, row in the chunk, length)
    rows: torch.Tensor | None          # staged: the chunk's blocks, on the device (None: direct)


class HostKVTier:
    def __init__(self, num_slots: int, kv_caches: list[tuple[torch.Tensor, torch.Tensor]]):
        pin = kv_caches[0][0].is_cuda
        self.num_slots = num_slots
        self.host = [tuple(torch.empty((num_slots, *t.shape[1:]), dtype=t.dtype, pin_memory=pin) for t in kv)
                     for kv in kv_caches]
        device = kv_caches[0][0].device
        self.store_stream = torch.cuda.Stream(device) if pin else None   # D2H
        self.load_stream = torch.cuda.Stream(device) if pin else None    # H2D
        # each stream's last copies, until the compute stream waits on them (wait_forward); a step whose
        # copies no forward followed (nothing to run) has the next step's copies wait on them instead
        self._copied: list[torch.cuda.Event] = []
        # this step's events after each layer's copies (stores, then loads), keyed by the id of the
        # layer's key cache, until the compute stream waits on them (wait_layer, wait_forward)
        self._layers: dict[int, list[torch.cuda.Event | None]] = {}
        self._stagings: dict[tuple, torch.Tensor] = {}   # (direction, dtype, block shape) -> a chunk on the device
        self.num_host_copies = 0   # copies into or out of host memory, since start (tests, logs)
        logger.info("CPU KV tier: %d blocks, %.2f GiB of %shost memory", num_slots, self.nbytes() / 2 ** 30,
                    "pinned " if pin else "")

    def apply(self, xfer: KVTransfers, kv_caches: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Queue the step's copies layer by layer: each layer's stores, then (on the other stream, after
        them) its loads, with an event after each layer's (wait_layer)."""
        if self.store_stream is not None:
            launched = torch.cuda.current_stream(self.store_stream.device).record_event()   # earlier steps' writes
            for stream in (self.store_stream, self.load_stream):
                for event in (launched, *self._copied):
                    stream.wait_event(event)
        stores = self._plan(_chunks(xfer.store_blocks, xfer.store_slots), self.store_stream, kv_caches)
        loads = self._plan(_chunks(xfer.load_blocks, xfer.load_slots), self.load_stream, kv_caches)
        self._layers = {}
        for dev_kv, host_kv in zip(kv_caches, self.host):
            events = []
            if stores:
                with self._on(self.store_stream):
                    for plan in stores:
                        self._move(plan, dev_kv, host_kv, store=True)
                    events.append(self._record(self.store_stream))
            if loads:
                with self._on(self.load_stream):
                    if events and self.load_stream is not None:   # (a layer's loads may write the blocks
                        self.load_stream.wait_event(events[0])    # its stores read, or read slots they write)
                    for plan in loads:
                        self._move(plan, dev_kv, host_kv, store=False)
                    events.append(self._record(self.load_stream))
            self._layers[id(dev_kv[0])] = events
        if self.store_stream is not None:
            self._copied = [self._record(self.store_stream), self._record(self.load_stream)]

    def wait_layer(self, kv_cache: tuple[torch.Tensor, torch.Tensor]) -> None:
        """Before the step first touches this layer's cache (writes its new keys and values, then reads
        it in attention): the compute stream waits on that layer's copies only, so that the other
        layers' copies run under the layers computed before them (workers/piecewise_graphs.py)."""
        events = self._layers.pop(id(kv_cache[0]), None)
        if events is None and self._layers:   # a cache the copies do not know (a view?): never too early
            self.wait_forward()
        elif events and events[0] is not None:
            current = torch.cuda.current_stream(self.store_stream.device)
            for event in events:
                current.wait_event(event)

    def wait_forward(self) -> None:
        """Before a forward that does not wait layer by layer (and after one that did, for any layer
        it did not reach): the current (compute) stream waits on all the copies, on the device, never
        the host."""
        if self._copied:
            current = torch.cuda.current_stream(self.store_stream.device)
            for event in self._copied:
                current.wait_event(event)
            self._copied = []
        self._layers = {}

    @staticmethod
    def _on(stream: torch.cuda.Stream | None):
        return contextlib.nullcontext() if stream is None else torch.cuda.stream(stream)

    @staticmethod
    def _record(stream: torch.cuda.Stream) -> torch.cuda.Event | None:
        return None if stream is None else stream.record_event()

    def _plan(self, chunks: list[Chunk], stream: torch.cuda.Stream | None,
              kv_caches: list[tuple[torch.Tensor, torch.Tensor]]) -> list[_ChunkPlan]:
        """How each chunk is copied, for every layer alike. A few runs of consecutive blocks and slots:
        copied straight between the cache and the tier. Blocks scattered over the GPU cache (the free
        list hands out blocks in eviction order: a 32k prompt's 2,048 blocks came in ~2,000 runs,
        3.6 s on the H200 when each was a copy) go through a staging tensor: one gather or scatter of
        the blocks on the device (their indices sent once, on the chunk's stream), and one copy per
        run of consecutive host slots (the chunks are in slot order)."""
        device = kv_caches[0][0].device
        plans = []
        for blocks, slots in chunks:
            direct = _runs(blocks, slots)
            if len(direct) <= _DIRECT_RUNS:
                plans.append(_ChunkPlan(direct, None))
                continue
            with self._on(stream):
                rows = torch.tensor(blocks, dtype=torch.int64, pin_memory=device.type == "cuda")
                plans.append(_ChunkPlan(_runs(slots, range(len(blocks))), rows.to(device, non_blocking=True)))
        return plans

    def _move(self, plan: _ChunkPlan, dev_kv: tuple[torch.Tensor, ...], host_kv: tuple[torch.Tensor, ...],
              store: bool) -> None:
        """One chunk of one layer's keys and values, on the current stream."""
        self.num_host_copies += len(plan.runs) * len(dev_kv)
        for dev, host in zip(dev_kv, host_kv):
            if plan.rows is None:   # runs of (block, slot, length)
                for block, slot, n in plan.runs:
                    if store:
                        host[slot:slot + n].copy_(dev[block:block + n], non_blocking=True)
                    else:
                        dev[block:block + n].copy_(host[slot:slot + n], non_blocking=True)
                continue
            staging = self._staging(dev, store)[:len(plan.rows)]   # runs of (slot, row in the chunk, length)
            if store:
                torch.index_select(dev, 0, plan.rows, out=staging)
                for slot, row, n in plan.runs:
                    host[slot:slot + n].copy_(staging[row:row + n], non_blocking=True)
            else:
                for slot, row, n in plan.runs:
                    staging[row:row + n].copy_(host[slot:slot + n], non_blocking=True)
                dev.index_copy_(0, plan.rows, staging)

    def _staging(self, dev: torch.Tensor, store: bool) -> torch.Tensor:
        """A chunk of blocks shaped as `dev`'s, one per direction, reused by every copy of its stream
        (ordered there). A D2H copy out of it is asynchronous: the next chunk's gather into it comes
        after on the same stream, so it never overwrites a block still being copied out."""
        key = (store, dev.dtype, tuple(dev.shape[1:]))
        buf = self._stagings.get(key)
        if buf is None:
            buf = self._stagings[key] = torch.empty((_CHUNK_BLOCKS, *dev.shape[1:]), dtype=dev.dtype,
                                                    device=dev.device)
        return buf

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for kv in self.host for t in kv)


def _chunks(blocks: list[int], slots: list[int]) -> list[Chunk]:
    """The pairs in slot order (_by_slot), _CHUNK_BLOCKS at a time."""
    blocks, slots = _by_slot(blocks, slots)
    return [(blocks[c:c + _CHUNK_BLOCKS], slots[c:c + _CHUNK_BLOCKS]) for c in range(0, len(blocks), _CHUNK_BLOCKS)]


def _by_slot(blocks: list[int], slots: list[int]) -> tuple[list[int], list[int]]:
    """The pairs in host slot order, so that the host side is copied in runs of consecutive slots
    (the device side gathers or scatters any order). A prompt's blocks are evicted tail first, so
    its slots go down along the prefix, and its re-hit loads them in prefix order: unsorted, a run
    per block, one copy per block per layer's keys or values (the bench's 32k re-hit: 127k copies,
    ~450 ms of launches on CPU; its TTFT was 1.2 s on the H200, against 1.5 s recomputing). Stable: a slot stored twice in one step keeps the later store."""
    order = sorted(range(len(slots)), key=slots.__getitem__)
    return [blocks[i] for i in order], [slots[i] for i in order]


def _runs(src: list[int], dst: list[int]) -> list[tuple[int, int, int]]:
    """(src start, dst start, length) of the runs where both sides go up by one."""
    runs: list[tuple[int, int, int]] = []
    for a, b in zip(src, dst):
        if runs and runs[-1][0] + runs[-1][2] == a and runs[-1][1] + runs[-1][2] == b:
            runs[-1] = (runs[-1][0], runs[-1][1], runs[-1][2] + 1)
        else:
            runs.append((a, b, 1))
    return runs
