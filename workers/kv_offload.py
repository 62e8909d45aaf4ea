"""HostKVTier: the worker's side of the CPU tier of the KV cache (engine_core/kv_offload.py owns
which hash sits in which slot): one host tensor per layer for keys and one for values, pinned on
CUDA, each slot one block of this rank's heads, and the copies of a step's KVTransfers.

On CUDA the copies run on two side streams, one per direction, so that a step's stores (D2H) and
loads (H2D) share the link's two directions: a re-hit's step stores the blocks it evicts and loads
the prompt's blocks over them (the bench's 32k re-hit: 4.2 GB each way, ~85 ms each at ~50 GB/s;
one stream ran them one after the other). Both streams start after an event recorded on the
compute stream when the step is launched (the stores read blocks every earlier step has written,
before this step writes over them) and after the previous step's copies. The copies go in chunks
of blocks, and a chunk of loads waits only on the chunks of stores it must follow (those that read
the blocks it writes or write the slots it reads: _load_waits), so the loads follow the stores a
chunk behind. The compute stream waits on both streams only right before the step's forward
(wait_forward), so the step's input preparation is not queued behind them. The host tensors and
the KV cache live as long as the worker, so no tensor crosses streams that the allocator could
reuse early. Into and out of pinned memory the copies are asynchronous: the host never waits for
them. On CPU they are plain copies, in the order the streams issue them."""
from __future__ import annotations

import contextlib
import logging

import torch

from ipc.messages import KVTransfers

logger = logging.getLogger(__name__)
_DIRECT_RUNS = 8        # at most this many runs of consecutive blocks and slots in a chunk: copied directly
_CHUNK_BLOCKS = 256     # blocks per chunk (Llama-3.1-8B: 8 MiB per layer's keys or values)

Chunk = tuple[list[int], list[int]]   # (GPU blocks, host slots) copied together


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
        self._stagings: dict[tuple, torch.Tensor] = {}   # (direction, dtype, block shape) -> a chunk on the device
        self.num_host_copies = 0   # copies into or out of host memory, since start (tests, logs)
        nbytes = sum(t.numel() * t.element_size() for kv in self.host for t in kv)
        logger.info("CPU KV tier: %d blocks, %.2f GiB of %shost memory", num_slots, nbytes / 2 ** 30,
                    "pinned " if pin else "")

    def apply(self, xfer: KVTransfers, kv_caches: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Queue the step's copies: stores in chunks, each chunk of loads after the stores it must follow."""
        if self.store_stream is not None:
            launched = torch.cuda.current_stream(self.store_stream.device).record_event()   # earlier steps' writes
            for stream in (self.store_stream, self.load_stream):
                for event in (launched, *self._copied):
                    stream.wait_event(event)
        stores = _chunks(xfer.store_blocks, xfer.store_slots)
        loads = _chunks(xfer.load_blocks, xfer.load_slots)
        waits = _load_waits(stores, loads)
        stored = []   # an event after each chunk of stores
        for k in range(-1, len(stores)):   # (k = -1: the loads that follow no store)
            if k >= 0:
                with self._on(self.store_stream):
                    self._move(stores[k], kv_caches, store=True)
                    stored.append(self._record(self.store_stream))
            for chunk in (c for c, w in zip(loads, waits) if w == k):
                with self._on(self.load_stream):
                    if k >= 0 and self.load_stream is not None:
                        self.load_stream.wait_event(stored[k])
                    self._move(chunk, kv_caches, store=False)
        if self.store_stream is not None:
            self._copied = [self._record(self.store_stream), self._record(self.load_stream)]

    def wait_forward(self) -> None:
        """Before the step's forward, which reads the loaded blocks and may write over the stored
        ones: the current (compute) stream waits on the copies, on the device, never the host."""
        if self._copied:
            current = torch.cuda.current_stream(self.store_stream.device)
            for event in self._copied:
                current.wait_event(event)
            self._copied = []

    @staticmethod
    def _on(stream: torch.cuda.Stream | None):
        return contextlib.nullcontext() if stream is None else torch.cuda.stream(stream)

    @staticmethod
    def _record(stream: torch.cuda.Stream) -> torch.cuda.Event | None:
        return None if stream is None else stream.record_event()

    def _move(self, chunk: Chunk, kv_caches: list[tuple[torch.Tensor, torch.Tensor]], store: bool) -> None:
        """One chunk, on the current stream. A few runs of consecutive blocks and slots: copied straight
        between the cache and the tier. Blocks scattered over the GPU cache (the free list hands out
        blocks in eviction order: a 32k prompt's 2,048 blocks came in ~2,000 runs, 3.6 s on the H200
        when each was a copy) go through a staging tensor: one gather or scatter of the blocks on the
        device, and one copy per run of consecutive host slots (the chunks are in slot order)."""
        blocks, slots = chunk
        num_tensors = sum(len(kv) for kv in kv_caches)
        direct = _runs(blocks, slots)
        if len(direct) <= _DIRECT_RUNS:
            self.num_host_copies += len(direct) * num_tensors
            for dev_kv, host_kv in zip(kv_caches, self.host):
                for dev, host in zip(dev_kv, host_kv):
                    for block, slot, n in direct:
                        if store:
                            host[slot:slot + n].copy_(dev[block:block + n], non_blocking=True)
                        else:
                            dev[block:block + n].copy_(host[slot:slot + n], non_blocking=True)
            return
        device = kv_caches[0][0].device
        rows = torch.tensor(blocks, dtype=torch.int64, pin_memory=device.type == "cuda").to(device, non_blocking=True)
        runs = _runs(slots, range(len(blocks)))   # (slot, row in the chunk, length)
        self.num_host_copies += len(runs) * num_tensors
        for dev_kv, host_kv in zip(kv_caches, self.host):
            for dev, host in zip(dev_kv, host_kv):
                staging = self._staging(dev, store)[:len(blocks)]
                if store:
                    torch.index_select(dev, 0, rows, out=staging)
                    for slot, row, n in runs:
                        host[slot:slot + n].copy_(staging[row:row + n], non_blocking=True)
                else:
                    for slot, row, n in runs:
                        staging[row:row + n].copy_(host[slot:slot + n], non_blocking=True)
                    dev.index_copy_(0, rows, staging)

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


def _load_waits(stores: list[Chunk], loads: list[Chunk]) -> list[int]:
    """For each chunk of loads, the last chunk of stores it must follow (-1: none): one that reads a
    block the loads write (a block evicted to make room for them) or writes a slot they read (a
    block stored and re-hit in one step). (No store reads a block loaded in its step: a loaded
    hash is in the tier already, so its eviction stores nothing; and no store writes a slot being
    loaded: engine_core/kv_offload.py pins them.)"""
    last_block: dict[int, int] = {}
    last_slot: dict[int, int] = {}
    for k, (blocks, slots) in enumerate(stores):
        last_block.update(dict.fromkeys(blocks, k))
        last_slot.update(dict.fromkeys(slots, k))
    return [max(max((last_block.get(b, -1) for b in blocks), default=-1),
                max((last_slot.get(s, -1) for s in slots), default=-1)) for blocks, slots in loads]


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
