"""HostKVTier: the worker's side of the CPU tier of the KV cache (engine_core/kv_offload.py owns
which hash sits in which slot): one host tensor per layer for keys and one for values, pinned on
CUDA, each slot one block of this rank's heads, and the copies of a step's KVTransfers.

On CUDA the copies run on a side stream of their own, stores first (they read blocks every
earlier step has written, before this step writes over them: the side stream waits on an event
recorded on the compute stream when the step is launched), then loads; the compute stream waits
on the copies' event only right before the step's forward (wait_forward), so the step's input
preparation (its own host-to-device copies) is not queued behind them, and the copies of the two
directions (D2H, H2D) do not block the stream the model runs on. The host tensors and the KV
cache live as long as the worker, so no tensor crosses streams that the allocator could reuse
early; one side stream keeps every copy in the engine's order (a slot stored, then loaded, then
stored again; a block stored, then loaded over). Into and out of pinned memory the copies are
asynchronous: the host never waits for them. On CPU they are plain copies, in order."""
from __future__ import annotations

import logging

import torch

from ipc.messages import KVTransfers

logger = logging.getLogger(__name__)
_DIRECT_RUNS = 8        # at most this many runs of consecutive blocks and slots: copied directly
_STAGING_BLOCKS = 256   # blocks per staged chunk (Llama-3.1-8B: 8 MiB per layer's keys or values)


class HostKVTier:
    def __init__(self, num_slots: int, kv_caches: list[tuple[torch.Tensor, torch.Tensor]]):
        pin = kv_caches[0][0].is_cuda
        self.num_slots = num_slots
        self.host = [tuple(torch.empty((num_slots, *t.shape[1:]), dtype=t.dtype, pin_memory=pin) for t in kv)
                     for kv in kv_caches]
        self.stream = torch.cuda.Stream(kv_caches[0][0].device) if pin else None   # the copies' own stream
        self._copied = None   # the event of the last queued copies, for wait_forward
        self._stagings: dict[tuple, torch.Tensor] = {}   # (dtype, block shape) -> a chunk of blocks on the device
        self.num_host_copies = 0   # copies into or out of host memory, since start (tests, logs)
        nbytes = sum(t.numel() * t.element_size() for kv in self.host for t in kv)
        logger.info("CPU KV tier: %d blocks, %.2f GiB of %shost memory", num_slots, nbytes / 2 ** 30,
                    "pinned " if pin else "")

    def apply(self, xfer: KVTransfers, kv_caches: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        """One copy per run of consecutive blocks and slots, per layer's keys and values (a long
        prompt's blocks are mostly consecutive on both sides: a few large copies, not one per block)."""
        if self.stream is None:
            self._copy(xfer, kv_caches)
            return
        launched = torch.cuda.current_stream(self.stream.device).record_event()   # earlier steps' writes
        self.stream.wait_event(launched)
        with torch.cuda.stream(self.stream):
            self._copy(xfer, kv_caches)
        self._copied = self.stream.record_event()

    def wait_forward(self) -> None:
        """Before the step's forward, which reads the loaded blocks and may write over the stored
        ones: the current (compute) stream waits on the copies, on the device, never the host."""
        if self._copied is not None:
            torch.cuda.current_stream(self.stream.device).wait_event(self._copied)
            self._copied = None

    def _copy(self, xfer: KVTransfers, kv_caches: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Stores, then loads. Where the GPU's blocks are scattered (the free list after evictions
        hands out blocks in eviction order: a 32k prompt's 2,048 blocks came in ~2,000 runs, so
        its re-hit from the tier took 2,000 copies per layer's keys and values, 3.6 s on the H200),
        the copies go through a staging tensor in chunks: one gather or scatter of the blocks on
        the device, and one copy per run of consecutive host slots, the pairs taken in slot order
        (_by_slot)."""
        if xfer.store_blocks:
            self._transfer(xfer.store_blocks, xfer.store_slots, kv_caches, store=True)
        if xfer.load_slots:
            self._transfer(xfer.load_blocks, xfer.load_slots, kv_caches, store=False)

    def _transfer(self, blocks: list[int], slots: list[int], kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
                  store: bool) -> None:
        blocks, slots = _by_slot(blocks, slots)
        direct = _runs(blocks, slots)
        num_tensors = sum(len(kv) for kv in kv_caches)
        if len(direct) <= _DIRECT_RUNS:   # a few large copies: straight between the cache and the tier
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
        index = torch.tensor(blocks, dtype=torch.int64, pin_memory=device.type == "cuda").to(device, non_blocking=True)
        for c in range(0, len(blocks), _STAGING_BLOCKS):
            rows = index[c:c + _STAGING_BLOCKS]
            runs = _runs(slots[c:c + _STAGING_BLOCKS], range(len(rows)))   # (slot, row in the chunk, length)
            self.num_host_copies += len(runs) * num_tensors
            for dev_kv, host_kv in zip(kv_caches, self.host):
                for dev, host in zip(dev_kv, host_kv):
                    staging = self._staging(dev)[:len(rows)]
                    if store:
                        torch.index_select(dev, 0, rows, out=staging)
                        for slot, row, n in runs:
                            host[slot:slot + n].copy_(staging[row:row + n], non_blocking=True)
                    else:
                        for slot, row, n in runs:
                            staging[row:row + n].copy_(host[slot:slot + n], non_blocking=True)
                        dev.index_copy_(0, rows, staging)

    def _staging(self, dev: torch.Tensor) -> torch.Tensor:
        """A chunk of blocks shaped as `dev`'s, reused by every copy (they are ordered on one stream).
        A D2H copy out of it is asynchronous: the next chunk's gather into it comes after on the
        same stream, so it never overwrites a block still being copied out."""
        key = (dev.dtype, tuple(dev.shape[1:]))
        buf = self._stagings.get(key)
        if buf is None:
            buf = self._stagings[key] = torch.empty((_STAGING_BLOCKS, *dev.shape[1:]), dtype=dev.dtype,
                                                    device=dev.device)
        return buf

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for kv in self.host for t in kv)


def _by_slot(blocks: list[int], slots: list[int]) -> tuple[list[int], list[int]]:
    """The pairs in host slot order, so that the host side is copied in runs of consecutive slots
    (the device side gathers or scatters any order). A prompt's blocks are evicted tail first, so
    its slots go down along the prefix, and its re-hit loads them in prefix order: unsorted, a run
    per block, one copy per block per layer's keys or values (the bench's 32k re-hit: 127k copies,
    1.2 s of host time on the H200). Stable: a slot stored twice in one step keeps the later store."""
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
