"""Data-parallel routing: which engine core gets a request, and how control results of every
engine become one answer. Used by the API servers (AsyncLLM) and the offline LLM.

Load: every engine sends each of its clients its waiting and running counts once per step
(EngineLoad), with the number of this client's ADDs it had taken in by then; what this client
sent since is not in those counts yet. The score is vLLM's, 4 * waiting + running: a queued
request delays every later one, a running one only shares a step. A request sent since the last
report counts as running while the engine has a free slot for it (fewer than max_num_seqs
running or waiting), else as waiting: so a burst of new requests (a wave of requests finishing
at once) fills the engine with free slots first instead of queueing on both, which would leave
one engine short of a full batch until its own requests finish.

Prefix affinity: a prompt whose first KV block was last sent to engine E goes to E again while
E's score is close to the lowest (within AFFINITY_SLACK + an eighth), where its prefix is
likely cached; otherwise to the least loaded engine, ties rotating from this client's index so
that idle API servers do not all pick engine 0.

An engine that has stopped stepping (silent past its heartbeat: a hung GPU, SIGSTOP) keeps its
last reported load, which would go on drawing requests that it never serves: the caller names
such engines in `avoid`, and they get no new requests while another engine can take them.
"""
from __future__ import annotations

from collections import OrderedDict
from typing import Any

from ipc.messages import EngineLoad

AFFINITY_SLACK = 8            # score units (2 waiting requests)
AFFINITY_ENTRIES = 1 << 16    # prefixes remembered, least recently used first out


class DPRouter:
    def __init__(self, num_engines: int, block_size: int, client_index: int = 0, max_num_seqs: int | None = None):
        self.n = num_engines
        self.max_num_seqs = max_num_seqs     # requests an engine runs at once (None: count every unseen as waiting)
        self.block_size = block_size
        self.waiting = [0] * num_engines
        self.running = [0] * num_engines
        self.sent = [0] * num_engines        # ADDs this client sent to each engine
        self.acked = [0] * num_engines       # of which the engine had taken in at its last report
        self._rotation = client_index
        self._prefixes: OrderedDict[int, int] = OrderedDict()
        self.remote: frozenset[int] = frozenset()   # engines on other nodes: they cannot read this host's images

    def on_load(self, engine: int, load: EngineLoad) -> None:
        if 0 <= engine < self.n:
            self.waiting[engine], self.running[engine] = load.num_waiting, load.num_running
            self.acked[engine] = load.num_added

    def score(self, engine: int) -> int:
        unseen = max(self.sent[engine] - self.acked[engine], 0)
        waiting, running = self.waiting[engine], self.running[engine]
        starts = 0   # unseen requests that find a free slot
        if self.max_num_seqs is not None:
            starts = min(unseen, max(self.max_num_seqs - running - waiting, 0))
        return 4 * (waiting + unseen - starts) + running + starts

    def pick(self, prompt_token_ids: list[int], num_requests: int = 1, local_only: bool = False,
             avoid: frozenset[int] = frozenset()) -> int:
        """The engine for a request of num_requests engine requests (its choices), counted as sent.
        local_only: among the engines of this node (a request with images in this host's store).
        avoid: engines that stopped stepping; chosen only when every other is excluded too."""
        if self.n == 1:
            engine = 0
        else:
            engines = [e for e in range(self.n) if not (local_only and e in self.remote)]
            engines = [e for e in engines if e not in avoid] or engines
            scores = {e: self.score(e) for e in engines}
            self._rotation = (self._rotation + 1) % self.n
            engine = min(engines, key=lambda e: (scores[e], (e - self._rotation) % self.n))
            key = self._prefix_key(prompt_token_ids)
            if key is not None:
                previous = self._prefixes.get(key)
                best = scores[engine]
                if previous in scores and scores[previous] <= best + AFFINITY_SLACK + best // 8:
                    engine = previous
                self._prefixes[key] = engine
                self._prefixes.move_to_end(key)
                if len(self._prefixes) > AFFINITY_ENTRIES:
                    self._prefixes.popitem(last=False)
        self.sent[engine] += num_requests
        return engine

    def pinned(self, engine: int, num_requests: int = 1) -> int:
        """A request pinned to an engine (X-data-parallel-rank): counted, not chosen."""
        self.sent[engine] += num_requests
        return engine

    def _prefix_key(self, ids: list[int]) -> int | None:
        """The first full block, when the prompt has one (a cache hit needs a token after it)."""
        if len(ids) <= self.block_size:
            return None
        return hash(tuple(ids[:self.block_size]))


def check_rank(rank: Any, num_engines: int) -> int:
    """A data-parallel rank a request is pinned to; ValueError names the valid range."""
    try:
        value = int(rank)
    except (TypeError, ValueError):
        value = -1
    if str(rank).strip() != str(value) or not 0 <= value < num_engines:
        raise ValueError(f"data-parallel rank must be an integer in [0, {num_engines}), got {rank!r}")
    return value

