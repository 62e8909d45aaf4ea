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
    # (one pass over the requests' few rows in Python, then a handful of numpy ops: a verify step
    # pays this on its critical path, and ~20 small numpy calls cost more than the loop)
    drafts, request, offset, back, draft = [], [], [], [], []
    for j, i in enumerate(sample_rows.tolist()):
        d = spec.get(req_ids[i], [])
        drafts.append(d)
        n = len(d) + 1
        request += [j] * n
        offset += range(n)
        back += range(n - 1, -1, -1)   # rows after this one within the request: k_j - offset
        draft += d
        draft.append(-1)
    request_a = np.array(request, dtype=np.int64)
    offset_a = np.array(offset, dtype=np.int64)
    back_a = np.array(back, dtype=np.int64)
    last_token = query_start_loc[1:][sample_rows].astype(np.int64) - 1
    token_rows = last_token[request_a] - back_a
    landing = end[sample_rows].astype(np.int64)[request_a] - back_a
    width = (int(offset_a.max()) + 1) if len(offset_a) else 1
    rows = np.full((len(drafts), width), -1, dtype=np.int64)
    rows[request_a, offset_a] = np.arange(len(request_a))
    return SpecLayout(token_rows, np.array(draft, dtype=np.int64), rows, landing, request_a, drafts)
