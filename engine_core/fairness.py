"""Fairness between HTTP requests under --scheduling-policy fcfs (the default).

One HTTP request can bring a thousand prompts (a completions `prompt` list, or `n`). First come,
first served would queue all of them ahead of the next user's single prompt and let them hold
every batch slot until the last one finishes: measured, another user's 8-token completion waited
58 s behind `["Beautiful is"] * 1024` with `max_tokens` 256. Two rules bound that, per group (the
engine requests of one HTTP request; EngineCoreRequest.group_id):

- **Fair queuing.** The waiting queue is ordered by a virtual time: a group's next request is
  keyed one past the later of its group's last key and the last key admitted. A newly arrived
  group's request therefore waits behind at most one request of each group already queued, and
  groups take turns, whatever their sizes.
- **A reserve.** One group holds at most `cap` running slots: all but max_num_seqs // 16 (at
  least one). The reserve lets another group join at the next step while a fan-out fills the
  batch; a fan-out alone runs at 15/16 of the batch. A request that is a group of its own (one
  prompt, n = 1: the offline benchmarks) never reaches the cap.

Groups are keyed by (client, group id), so API servers and attached clients never share one.
Under --scheduling-policy priority neither rule applies: priorities order everything."""
from __future__ import annotations

from collections import Counter

from engine_core.request import Request


class FairShare:
    def __init__(self, max_num_seqs: int):
        self.cap = max(1, max_num_seqs - max(1, max_num_seqs // 16))
        self._last: dict[tuple[int, str], float] = {}   # group -> the key of its latest queued request
        self._now = 0.0                                   # virtual time: the latest key admitted

    def key_arrival(self, req: Request) -> None:
        """A new request's place in the queue (req.fair_key)."""
        key = max(self._last.get(req.group, 0.0), self._now) + 1.0
        self._last[req.group] = req.fair_key = key

    def admitted(self, req: Request) -> None:
        self._now = max(self._now, req.fair_key)
        if self._last.get(req.group) == req.fair_key:   # its group has no request queued after it
            del self._last[req.group]

    def running_counts(self, running: list[Request]) -> Counter | None:
        """Running requests per group, once some group could be at its cap (None: none can)."""
        return Counter(r.group for r in running) if len(running) >= self.cap else None

    def at_cap(self, req: Request, counts: Counter | None) -> bool:
        return counts is not None and counts[req.group] >= self.cap
