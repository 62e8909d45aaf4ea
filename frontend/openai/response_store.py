"""The Responses API's store (`store: true`): responses by id, for GET /v1/responses/{id},
previous_response_id and cancel. In memory, bounded: the least recently used response goes when
the store is full (--responses-store-size is not a flag yet: RESPONSES_STORE_SIZE). Each API-server
process has its own store, as vLLM's: with --api-server-count > 1, a follow-up request must reach
the process that answered the first (one connection, or a single API server).

Each entry keeps the conversation that led to the response (its chat messages, without the
instructions, which OpenAI does not carry over) so that a request naming it as
previous_response_id continues it; and, while a background response runs, the task generating
it, which cancel ends."""
from __future__ import annotations

import asyncio
from collections import OrderedDict
from dataclasses import dataclass

RESPONSES_STORE_SIZE = 1024


@dataclass
class StoredResponse:
    response: dict               # the response object, as GET answers it
    conversation: list[dict]     # chat messages before its output (no instructions)
    task: asyncio.Task | None = None   # a background response's generation, while it runs


class ResponseStore:
    def __init__(self, size: int = RESPONSES_STORE_SIZE):
        self.size = size
        self._entries: OrderedDict[str, StoredResponse] = OrderedDict()

    def put(self, entry: StoredResponse) -> None:
        rid = entry.response["id"]
        self._entries[rid] = entry
        self._entries.move_to_end(rid)
        while len(self._entries) > self.size:
            _, old = self._entries.popitem(last=False)
            if old.task is not None and not old.task.done():   # evicted while it runs: nobody can read it
                old.task.cancel()

    def get(self, rid: str) -> StoredResponse | None:
        entry = self._entries.get(rid)
        if entry is not None:
            self._entries.move_to_end(rid)
        return entry

    def pop(self, rid: str) -> StoredResponse | None:
        return self._entries.pop(rid, None)

    def running(self) -> list[asyncio.Task]:
        """The tasks of the background responses still generating."""
        return [e.task for e in self._entries.values() if e.task is not None and not e.task.done()]

    def __len__(self) -> int:
        return len(self._entries)
