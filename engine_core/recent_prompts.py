"""RecentPrompts: the last few requests by their prompt's first block, so that a new request
whose prompt begins as one of theirs reuses what was done for the blocks both hold the same
tokens in, instead of redoing it per token or block:

- its block hashes (KVCacheManager.update_block_hashes): equal tokens under the same first block
  (whose hash covers the adapter) chain to equal hashes, so they are the ones hashing gives. The
  shared-prefix workload (512 x (2,048 shared + 64 own) tokens, blocks of 16) hashed 132 blocks
  per new request in schedule(): 28-37 ms of a 128-request step on the CPU box, 7-9 ms after.
- its prompt on the way to the workers (Scheduler._admit): while the earlier request runs, the
  step's message names it and carries only the rest of the prompt (NewRequestData.shared_from);
  the worker copies the shared tokens from that request's row. 270,000 prompt ints a step were
  encoded, decoded into Python ints and converted into the worker's numpy rows: ~12 ms of the
  worker's host time per prefill step, and the message (0.9-1.2 MB) overflowed the ring's 1 MiB
  chunks onto its ZMQ socket (now 60-100 kB).

Requests are held weakly: a request that is gone is no one's source. Prompts with images take no
part (their blocks hash the images too, and the workers read their prompts whole)."""
from __future__ import annotations

import weakref
from collections import OrderedDict
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from engine_core.request import Request


def common_blocks(a: list[int], b: list[int], limit: int, block_size: int) -> int:
    """How many leading blocks (at most limit) a and b hold the same tokens in: list slices
    compared in C, the whole span first (requests that share a prefix agree on all of it),
    else a bisection over spans that each compare once."""
    limit = min(limit, len(a) // block_size, len(b) // block_size)
    end = limit * block_size
    if a[:end] == b[:end]:
        return limit
    lo, hi = 0, limit   # blocks [0, lo) agree; [0, hi) do not
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if a[lo * block_size:mid * block_size] == b[lo * block_size:mid * block_size]:
            lo = mid
        else:
            hi = mid
    return lo


class RecentPrompts:
    def __init__(self, capacity: int = 8):
        self.capacity = capacity
        self._by_first: OrderedDict[bytes, weakref.ref] = OrderedDict()   # first block's hash -> request

    def take(self, req: Request, first: bytes, block_size: int) -> None:
        """req's leading block hashes (req has none yet; first: its first block's): those of the
        newest kept request with the same first block over the blocks their prompts share (that
        request becomes req.prompt_source), else first alone. req is kept in its place."""
        ref = self._by_first.get(first)
        other = ref() if ref is not None else None
        if other is None:
            req.block_hashes.append(first)
        else:
            n = max(common_blocks(req.prompt_token_ids, other.prompt_token_ids, len(other.block_hashes),
                                  block_size), 1)
            req.block_hashes += other.block_hashes[:n]
            req.prompt_source = (ref, n * block_size)
        self._by_first[first] = weakref.ref(req)
        self._by_first.move_to_end(first)
        if len(self._by_first) > self.capacity:
            self._by_first.popitem(last=False)
