"""CPUTier: the engine's side of the CPU tier of the KV cache (--kv-offloading-size GB,
--kv-offloading-backend native): which block hash sits in which host slot, LRU, and the copies
the workers are to make before the next step's forward.

- A cached GPU block that is evicted (handed out again by the block pool) is stored: its hash
  gets a host slot (the least recently used one when the tier is full: the budget is a fixed
  number of slots, never exceeded) and a copy GPU block -> slot is queued.
- A prefix lookup that runs past the GPU cache continues here: each further hash found in the
  tier is loaded into a fresh GPU block (slot -> block), which joins the GPU prefix cache, so the
  request takes it as an ordinary hit and its prefill starts after it.
- The queued copies go with the step's SchedulerOutput (KVTransfers); a worker makes its stores,
  then its loads, before that step's forward, in its stream's order: a store reads a block after
  every earlier step wrote it and before this step overwrites it, a load writes before it is read.
  A slot loaded in a step is not reassigned in that step (its store would run first).
"""
from __future__ import annotations

from collections import OrderedDict

from engine_core.kv_events import MEDIUM_CPU, BlockRemoved, BlockStored, KVCacheEvent
from ipc.messages import KVTransfers


class CPUTier:
    def __init__(self, num_slots: int):
        self.num_slots = num_slots
        self.slots: OrderedDict[bytes, int] = OrderedDict()   # hash -> host slot, least recently used first
        self.free_slots = list(range(num_slots - 1, -1, -1))
        self._stores: list[tuple[int, int]] = []   # (GPU block, slot) this step
        self._loads: list[tuple[int, int]] = []    # (slot, GPU block) this step
        self._loading: set[int] = set()
        self.num_stored = self.num_loaded = 0   # blocks, since start (tests, logs)
        self.kv_events: list[KVCacheEvent] | None = None   # the block pool's list, with --kv-events-config

    def __len__(self) -> int:
        return len(self.slots)

    def lookup(self, block_hash: bytes) -> int | None:
        return self.slots.get(block_hash)

    def store(self, block_hash: bytes, gpu_block: int, gpu_event: BlockStored | None = None) -> None:
        """An evicted GPU block's contents to the tier (already there: only its recency).
        gpu_event: the block's BlockStored, re-sent for the CPU medium."""
        if block_hash in self.slots:
            self.slots.move_to_end(block_hash)
            return
        slot = self._take_slot()
        if slot is None:
            return
        self.slots[block_hash] = slot
        self._stores.append((gpu_block, slot))
        self.num_stored += 1
        if self.kv_events is not None and gpu_event is not None:
            self.kv_events.append(BlockStored(
                [block_hash], gpu_event.parent_block_hash, gpu_event.token_ids, gpu_event.block_size,
                gpu_event.lora_id, MEDIUM_CPU, gpu_event.lora_name, gpu_event.extra_keys))

    def _take_slot(self) -> int | None:
        if self.free_slots:
            return self.free_slots.pop()
        for old, slot in self.slots.items():   # least recently used first
            if slot not in self._loading:
                del self.slots[old]
                if self.kv_events is not None:
                    self.kv_events.append(BlockRemoved([old], MEDIUM_CPU))
                return slot
        return None   # every slot is being loaded in this step

    def pin(self, hashes: list[bytes]) -> None:
        """Keep these entries' slots (about to be loaded) out of this step's stores."""
        self._loading.update(self.slots[h] for h in hashes)

    def load(self, block_hash: bytes, gpu_block: int) -> None:
        slot = self.slots[block_hash]
        self.slots.move_to_end(block_hash)
        self._loads.append((slot, gpu_block))
        self._loading.add(slot)
        self.num_loaded += 1

    def take_transfers(self) -> KVTransfers | None:
        if not self._stores and not self._loads:
            return None
        out = KVTransfers([g for g, _ in self._stores], [s for _, s in self._stores],
                          [s for s, _ in self._loads], [g for _, g in self._loads])
        self._stores, self._loads, self._loading = [], [], set()
        return out

    def clear(self) -> None:
        """reset_prefix_cache and sleep level 2: the tier's contents go too (queued copies are moot)."""
        self.slots.clear()
        self.free_slots = list(range(self.num_slots - 1, -1, -1))
        self._stores, self._loads, self._loading = [], [], set()
