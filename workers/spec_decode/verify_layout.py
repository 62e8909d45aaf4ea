"""SpecLayout: where a verify step's drafts sit among its logits rows (host arrays)."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass
class SpecLayout:
    """A step with drafts: sampled request j (the step's request sample_rows[j]) with k_j drafts
    has k_j + 1 logits rows, its last k_j + 1 tokens' hidden states."""
    token_rows: np.ndarray    # int64 [R]: the step's token row of each logits row
    draft: np.ndarray         # int64 [R]: the draft each row checks (-1: the bonus row)
    rows: np.ndarray          # int64 [B, K + 1]: each sampled request's logits rows (-1 past its last)
    landing: np.ndarray       # int64 [R]: the position of the token each row draws
    request: np.ndarray       # int64 [R]: the sampled request (j) of each row
    drafts: list[list[int]]   # per sampled request


def spec_layout(req_ids: list[str], sample_rows: np.ndarray, end: np.ndarray, query_start_loc: np.ndarray,
                spec: dict[str, list[int]]) -> SpecLayout:
    drafts = [spec.get(req_ids[i], []) for i in sample_rows.tolist()]
    k = np.fromiter(map(len, drafts), dtype=np.int64, count=len(drafts))
    n_rows = k + 1
    first = np.zeros(len(k), dtype=np.int64)
    np.cumsum(n_rows[:-1], out=first[1:])
    request = np.repeat(np.arange(len(k)), n_rows)
    offset = np.arange(int(n_rows.sum())) - first[request]          # 0 .. k_j within a request
    last_token = query_start_loc[1:][sample_rows].astype(np.int64) - 1
    token_rows = last_token[request] - k[request] + offset
    landing = end[sample_rows][request] - k[request] + offset
    draft = np.full(len(token_rows), -1, dtype=np.int64)
    is_draft = offset < k[request]
    if is_draft.any():
        draft[is_draft] = np.concatenate([np.asarray(d, dtype=np.int64) for d in drafts if d])
    width = int(k.max()) + 1 if len(k) else 1
    rows = np.full((len(k), width), -1, dtype=np.int64)
    rows[request, offset] = np.arange(len(token_rows))
    return SpecLayout(token_rows, draft, rows, landing, request, drafts)
