"""The Responses API's store (`store: true`): responses by id, for GET /v1/responses/{id},
previous_response_id and cancel. In memory, bounded (RESPONSES_STORE_SIZE responses and
RESPONSES_STORE_BYTES of their JSON): the least recently used go when the store is full. Each
API-server process has its own store, as vLLM's: with --api-server-count > 1, a follow-up request
must reach the process that answered the first (one connection, or a single API server).

Each entry keeps the conversation that led to the response (its chat messages, without the
instructions, which OpenAI does not carry over) so that a request naming it as
previous_response_id continues it; and, while a background response runs, the task generating
it, which cancel ends."""
from __future__ import annotations

import asyncio
from collections import OrderedDict
from dataclasses import dataclass

import msgspec

RESPONSES_STORE_SIZE = 1024               # responses
RESPONSES_STORE_BYTES = 256 * 1024 * 1024   # their JSON (conversations with images can be large)


@dataclass
class StoredResponse:
    response: dict               # the response object, as GET answers it
    conversation: list[dict]     # chat messages before its output (no instructions)
    task: asyncio.Task | None = None   # a background response's generation, while it runs
    nbytes: int = 0                    # its size in the store (JSON), set when stored


class ResponseStore:
    def __init__(self, size: int = RESPONSES_STORE_SIZE, max_bytes: int = RESPONSES_STORE_BYTES):
        self.size = size
        self.max_bytes = max_bytes
        self.nbytes = 0
        self._entries: OrderedDict[str, StoredResponse] = OrderedDict()

    def put(self, entry: StoredResponse) -> None:
        """Store (or replace) a response; the least recently used go while the store is over its
        count or its bytes (the newest stays, whatever its size)."""
        rid = entry.response["id"]
        self.pop(rid)
        entry.nbytes = len(msgspec.json.encode(entry.conversation)) + len(msgspec.json.encode(entry.response))
        self._entries[rid] = entry
        self.nbytes += entry.nbytes
        while len(self._entries) > 1 and (len(self._entries) > self.size or self.nbytes > self.max_bytes):
            _, old = self._entries.popitem(last=False)
            self.nbytes -= old.nbytes
            if old.task is not None and not old.task.done():   # evicted while it runs: nobody can read it
                old.task.cancel()

    def get(self, rid: str) -> StoredResponse | None:
        entry = self._entries.get(rid)
        if entry is not None:
            self._entries.move_to_end(rid)
        return entry

    def pop(self, rid: str) -> StoredResponse | None:
        entry = self._entries.pop(rid, None)
        if entry is not None:
            self.nbytes -= entry.nbytes
        return entry

    def running(self) -> list[asyncio.Task]:
        """The tasks of the background responses still generating."""
        return [e.task for e in self._entries.values() if e.task is not None and not e.task.done()]

    def __len__(self) -> int:
        return len(self._entries)
