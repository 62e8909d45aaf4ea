"""The persistent batch: per-request state kept in numpy arrays, one row per slot.

Each step arrives as a diff (new requests, new blocks, finished ids); the
step's inputs are then built with vectorised numpy ops, never per token.

The penalty state is on the device, one row per slot: how often the request
generated each token (int32 [slots, vocab]) and which tokens its prompt holds
(uint8 [slots, vocab]). Each step's sampled tokens are added to the counts on
the device (record_sampled), so the counts already include a token whose value
the host has not seen yet: penalised steps overlap like any other. The tensors
are made when the first request with penalties arrives (vocab 152k x 256 slots:
155 MB + 39 MB), and a slot's rows are set only for requests that read them.
The same holds for the last outputs of each slot (int64 [slots, 31]), which the
bad words' prefixes are matched against, on the device, for the same reason.
A new request's device rows are written when its step is staged (write_rows).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from functools import partial

import numpy as np
import torch

from ipc.sampling_params import SamplingParams
from ipc.validation import MAX_BAD_WORD_TOKENS
from workers.sampler import BadWords


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
    bad_words: BadWords | None = None


class InputBatch:
    def __init__(self, max_num_reqs: int, max_model_len: int, max_blocks_per_req: int,
                 vocab_size: int = 0, device: torch.device | str = "cpu"):
        self.token_ids = np.zeros((max_num_reqs, max_model_len), dtype=np.int64)
        self.block_table = np.zeros((max_num_reqs, max_blocks_per_req), dtype=np.int32)
        self.free_slots = list(range(max_num_reqs - 1, -1, -1))
        self.requests: dict[str, CachedRequestState] = {}
        self.max_num_reqs, self.vocab_size, self.device = max_num_reqs, vocab_size, torch.device(device)
        self.output_counts: torch.Tensor | None = None
        self.prompt_mask: torch.Tensor | None = None
        self.recent_outputs: torch.Tensor | None = None
        self._row_writes: list[partial] = []   # device rows of added slots, until write_rows()

    def add(self, req_id: str, prompt: list[int], outputs: list[int], block_ids: list[int],
            num_computed: int, params: SamplingParams, seed: int, eos: list[int],
            shared_from: str = "", shared_len: int = 0) -> None:
        """A new request. shared_from: a request held here whose prompt's first shared_len tokens
        begin this one's (prompt: the rest; NewRequestData.shared_from), copied row to row."""
        slot = self.free_slots.pop()
        n_prompt = shared_len + len(prompt)
        n = n_prompt + len(outputs)
        if shared_len:
            self.token_ids[slot, :shared_len] = self.token_ids[self.requests[shared_from].slot, :shared_len]
            self.token_ids[slot, shared_len:n_prompt] = prompt
            prompt = self.token_ids[slot, :n_prompt].copy()   # (whole, for the penalty rows)
        else:
            self.token_ids[slot, :n_prompt] = prompt
        self.token_ids[slot, n_prompt:n] = outputs
        self.block_table[slot, :len(block_ids)] = block_ids
        self.requests[req_id] = CachedRequestState(req_id, slot, n_prompt, n, num_computed,
                                                   len(block_ids), params, seed, eos)
        if params.needs_penalties:
            if self.output_counts is None:
                shape = (self.max_num_reqs, self.vocab_size)
                self.output_counts = torch.zeros(shape, dtype=torch.int32, device=self.device)
                self.prompt_mask = torch.zeros(shape, dtype=torch.uint8, device=self.device)
            self._row_writes.append(partial(self._set_penalty_rows, slot, prompt, outputs))
        if params.bad_words_token_ids:
            self.requests[req_id].bad_words = BadWords.of(params.bad_words_token_ids)
            if self.recent_outputs is None:
                self.recent_outputs = torch.full((self.max_num_reqs, MAX_BAD_WORD_TOKENS - 1), -1,
                                                 dtype=torch.int64, device=self.device)
            self._row_writes.append(partial(self._set_recent_outputs, slot, outputs))

    def write_rows(self) -> None:
        """The device rows of the slots added since the last call: queued until the step whose
        diff added them is staged. A step launched before may still have to sample (it waits for
        its grammar bitmask while this step's host inputs are built: workers/step_pipeline.py),
        and it records its tokens into its rows' slots, one of which may be a finished request's
        slot taken here: the new request's rows are set after that."""
        for write in self._row_writes:
            write()
        self._row_writes.clear()

    def _set_penalty_rows(self, slot: int, prompt: list[int] | np.ndarray, outputs: list[int]) -> None:
        def ids(xs: list[int] | np.ndarray) -> torch.Tensor:
            a = np.asarray(xs, dtype=np.int64)
            return torch.from_numpy(a[(a >= 0) & (a < self.vocab_size)]).to(self.device)
        self.prompt_mask[slot].zero_()
        self.prompt_mask[slot].index_fill_(0, ids(prompt), 1)
        self.output_counts[slot].zero_()
        out = ids(outputs)  # a resumed request's earlier outputs
        self.output_counts[slot].index_add_(0, out, torch.ones_like(out, dtype=torch.int32))

    def _set_recent_outputs(self, slot: int, outputs: list[int]) -> None:
        """A slot's last outputs as the bad words see them: a resumed request's own, -1 before."""
        row = np.full(MAX_BAD_WORD_TOKENS - 1, -1, dtype=np.int64)
        tail = outputs[-len(row):]
        row[len(row) - len(tail):] = tail
        self.recent_outputs[slot] = torch.from_numpy(row).to(self.device)

    def penalty_state(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        return None if self.output_counts is None else (self.output_counts, self.prompt_mask)

    def record_sampled(self, slots: torch.Tensor, tokens: torch.Tensor) -> None:
        """Add a step's sampled tokens (device [B]) to their slots' counts and last outputs, on the device."""
        if self.output_counts is not None:
            self.output_counts.index_put_((slots, tokens), torch.ones_like(tokens, dtype=torch.int32),
                                          accumulate=True)
        if self.recent_outputs is not None:
            recent = self.recent_outputs
            recent[slots] = torch.cat((recent[slots, 1:], tokens.view(-1, 1)), dim=1)

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

    def prompt(self, st: CachedRequestState) -> np.ndarray:
        """st's prompt, as its row holds it."""
        return self.token_ids[st.slot, :st.num_prompt_tokens]

    def mrope_positions(self, states: list[CachedRequestState], positions: np.ndarray,
                        query_start_loc: np.ndarray) -> np.ndarray:
        """[3, T] M-RoPE positions of a step's flat tokens (index positions, query_start_loc per request):
        text-only requests repeat their index in all three rows; requests with images take
        their prompt's precomputed rows, and index + delta after the prompt."""
        out = np.broadcast_to(positions, (3, len(positions))).copy()
        for i, st in enumerate(states):
            if st.mrope_positions is None:
                continue
            a, b = int(query_start_loc[i]), int(query_start_loc[i + 1])
            p = positions[a:b]
            n = st.num_prompt_tokens
            out[:, a:b] = np.where(p < n, st.mrope_positions[:, np.minimum(p, n - 1)], p + st.mrope_delta)
        return out
