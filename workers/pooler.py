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
from workers.step_inputs import StepBatch


class Pooler:
    def __init__(self, config: PoolerConfig, max_num_seqs: int, hidden_size: int, device: torch.device):
        self.pooling_type = config.pooling_type
        self.device = device
        # per batch slot: MEAN's running sum, CLS's first hidden state (LAST needs none)
        self.acc = (torch.zeros(max_num_seqs, hidden_size, dtype=torch.float32, device=device)
                    if self.pooling_type != "LAST" else None)

    def __call__(self, model, hidden: torch.Tensor, batch: StepBatch) -> torch.Tensor | None:
        """hidden [T, H] of the step's tokens, row i's at query_start_loc[i]:[i + 1]. -> [len(sample_rows),
        D] float32: the pooled (and head-applied) vector of each row whose prompt is complete
        (batch.sample_rows); None when none is. Called for every step (MEAN sums every chunk)."""
        finished = batch.sample_rows
        if self.pooling_type == "LAST":
            if not len(finished):
                return None
            # the sampled rows' last-token index is on the device already (prepare's sample_index)
            pooled = hidden.index_select(0, batch.device.sample_index[:len(finished)])
        else:
            slots = np.fromiter((s.slot for s in batch.states), np.int64, len(batch.states))
            pooled = self._accumulate(hidden, np.asarray(batch.host.query_start_loc, np.int64),
                                      batch.computed_before, batch.computed_after, slots, finished)
            if not len(finished):
                return None
        return model.pool_head(pooled).float()

    def _upload(self, *arrays: np.ndarray) -> list[torch.Tensor]:
        """Small index arrays to the device without waiting: a pinned copy each (the caching host
        allocator keeps it until its copy is done); HostToDevice's alternating buffers would wait
        for the step before this one, whose copies are queued behind its forward."""
        tensors = [torch.from_numpy(np.ascontiguousarray(a)) for a in arrays]
        if self.device.type != "cuda":
            return tensors
        return [t.pin_memory().to(self.device, non_blocking=True) for t in tensors]

    def _accumulate(self, hidden: torch.Tensor, qsl: np.ndarray, start: np.ndarray, end: np.ndarray,
                    slots: np.ndarray, finished_rows: np.ndarray) -> torch.Tensor:
        counts = np.diff(qsl)
        first_chunk = np.nonzero(start == 0)[0]   # rows whose prompt begins in this step
        if self.pooling_type == "MEAN":
            fresh, token_slots, out_slots, lengths = self._upload(
                slots[first_chunk], np.repeat(slots, counts), slots[finished_rows],
                end[finished_rows].astype(np.float32).reshape(-1, 1))
            self.acc.index_fill_(0, fresh, 0.0)
            self.acc.index_add_(0, token_slots, hidden[:int(qsl[-1])].float())
            return self.acc.index_select(0, out_slots) / lengths
        fresh, first_tokens, out_slots = self._upload(slots[first_chunk], qsl[:-1][first_chunk],
                                                      slots[finished_rows])
        self.acc.index_copy_(0, fresh, hidden.index_select(0, first_tokens).float())
        return self.acc.index_select(0, out_slots)
