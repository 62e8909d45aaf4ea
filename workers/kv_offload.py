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


class HostKVTier:
    def __init__(self, num_slots: int, kv_caches: list[tuple[torch.Tensor, torch.Tensor]]):
        pin = kv_caches[0][0].is_cuda
        self.num_slots = num_slots
        self.host = [tuple(torch.empty((num_slots, *t.shape[1:]), dtype=t.dtype, pin_memory=pin) for t in kv)
                     for kv in kv_caches]
        self.stream = torch.cuda.Stream(kv_caches[0][0].device) if pin else None   # the copies' own stream
        self._copied = None   # the event of the last queued copies, for wait_forward
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
        store = _runs(xfer.store_blocks, xfer.store_slots)
        load = _runs(xfer.load_slots, xfer.load_blocks)
        for dev_kv, host_kv in zip(kv_caches, self.host):
            for dev, host in zip(dev_kv, host_kv):
                for block, slot, n in store:
                    host[slot:slot + n].copy_(dev[block:block + n], non_blocking=True)
        for dev_kv, host_kv in zip(kv_caches, self.host):
            for dev, host in zip(dev_kv, host_kv):
                for slot, block, n in load:
                    dev[block:block + n].copy_(host[slot:slot + n], non_blocking=True)

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for kv in self.host for t in kv)


def _runs(src: list[int], dst: list[int]) -> list[tuple[int, int, int]]:
    """(src start, dst start, length) of the runs where both sides go up by one."""
    runs: list[tuple[int, int, int]] = []
    for a, b in zip(src, dst):
        if runs and runs[-1][0] + runs[-1][2] == a and runs[-1][1] + runs[-1][2] == b:
            runs[-1] = (runs[-1][0], runs[-1][1], runs[-1][2] + 1)
        else:
            runs.append((a, b, 1))
    return runs
