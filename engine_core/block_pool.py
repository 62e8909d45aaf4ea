"""BlockPool: the KV blocks, their reference counts, and the prefix cache.

Free blocks wait in an LRU queue (oldest freed first). A free block keeps its
hash, so a later request with the same prefix can revive it until the block is
handed out again.
"""
from __future__ import annotations

from collections import OrderedDict

from engine_core.kv_events import MEDIUM_GPU, AllBlocksCleared, BlockRemoved, BlockStored, KVCacheEvent
from engine_core.kv_offload import CPUTier


class KVBlock:
    __slots__ = ("block_id", "ref_cnt", "block_hash", "stored")

    def __init__(self, block_id: int):
        self.block_id = block_id
        self.ref_cnt = 0
        self.block_hash: bytes | None = None
        self.stored: BlockStored | None = None   # its BlockStored, with events and a CPU tier: the tier's own


class BlockPool:
    def __init__(self, num_blocks: int, enable_caching: bool):
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.blocks = [KVBlock(i) for i in range(num_blocks)]
        self.free_queue: OrderedDict[int, KVBlock] = OrderedDict((b.block_id, b) for b in self.blocks)
        self.cached: dict[bytes, KVBlock] = {}
        # --kv-events-config: the events since the engine last took them (None: not recorded)
        self.kv_events: list[KVCacheEvent] | None = None
        self.cpu_tier: CPUTier | None = None   # --kv-offloading-size: where evicted cached blocks go

    def take_events(self) -> list[KVCacheEvent]:
        if not self.kv_events:
            return []
        events = list(self.kv_events)
        self.kv_events.clear()   # (in place: the CPU tier appends to this list too)
        return events

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_queue)

    def usage(self) -> float:
        return 1.0 - len(self.free_queue) / self.num_blocks

    def lookup(self, block_hash: bytes) -> KVBlock | None:
        return self.cached.get(block_hash)

    def take_new(self, n: int) -> list[KVBlock]:
        """Hand out n blocks from the front of the LRU queue, evicting their hashes."""
        assert n <= len(self.free_queue)
        out = []
        for _ in range(n):
            _, block = self.free_queue.popitem(last=False)
            if block.block_hash is not None:
                del self.cached[block.block_hash]
                if self.kv_events is not None:
                    self.kv_events.append(BlockRemoved([block.block_hash], MEDIUM_GPU))
                if self.cpu_tier is not None:
                    self.cpu_tier.store(block.block_hash, block.block_id, block.stored)
                block.stored = None
                block.block_hash = None
            block.ref_cnt = 1
            out.append(block)
        return out

    def touch(self, blocks: list[KVBlock]) -> None:
        """Take a reference on cache hits; a free block leaves the free queue."""
        for block in blocks:
            if block.ref_cnt == 0:
                del self.free_queue[block.block_id]
            block.ref_cnt += 1

    def free(self, blocks: list[KVBlock]) -> None:
        """Callers pass blocks tail first, so a request's last blocks are evicted first."""
        for block in blocks:
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                self.free_queue[block.block_id] = block

    def cache(self, block: KVBlock, block_hash: bytes) -> bool:
        """Commit a full block's hash; True if it became a new cache entry (a BlockStored)."""
        if not self.enable_caching or block.block_hash is not None:
            return False
        if block_hash in self.cached:
            return False  # an identical block is cached already; this one stays private
        block.block_hash = block_hash
        self.cached[block_hash] = block
        return True

    def reset_prefix_cache(self, keep_cpu_tier: bool = False) -> bool:
        """Forget every hash. Only possible when no block is in use. keep_cpu_tier: the CPU tier's
        blocks stay (sleep level 1: the same weights come back)."""
        if len(self.free_queue) != self.num_blocks:
            return False
        if self.kv_events is not None:   # the tier's blocks stay: only the GPU's go
            self.kv_events.append(BlockRemoved(list(self.cached), MEDIUM_GPU) if keep_cpu_tier and self.cpu_tier
                                  else AllBlocksCleared())
        for block in self.blocks:
            block.block_hash = None
            block.stored = None
        self.cached.clear()
        if self.cpu_tier is not None and not keep_cpu_tier:
            self.cpu_tier.clear()
        return True
