"""NgramProposer: prompt lookup (vLLM's NgramProposer), on the CPU with numpy.

The request's last n tokens (n from prompt_lookup_max down to prompt_lookup_min) are looked
for earlier in its prompt and outputs; at the most recent earlier match, the k tokens that
followed it are the drafts. Code editing and retrieval answers repeat their context, and
there the drafts are mostly right."""
from __future__ import annotations

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view


def ngram_drafts(tokens: np.ndarray, lo: int, hi: int, k: int) -> list[int]:
    """The drafts for one request's tokens (int64 [N]): after the latest earlier occurrence of
    its longest suffix of lo..hi tokens that recurs; [] when none does."""
    n_tok = len(tokens)
    for n in range(min(hi, n_tok - 1), lo - 1, -1):
        suffix = tokens[n_tok - n:]
        windows = sliding_window_view(tokens[:n_tok - 1], n)   # starts 0 .. N - 1 - n: each has a next token
        hits = np.flatnonzero((windows == suffix).all(axis=1))
        if len(hits):
            start = int(hits[-1]) + n
            return tokens[start:start + k].tolist()
    return []


class NgramProposer:
    def __init__(self, spec):
        self.k, self.lo, self.hi = spec.num_speculative_tokens, spec.prompt_lookup_min, spec.prompt_lookup_max

    def propose(self, runner, states) -> dict[str, list[int]]:
        out = {}
        for st in states:
            drafts = ngram_drafts(runner.batch.token_ids[st.slot, :st.num_tokens], self.lo, self.hi, self.k)
            if drafts:
                out[st.req_id] = drafts
        return out
