"""OracleProposer (measurement only): replays the target's own recorded greedy output, so that a
benchmark separates the engine's cost of speculation from a draft's quality.

oracle_path holds a JSON list of {"prompt_token_ids": [...], "output_token_ids": [...]} (a run
without speculation records it, as bench/spec_decode.py does). A request whose prompt is
recorded gets the next k recorded tokens as drafts while its outputs follow the recording (an
entry without "output_token_ids" is recorded by the prompt's first run in this engine, with the
verify steps' numerics: bf16 decode and verify steps can differ in a near tie); each
draft token is replaced by a wrong one with probability oracle_miss_rate, or the entry's own
"miss_rate" (a fixed acceptance rate: acceptance length 1 + sum_{i<=k} (1 - miss)^i for greedy
requests)."""
from __future__ import annotations

import json

import numpy as np


def load_recording(path: str) -> dict[tuple[int, ...], tuple[list[int] | None, float | None]]:
    """prompt -> (recorded output or None: record it on the first run, its own miss rate or None)."""
    with open(path) as f:
        items = json.load(f)
    return {tuple(it["prompt_token_ids"]): (it.get("output_token_ids"), it.get("miss_rate")) for it in items}


class OracleProposer:
    def __init__(self, spec, vocab_size: int, seed: int):
        self.k, self.miss, self.vocab = spec.num_speculative_tokens, spec.oracle_miss_rate, vocab_size
        self.recorded = load_recording(spec.oracle_path)
        self.recording: dict[str, tuple[int, ...]] = {}   # req id -> its prompt, while its first run records
        self.rng = np.random.default_rng(seed)   # every rank draws the same misses

    def propose(self, runner, states) -> dict[str, list[int]]:
        out = {}
        live = runner.batch.requests
        self.recording = {r: p for r, p in self.recording.items() if r in live}
        for st in states:
            tokens = runner.batch.token_ids[st.slot, :st.num_tokens]
            prompt = tuple(tokens[:st.num_prompt_tokens].tolist())
            if prompt not in self.recorded:
                continue
            rec, miss_rate = self.recorded[prompt]
            outputs = tokens[st.num_prompt_tokens:].tolist()
            if rec is None or st.req_id in self.recording:
                # the first run records: junk drafts (nearly all rejected) make every step a verify
                # step, so the recording has the verify steps' numerics, which the replays then meet
                self.recording[st.req_id] = prompt
                self.recorded[prompt] = (outputs, miss_rate)
                out[st.req_id] = [(outputs[-1] + 1 + i) % self.vocab for i in range(self.k)]
                continue
            n_out = len(outputs)
            if rec[:n_out] != outputs:
                continue
            drafts = rec[n_out:n_out + self.k]
            miss_rate = self.miss if miss_rate is None else miss_rate
            if drafts and miss_rate > 0:
                miss = self.rng.random(len(drafts)) < miss_rate
                drafts = [(t + 1) % self.vocab if m else t for t, m in zip(drafts, miss.tolist())]
            if drafts:
                out[st.req_id] = drafts
        return out
