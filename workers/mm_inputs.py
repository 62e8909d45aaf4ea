"""A worker's multimodal inputs: items read from the shared-memory store, encoded by the vision
tower when the scheduler says, kept until it frees them, and scattered at the placeholder tokens.

An item that cannot be read or encoded (an attached client may send a well-formed handle that
names no entry) fails its own request, never the step: the request is reported in `refused`, and
its placeholder tokens keep their token embeddings until the scheduler drops it."""
from __future__ import annotations

import logging
import struct

import numpy as np
import torch

from ipc.messages import SchedulerOutput
from shm.object_store import ObjectStoreReader
from workers.host_to_device import to_device
from workers.input_batch import CachedRequestState

logger = logging.getLogger(__name__)


class MultimodalInputs:
    def __init__(self, model: torch.nn.Module, rank: int):
        self.model = model
        self.enabled = hasattr(model, "encode_images")
        self.uses_mrope = bool(getattr(model, "uses_mrope", False))
        self.encoder_cache: dict[str, torch.Tensor] = {}   # item hash -> embeddings [tokens, hidden]
        self.store = ObjectStoreReader(rank)
        self.refused: dict[str, str] = {}                  # req_id -> why (its own inputs), until the step takes them

    def add_request(self, st: CachedRequestState, r, prompt: np.ndarray) -> None:
        """A new request's items; M-RoPE models also compute its positions (from its whole prompt),
        once per request (again after a preemption: it comes back as new)."""
        st.mm_items = list(r.mm_items)
        if not self.uses_mrope:
            return
        try:
            items = [(it.offset, it.length, self.store.get(it.store_name, it.store_addr)) for it in st.mm_items]
            st.mrope_positions, st.mrope_delta = self.model.mrope_positions(prompt, items)
        except Exception as e:  # a bad handle or grid: text positions while the request is dropped
            self._fail(st.req_id, f"its multimodal items could not be read: {e}")

    def release(self, released: list[tuple[str, int]]) -> None:
        """Requests gone for good: their store entries may go."""
        for name, addr in released:
            try:
                self.store.release(name, addr)
            except (OSError, ValueError, struct.error) as e:   # bookkeeping: a bad handle must not fail the step
                logger.warning("multimodal store release of (%s, %d) skipped: %s", name, addr, e)

    def run_encoders(self, requests: dict[str, CachedRequestState], so: SchedulerOutput) -> None:
        """Encode the items the scheduler picked for this step (all in one pass of the tower),
        reading their tensors straight from the store. Items are shared by hash; an item whose
        handle does not read is taken from another request that holds the same hash."""
        users: dict[str, list[tuple[str, object]]] = {}    # hash -> (req_id, item)
        for rid, idx in so.scheduled_encoder_inputs.items():
            for i in idx:
                it = requests[rid].mm_items[i]
                users.setdefault(it.hash, []).append((rid, it))
        if not users:
            return
        if getattr(self.model, "visual", None) is None and not hasattr(self.model, "vision_tower") \
                and getattr(self.model, "audio_tower", None) is None:
            raise RuntimeError("this model was loaded without its encoder (--language-model-only)")
        todo = [read for u in users.values() if (read := self._read_one(u)) is not None]
        for (it, _), emb in zip(todo, self._encode(todo)):
            why = None
            if emb is None:
                why = "the vision tower failed on it (the worker's log has why)"
            elif emb.shape[0] != it.length:
                why = f"{emb.shape[0]} embeddings for {it.length} placeholders"
            if why is None:
                self.encoder_cache[it.hash] = emb
            else:
                for rid, _ in users[it.hash]:
                    self._fail(rid, f"image {it.hash[:12]}: {why}")

    def _read_one(self, users: list[tuple[str, object]]) -> tuple[object, dict] | None:
        """(item, its arrays) from the first user whose handle reads; each that does not fails."""
        for rid, it in users:
            try:
                return it, self.store.get(it.store_name, it.store_addr)
            except Exception as e:
                self._fail(rid, f"image {it.hash[:12]}: not readable from the store: {e}")
        return None

    def _encode(self, todo: list[tuple[object, dict]]) -> list[torch.Tensor | None]:
        """The tower's outputs, in one pass; if that pass fails, one item at a time, so that a
        malformed item fails alone (None)."""
        if not todo:
            return []
        try:
            return self.model.encode_images([arrays for _, arrays in todo])
        except Exception:
            if len(todo) == 1:
                logger.exception("image %s could not be encoded", todo[0][0].hash[:12])
                return [None]
            return [out for one in todo for out in self._encode([one])]

    def _fail(self, req_id: str, why: str) -> None:
        if req_id not in self.refused:
            logger.warning("request %s fails: %s", req_id, why)
            self.refused[req_id] = why

    def take_refused(self) -> dict[str, str] | None:
        refused, self.refused = self.refused, {}
        return refused or None

    def spans(self, states, start: np.ndarray, n: np.ndarray, qsl: np.ndarray) -> list[tuple[np.ndarray, tuple]]:
        """(rows of the step's tokens, (item hash, first, last embedding)) of every placeholder
        range the step computes (chunked prefill may split one over steps). A range whose item
        has no encoder output (it failed, maybe in another request of the same hash) fails its
        request: the tokens would otherwise be computed without the image."""
        spans = []
        for i, st in enumerate(states):
            lo_step, hi_step = int(start[i]), int(start[i] + n[i])
            for it in st.mm_items:
                lo, hi = max(lo_step, it.offset), min(hi_step, it.offset + it.length)
                if lo >= hi:
                    continue
                if it.hash in self.encoder_cache:
                    spans.append((np.arange(lo, hi) - lo_step + int(qsl[i]), (it.hash, lo - it.offset, hi - it.offset)))
                else:
                    self._fail(st.req_id, f"image {it.hash[:12]} has no encoder output")
        return spans

    def embeddings(self, spans, input_ids: torch.Tensor) -> torch.Tensor:
        """The step's input embeddings with encoder outputs scattered at the placeholder tokens."""
        embeds = self.model.embed_input_ids(input_ids)
        # (from pinned memory: a pageable copy would wait here for the step's encoder to finish)
        index = to_device(torch.from_numpy(np.concatenate([dst for dst, _ in spans])), embeds.device)
        src = torch.cat([self.encoder_cache[h][a:b] for _, (h, a, b) in spans])
        return embeds.index_copy(0, index, src.to(embeds.dtype))

    def free(self, hashes: list[str]) -> None:
        """Encoder outputs the scheduler no longer needs (after this step's use)."""
        for h in hashes:
            self.encoder_cache.pop(h, None)
