"""Pooler (--runner pooling): a step's hidden states -> one vector per prompt that finished
its prefill in the step (vLLM's pooler, model_executor/layers/pooler.py).

LAST takes the last prompt token's final hidden state (Qwen3-Embedding, the classifiers of
decoder models); MEAN averages every prompt token's; CLS takes the first one's. A prompt may
be prefilled in several chunks: MEAN keeps a running float32 sum per batch slot, added to by
each chunk, and CLS keeps its first token's state from the first chunk (both need every
token computed, so their runner has prefix caching off: ipc/pooling.py). The model's pooling
head (a classifier's `score`) runs on the pooled states; normalisation and activations are
per request and belong to the API servers (frontend/pooling.py). Nothing here waits for the
device: the vectors are copied back with the step's other outputs."""
from __future__ import annotations

import numpy as np
import torch

from ipc.pooling import PoolerConfig


class Pooler:
    def __init__(self, config: PoolerConfig, max_num_seqs: int, hidden_size: int, device: torch.device,
                 h2d):
        self.pooling_type = config.pooling_type
        self.h2d = h2d   # HostToDevice: the step's index arrays in one copy
        # per batch slot: MEAN's running sum, CLS's first hidden state (LAST needs none)
        self.acc = (torch.zeros(max_num_seqs, hidden_size, dtype=torch.float32, device=device)
                    if self.pooling_type != "LAST" else None)

    def __call__(self, model, hidden: torch.Tensor, query_start_loc: np.ndarray, start: np.ndarray,
                 end: np.ndarray, slots: np.ndarray, finished_rows: np.ndarray) -> torch.Tensor | None:
        """hidden [T, H] of the step's tokens, row i's at query_start_loc[i]:[i + 1]; its prompt
        tokens start..end - 1. -> [len(finished_rows), D] float32: the pooled (and head-applied)
        vector of each row whose prompt is complete; None when none is. Called for every step."""
        qsl = np.asarray(query_start_loc, dtype=np.int64)
        if self.pooling_type == "LAST":
            if not len(finished_rows):
                return None
            index, = self.h2d([qsl[1:][finished_rows] - 1])
            pooled = hidden.index_select(0, index)
        else:
            pooled = self._accumulate(hidden, qsl, start, end, slots, finished_rows)
            if not len(finished_rows):
                return None
        return model.pool_head(pooled).float()

    def _accumulate(self, hidden: torch.Tensor, qsl: np.ndarray, start: np.ndarray, end: np.ndarray,
                    slots: np.ndarray, finished_rows: np.ndarray) -> torch.Tensor:
        counts = np.diff(qsl)
        first_chunk = np.nonzero(start == 0)[0]   # rows whose prompt begins in this step
        if self.pooling_type == "MEAN":
            token_slots = np.repeat(slots, counts)
            fresh, token_slots, out_slots, lengths = self.h2d([
                slots[first_chunk], token_slots, slots[finished_rows],
                end[finished_rows].astype(np.float32).reshape(-1, 1)])
            self.acc.index_fill_(0, fresh, 0.0)
            self.acc.index_add_(0, token_slots, hidden[:qsl[-1]].float())
            return self.acc.index_select(0, out_slots) / lengths
        fresh, first_tokens, out_slots = self.h2d([slots[first_chunk], qsl[:-1][first_chunk], slots[finished_rows]])
        self.acc.index_copy_(0, fresh, hidden.index_select(0, first_tokens).float())
        return self.acc.index_select(0, out_slots)
