"""The scheduler's view of the workers' encoder cache (multimodal).

An image's encoder runs in the step whose tokens first reach its placeholder range; its
output stays in the workers' cache (keyed by the item's content hash) until every request
that touched it has computed past the range, so chunked prefill may split a range over
steps. The scheduler decides, the workers follow: each step names the items to encode and
the hashes to drop, so both sides always agree on what is cached.
"""
from __future__ import annotations

from typing import NamedTuple

from engine_core.request import Request


class EncoderFit(NamedTuple):
    """One request's share of a step: n tokens from `start`, and the items to encode for them."""
    start: int
    n: int
    to_encode: list[int]    # indices into the request's mm_items
    cost: int               # their encoder output tokens


class EncoderCacheManager:
    def __init__(self, budget: int, capacity: int):
        self.budget = budget            # encoder output tokens per step (>= the largest item)
        self.capacity = capacity        # encoder output tokens cached at once (>= budget)
        self.users: dict[str, set[str]] = {}   # hash -> requests that still need it
        self.sizes: dict[str, int] = {}
        self.used = 0
        self.to_free: list[str] = []    # for the workers, with the next step

    def fit(self, req: Request, start: int, n: int, step_budget: int) -> EncoderFit:
        """Shrink a step of n tokens from `start` so that it reaches no placeholder range whose
        encoder output is neither cached nor encodable within step_budget encoder tokens."""
        to_encode, cost, seen = [], 0, set()
        for idx, it in enumerate(req.mm_items):
            lo, hi = it.offset, it.offset + it.length
            if lo >= start + n:
                break                   # sorted by offset: none further is reached
            if hi <= start or it.hash in self.users or it.hash in seen:
                continue
            if cost + it.length <= step_budget and self.used + cost + it.length <= self.capacity:
                to_encode.append(idx)
                seen.add(it.hash)
                cost += it.length
            else:
                return EncoderFit(start, max(lo - start, 0), to_encode, cost)   # stop before this image
        return EncoderFit(start, n, to_encode, cost)

    def commit(self, req: Request, fit: EncoderFit) -> None:
        """The step runs `fit`: its items are cached from now on, and req uses every range it reaches."""
        start, n = fit.start, fit.n
        for idx in fit.to_encode:
            it = req.mm_items[idx]
            if it.hash not in self.users:
                self.users[it.hash] = set()
                self.sizes[it.hash] = it.length
                self.used += it.length
        for it in req.mm_items:
            if it.offset < start + n and it.offset + it.length > start:
                self.users[it.hash].add(req.request_id)

    def advance(self, req: Request) -> None:
        """Drop req's interest in the ranges it has computed past."""
        for it in req.mm_items:
            if it.offset + it.length <= req.num_computed_tokens:
                self._drop(req.request_id, it.hash)

    def drop_request(self, req: Request) -> None:
        for it in req.mm_items:
            self._drop(req.request_id, it.hash)

    def _drop(self, req_id: str, h: str) -> None:
        users = self.users.get(h)
        if users is None or req_id not in users:
            return
        users.discard(req_id)
        if not users:
            del self.users[h]
            self.used -= self.sizes.pop(h)
            self.to_free.append(h)

    def take_free(self) -> list[str]:
        out, self.to_free = self.to_free, []
        return out
