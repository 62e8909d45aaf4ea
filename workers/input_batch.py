"""The persistent batch: per-request state kept in numpy arrays, one row per slot.

Each step arrives as a diff (new requests, new blocks, finished ids); the
step's inputs are then built with vectorised numpy ops, never per token.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from ipc.sampling_params import SamplingParams


@dataclass
class CachedRequestState:
    req_id: str
    slot: int
    num_prompt_tokens: int
    num_tokens: int                 # prompt + outputs known to this worker
    num_computed_tokens: int
    num_blocks: int
    params: SamplingParams
    seed: int
    eos_token_ids: list[int]
    mm_items: list = field(default_factory=list)   # ipc.messages.MultiModalItem, by offset
    mrope_positions: np.ndarray | None = None      # [3, prompt] (M-RoPE models with images)
    mrope_delta: int = 0                           # added to the index of every later token


class InputBatch:
    def __init__(self, max_num_reqs: int, max_model_len: int, max_blocks_per_req: int):
        self.token_ids = np.zeros((max_num_reqs, max_model_len), dtype=np.int64)
        self.block_table = np.zeros((max_num_reqs, max_blocks_per_req), dtype=np.int32)
        self.free_slots = list(range(max_num_reqs - 1, -1, -1))
        self.requests: dict[str, CachedRequestState] = {}

    def add(self, req_id: str, prompt: list[int], outputs: list[int], block_ids: list[int],
            num_computed: int, params: SamplingParams, seed: int, eos: list[int]) -> None:
        slot = self.free_slots.pop()
        n_prompt, n = len(prompt), len(prompt) + len(outputs)
        self.token_ids[slot, :n_prompt] = prompt
        self.token_ids[slot, n_prompt:n] = outputs
        self.block_table[slot, :len(block_ids)] = block_ids
        self.requests[req_id] = CachedRequestState(req_id, slot, n_prompt, n, num_computed,
                                                   len(block_ids), params, seed, eos)

    def append_blocks(self, req_id: str, block_ids: list[int]) -> None:
        st = self.requests[req_id]
        self.block_table[st.slot, st.num_blocks:st.num_blocks + len(block_ids)] = block_ids
        st.num_blocks += len(block_ids)

    def append_token(self, st: CachedRequestState, token: int) -> None:
        self.token_ids[st.slot, st.num_tokens] = token
        st.num_tokens += 1

    def remove(self, req_id: str) -> None:
        st = self.requests.pop(req_id, None)
        if st is not None:
            self.free_slots.append(st.slot)

    def mrope_positions(self, states: list[CachedRequestState], positions: np.ndarray,
                        qsl: np.ndarray) -> np.ndarray:
        """[3, T] M-RoPE positions of a step's flat tokens (index positions, qsl per request):
        text-only requests repeat their index in all three rows; requests with images take
        their prompt's precomputed rows, and index + delta after the prompt."""
        out = np.broadcast_to(positions, (3, len(positions))).copy()
        for i, st in enumerate(states):
            if st.mrope_positions is None:
                continue
            a, b = int(qsl[i]), int(qsl[i + 1])
            p = positions[a:b]
            n = st.num_prompt_tokens
            out[:, a:b] = np.where(p < n, st.mrope_positions[:, np.minimum(p, n - 1)], p + st.mrope_delta)
        return out

    def output_token_ids(self, st: CachedRequestState) -> np.ndarray:
        return self.token_ids[st.slot, st.num_prompt_tokens:st.num_tokens]

    def prompt_token_ids(self, st: CachedRequestState) -> np.ndarray:
        return self.token_ids[st.slot, :st.num_prompt_tokens]
