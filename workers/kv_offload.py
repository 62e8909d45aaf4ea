"""HostKVTier: the worker's side of the CPU tier of the KV cache (engine_core/kv_offload.py owns
which hash sits in which slot): one host tensor per layer for keys and one for values, pinned on
CUDA, each slot one block of this rank's heads, and the copies of a step's KVTransfers.

The copies are queued on the device's current stream before the step's forward, stores first
(they read blocks every earlier step has written, before this step writes over them), then loads
(written before the forward reads them). Into and out of pinned memory they are asynchronous:
the host never waits for them."""
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
        nbytes = sum(t.numel() * t.element_size() for kv in self.host for t in kv)
        logger.info("CPU KV tier: %d blocks, %.2f GiB of %shost memory", num_slots, nbytes / 2 ** 30,
                    "pinned " if pin else "")

    def apply(self, xfer: KVTransfers, kv_caches: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        """One copy per run of consecutive blocks and slots, per layer's keys and values (a long
        prompt's blocks are mostly consecutive on both sides: a few large copies, not one per block)."""
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
