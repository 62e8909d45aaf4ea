"""A verify step as a decode batch: one row per token, so that it runs in the decode CUDA graphs.

A verify step schedules each request's last known token and its k drafts (k + 1 tokens, all of
which are logits rows). Attention of a query token depends only on its position and the keys
before it, and the step writes every token's K/V before any layer's attention reads them: so
token j of a request is exactly a one-token decode of context start + j + 1 over the request's
block table. Laid out that way, a verify step of B requests x (k + 1) tokens is a decode batch of
B * (k + 1) rows, which the decode graphs replay whole (attention, lm_head and the plain sampler
in the graph: bench/RESULTS.md, session 30, measured verify steps in the piecewise graphs, with
attention eager, at 1.07x for acceptance length 2.87).

The token-indexed inputs (input ids, positions, cache slots, LoRA indices) are those of the
step as scheduled; only the per-sequence metadata (query_start_loc, seq_lens, block table, the
decodes' launch order) is per row. Each row's numerics are then those of a decode row in the
same graph size, whatever its offset among its request's drafts: a recorded greedy run (the
oracle drafter's) replays token for token."""
from __future__ import annotations

import numpy as np

from workers.step_inputs import HostInputs, decode_order


# Each row reads its request's whole context (k + 1 reads of the same KV, where the prompt kernel
# reads it once per query tile; concurrent, they mostly hit L2). Past this context the extra reads
# outweigh the host time the graph saves (an 8B model at 32k tokens: ~4 GB more per step), and the
# step runs in the piecewise graphs.
MAX_VERIFY_GRAPH_CONTEXT = 8192


def is_pure_verify(num_scheduled: np.ndarray, logits_rows: int, sample_rows: np.ndarray) -> bool:
    """Whether every scheduled token is a logits row (each request: its last token and its drafts,
    or a plain decode): no prompt chunk rides in the step."""
    return len(sample_rows) == len(num_scheduled) and int(num_scheduled.sum()) == logits_rows


def rows_as_decodes(host: HostInputs, num_scheduled: np.ndarray, start: np.ndarray) -> HostInputs:
    """The step's host inputs with every token a sequence of its own (query length 1): its
    context ends at its own position, its block table is its request's."""
    token_request = np.repeat(np.arange(len(num_scheduled)), num_scheduled)
    offset = np.arange(len(token_request)) - host.query_start_loc[:-1][token_request]
    seq_lens = (start[token_request] + offset + 1).astype(np.int32)
    ones = np.ones(len(token_request), dtype=np.int64)
    host.query_start_loc = np.arange(len(token_request) + 1, dtype=np.int32)
    host.seq_lens = seq_lens
    host.block_table = host.block_table[token_request]
    host.decode_order = decode_order(ones, seq_lens)
    return host
