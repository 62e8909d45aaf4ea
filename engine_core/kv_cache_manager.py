"""KVCacheManager: which blocks each request holds, prefix-cache lookups, and
the block arithmetic (a request of n tokens needs ceil(n / block_size) blocks).

Sliding-window trimming (vLLM's SlidingWindowManager, for a model whose every
attention layer is local with one window W): a query at position p sees keys
p - W < k <= p, so once a request's next query is at position c, a block whose
every slot lies before c - W + 1 is never read again. It is freed (and stays
in the prefix cache as evictable, as a finished request's blocks do) and its
place in the request's list holds None; the workers keep the freed id in their
block tables, where the windowed attention kernels never read it. A request
then holds about (W + chunk) / block_size blocks, not its whole context. A
model with global layers keeps every block (they read them): window None
(vLLM's hybrid allocator, a block pool per group of layers, would trim its
local layers' blocks too; not built here)."""
from __future__ import annotations

import hashlib

import msgspec

from engine_core.block_pool import BlockPool, KVBlock
from engine_core.kv_events import MEDIUM_GPU, BlockStored
from engine_core.recent_prompts import RecentPrompts
from engine_core.request import Request
from ipc.lora import block_hash_root


def hash_block(parent: bytes | None, token_ids: list[int], extra_keys: tuple = ()) -> bytes:
    """A full block's hash chains its parent's, so equal hashes mean equal prefixes. extra_keys:
    the content hashes of the images whose placeholders the block holds (the placeholder token
    ids are the same for every image). A block without any hashes as it always did."""
    payload = (parent or b"", token_ids, list(extra_keys)) if extra_keys else (parent or b"", token_ids)
    return hashlib.sha256(msgspec.msgpack.encode(payload)).digest()


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool, sliding_window: int | None = None):
        """sliding_window: the window of every attention layer, to trim blocks to (None: keep all)."""
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.sliding_window = sliding_window
        self.pool = BlockPool(num_blocks, enable_caching)
        self.req_blocks: dict[str, list[KVBlock | None]] = {}   # None: a block trimmed behind the window
        self.num_cached_blocks: dict[str, int] = {}   # leading blocks of a request already published
        self.recent = RecentPrompts()   # the last requests' hashes, by their first block

    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    def usage(self) -> float:
        return self.pool.usage()

    def update_block_hashes(self, req: Request) -> None:
        """Extend req.block_hashes over every full block of its known tokens."""
        bs = self.block_size
        hashes = req.block_hashes
        if not hashes and not req.mm_items and req.num_prompt_tokens >= 2 * bs:   # (else nothing to share)
            self.recent.take(req, hash_block(block_hash_root(req.lora_request), req.prompt_token_ids[:bs]), bs)
        while (len(hashes) + 1) * bs <= req.num_tokens:
            i = len(hashes)
            hashes.append(hash_block(hashes[-1] if hashes else block_hash_root(req.lora_request),
                                     req.token_ids(i * bs, (i + 1) * bs),
                                     self._extra_keys(req, i) if req.mm_items else ()))

    def _extra_keys(self, req: Request, i: int) -> tuple:
        """Block i's extra keys: images in the block (same text, different image, different KV).
        (The first block's parent is the request's adapter: no adapter's KV is another's.)"""
        bs = self.block_size
        return tuple(it.hash for it in req.mm_items if it.offset < (i + 1) * bs and it.offset + it.length > i * bs)

    def get_computed_blocks(self, req: Request) -> list[KVBlock]:
        """The longest cached prefix, leaving at least the last token to compute. None for a request
        that wants prompt logprobs: those are computed only for the prompt tokens it runs."""
        if not self.enable_caching or req.sampling_params.prompt_logprobs is not None:
            return []
        self.update_block_hashes(req)
        max_blocks = (req.num_tokens - 1) // self.block_size
        if self.sliding_window is not None:
            return self._window_hits(req.block_hashes[:max_blocks])
        hits = list(map(self.pool.cached.get, req.block_hashes[:max_blocks]))   # (a loop in C)
        if None in hits:   # the hit is the run before the first miss
            del hits[hits.index(None):]
        if self.pool.cpu_tier is not None and len(hits) < max_blocks:
            hits += self._load_from_cpu(req, hits, max_blocks)
        return hits

    def _load_from_cpu(self, req: Request, gpu_hits: list[KVBlock], max_blocks: int) -> list[KVBlock]:
        """The run of the prefix after gpu_hits that the CPU tier holds, loaded into fresh GPU blocks
        that join the prefix cache (free, cached: the request takes them as hits, or a later one
        does). As many as the free blocks allow beside the request's GPU hits, which are held
        meanwhile so that taking blocks cannot evict them."""
        tier = self.pool.cpu_tier
        run = []
        for h in req.block_hashes[len(gpu_hits):max_blocks]:
            if tier.lookup(h) is None or self.pool.lookup(h) is not None:
                break
            run.append(h)
        if not run:
            return []
        tier.pin(run)   # the stores of the blocks taken below must not reuse these slots
        self.pool.touch(gpu_hits)
        blocks = self.pool.take_new(min(len(run), self.pool.num_free_blocks))
        first = len(gpu_hits)
        for i, (block, h) in enumerate(zip(blocks, run)):
            tier.load(h, block.block_id)
            self.pool.cache(block, h)
        if blocks and self.pool.kv_events is not None:
            self._record_stored(req, list(range(first, first + len(blocks))))
        self.pool.free(list(reversed(blocks)) + list(reversed(gpu_hits)))
        return blocks

    def _window_hits(self, hashes: list[bytes]) -> list[KVBlock | None]:
        """The longest cached prefix when blocks are trimmed to the window (vLLM's sliding-window
        hit): only the blocks that the next query's window covers must be cached, those before
        them may have been evicted (None). Searched from the end for that many cached in a row,
        or a cached run from the start."""
        need = max(cdiv(self.sliding_window - 1, self.block_size), 1)
        found = [self.pool.lookup(h) for h in hashes]
        run = 0
        for i in range(len(found) - 1, -1, -1):
            run = run + 1 if found[i] is not None else 0
            if run == need:
                return found[:i + need]
        return found[:run]   # fewer than `need` blocks in all: those from the start, if cached

    def allocate_slots(self, req: Request, num_new_tokens: int,
                       computed_blocks: list[KVBlock] | None = None) -> list[KVBlock] | None:
        """Make room for num_new_tokens more tokens; None if the pool is short.

        computed_blocks are prefix-cache hits for a request not yet running. Blocks behind the
        window of the first new token are freed first (hits there are not taken at all), so
        that the room asked for is the trimmed count."""
        if not computed_blocks and self.sliding_window is None and req.request_id in self.req_blocks:
            return self._extend(self.req_blocks[req.request_id], req.num_computed_tokens + num_new_tokens)
        computed_blocks = computed_blocks or []
        held = self.req_blocks.get(req.request_id, [])
        num_computed = req.num_computed_tokens + len(computed_blocks) * self.block_size
        first_needed = self._first_needed_block(num_computed)
        self._trim(held, first_needed)
        if self.sliding_window is None:   # nothing trimmed: every hit is a block
            hits = taken = computed_blocks
        else:
            hits = [b if len(held) + i >= first_needed else None for i, b in enumerate(computed_blocks)]
            taken = [b for b in hits if b is not None]
        need = cdiv(num_computed + num_new_tokens, self.block_size) - len(held) - len(hits)
        # Hits that sit in the free queue stop being free once touched.
        revived = sum(1 for b in taken if b.ref_cnt == 0)
        if need + revived > self.pool.num_free_blocks:
            return None
        self.pool.touch(taken)
        new_blocks = self.pool.take_new(max(need, 0))
        blocks = self.req_blocks.setdefault(req.request_id, held)
        if hits and not held:   # hits are published blocks (or trimmed ones): cache_blocks starts past them
            self.num_cached_blocks[req.request_id] = len(hits)
        blocks.extend(hits)
        blocks.extend(new_blocks)
        return new_blocks

    def _extend(self, held: list[KVBlock | None], num_tokens: int) -> list[KVBlock] | None:
        """allocate_slots for a request already holding `held`, with no hits and no window (a
        running request's next tokens, every step for every decode): the blocks num_tokens
        need past those held; None if the pool is short."""
        need = cdiv(num_tokens, self.block_size) - len(held)
        if need <= 0:
            return []
        if need > self.pool.num_free_blocks:
            return None
        new_blocks = self.pool.take_new(need)
        held.extend(new_blocks)
        return new_blocks

    def _first_needed_block(self, next_pos: int) -> int:
        """The first block a query at next_pos or later can see (0 without trimming): the first
        of a chunk's queries still sees the W - 1 keys before it."""
        if self.sliding_window is None:
            return 0
        return max(next_pos - self.sliding_window + 1, 0) // self.block_size

    def _trim(self, blocks: list[KVBlock | None], first_needed: int) -> None:
        """Free a running request's blocks before first_needed (oldest first: evicted first)."""
        gone = [b for b in blocks[:first_needed] if b is not None]
        if gone:
            self.pool.free(gone)
            blocks[:first_needed] = [None] * min(first_needed, len(blocks))

    def cache_blocks(self, req: Request, num_computed_tokens: int) -> None:
        """Publish the hashes of blocks that are full once num_computed_tokens are in the cache."""
        if not self.enable_caching:
            return
        done = self.num_cached_blocks.get(req.request_id, 0)
        if (done + 1) * self.block_size > num_computed_tokens:
            return  # no block became full
        self.update_block_hashes(req)
        blocks = self.req_blocks.get(req.request_id, [])
        num_full = min(num_computed_tokens // self.block_size, len(req.block_hashes), len(blocks))
        stored = []
        for i in range(done, num_full):
            # (a trimmed block was published before it was trimmed)
            if blocks[i] is not None and self.pool.cache(blocks[i], req.block_hashes[i]):
                stored.append(i)
        self.num_cached_blocks[req.request_id] = max(done, num_full)
        if stored and self.pool.kv_events is not None:
            self._record_stored(req, stored)

    def _record_stored(self, req: Request, indices: list[int]) -> None:
        """One BlockStored per run of consecutive newly cached blocks (a block already cached by
        another request breaks the run: the router has it)."""
        bs = self.block_size
        runs: list[list[int]] = []
        for i in indices:
            if runs and runs[-1][-1] == i - 1:
                runs[-1].append(i)
            else:
                runs.append([i])
        for run in runs:
            extra = [self._extra_keys(req, i) or None for i in run]
            self.pool.kv_events.append(BlockStored(
                [req.block_hashes[i] for i in run], req.block_hashes[run[0] - 1] if run[0] else None,
                req.token_ids(run[0] * bs, (run[-1] + 1) * bs), bs, None, MEDIUM_GPU, None,
                extra if any(extra) else None))
            if self.pool.cpu_tier is not None:   # each block's own, for the tier's BlockStored when it is evicted
                for i in run:
                    h = req.block_hashes[i]
                    self.pool.cached[h].stored = BlockStored(
                        [h], req.block_hashes[i - 1] if i else None, req.token_ids(i * bs, (i + 1) * bs),
                        bs, None, MEDIUM_GPU, None, [extra[i - run[0]]] if extra[i - run[0]] else None)

    def block_ids(self, req_id: str) -> list[int]:
        """For the workers' block table; a trimmed block's place gets block 0, never read."""
        return [0 if b is None else b.block_id for b in self.req_blocks.get(req_id, [])]

    def free(self, req: Request) -> None:
        self.num_cached_blocks.pop(req.request_id, None)
        blocks = self.req_blocks.pop(req.request_id, None)
        if blocks:
            self.pool.free([b for b in reversed(blocks) if b is not None])

    def reset_prefix_cache(self, keep_cpu_tier: bool = False) -> bool:
        return self.pool.reset_prefix_cache(keep_cpu_tier)
