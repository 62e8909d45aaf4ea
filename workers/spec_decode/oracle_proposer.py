"""OracleProposer (measurement only): replays the target's own recorded greedy output, so that a
benchmark separates the engine's cost of speculation from a draft's quality.

oracle_path holds a JSON list of {"prompt_token_ids": [...], "output_token_ids": [...]} (a run
without speculation records it, as bench/spec_decode.py does). A request whose prompt is
recorded gets the next k recorded tokens as drafts while its outputs follow the recording; each
draft token is replaced by a wrong one with probability oracle_miss_rate, or the entry's own
"miss_rate" (a fixed acceptance rate: acceptance length 1 + sum_{i<=k} (1 - miss)^i for greedy
requests)."""
from __future__ import annotations

import json

import numpy as np


def load_recording(path: str) -> dict[tuple[int, ...], tuple[list[int], float | None]]:
    """prompt -> (recorded output, its own miss rate or None: the config's)."""
    with open(path) as f:
        items = json.load(f)
    return {tuple(it["prompt_token_ids"]): (list(it["output_token_ids"]), it.get("miss_rate")) for it in items}


class OracleProposer:
    def __init__(self, spec, vocab_size: int, seed: int):
        self.k, self.miss, self.vocab = spec.num_speculative_tokens, spec.oracle_miss_rate, vocab_size
        self.recorded = load_recording(spec.oracle_path)
        self.rng = np.random.default_rng(seed)   # every rank draws the same misses

    def propose(self, runner, states) -> dict[str, list[int]]:
        out = {}
        for st in states:
            tokens = runner.batch.token_ids[st.slot, :st.num_tokens]
            rec, miss_rate = self.recorded.get(tuple(tokens[:st.num_prompt_tokens].tolist()), (None, None))
            n_out = st.num_tokens - st.num_prompt_tokens
            if rec is None or rec[:n_out] != tokens[st.num_prompt_tokens:].tolist():
                continue
            drafts = rec[n_out:n_out + self.k]
            miss_rate = self.miss if miss_rate is None else miss_rate
            if drafts and miss_rate > 0:
                miss = self.rng.random(len(drafts)) < miss_rate
                drafts = [(t + 1) % self.vocab if m else t for t, m in zip(drafts, miss.tolist())]
            if drafts:
                out[st.req_id] = drafts
        return out
