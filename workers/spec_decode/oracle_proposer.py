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
from dataclasses import dataclass

import numpy as np

from ipc import envs


def load_recording(path: str) -> dict[tuple[int, ...], tuple[list[int] | None, float | None]]:
    """prompt -> (recorded output or None: record it on the first run, its own miss rate or None)."""
    with open(path) as f:
        items = json.load(f)
    return {tuple(it["prompt_token_ids"]): (it.get("output_token_ids"), it.get("miss_rate")) for it in items}


@dataclass
class _Replay:
    """A request replaying a recording: its outputs so far matched the recording's first `matched`
    (-1: they left it; no drafts any more). Each step checks only its new outputs."""
    state: object                # the request's CachedRequestState (a resumed request's is new)
    recorded: np.ndarray         # int64: the recorded output
    miss_rate: float
    matched: int = 0


class OracleProposer:
    def __init__(self, spec, vocab_size: int, seed: int):
        self.k, self.miss, self.vocab = spec.num_speculative_tokens, spec.oracle_miss_rate, vocab_size
        self.recorded = load_recording(spec.oracle_path)
        self.recording: dict[str, tuple[int, ...]] = {}   # req id -> its prompt, while its first run records
        self.replays: dict[str, _Replay] = {}   # req id -> where its replay stands (LOOM_SPEC_FAST_HOST)
        self.rng = np.random.default_rng(seed)   # every rank draws the same misses

    def propose(self, runner, states) -> dict[str, list[int]]:
        out = {}
        live = runner.batch.requests
        self.recording = {r: p for r, p in self.recording.items() if r in live}
        self.replays = {r: p for r, p in self.replays.items() if r in live}
        fast = envs.LOOM_SPEC_FAST_HOST
        for st in states:
            replay = self.replays.get(st.req_id) if fast else None
            if replay is not None and replay.state is st:
                drafts = self._replay(runner, st, replay)
            else:
                drafts = self._match(runner, st, fast)
            if drafts:
                out[st.req_id] = drafts
        return out

    def _replay(self, runner, st, replay: _Replay) -> list[int]:
        """The next k recorded tokens, if the request's new outputs follow the recording."""
        if replay.matched < 0:
            return []
        n_out, npt = st.num_tokens - st.num_prompt_tokens, st.num_prompt_tokens
        rec = replay.recorded
        new = runner.batch.token_ids[st.slot, npt + replay.matched:npt + n_out]
        if n_out > len(rec) or not np.array_equal(new, rec[replay.matched:n_out]):
            replay.matched = -1
            return []
        replay.matched = n_out
        return self._missed(rec[n_out:n_out + self.k].tolist(), replay.miss_rate)

    def _match(self, runner, st, fast: bool) -> list[int]:
        """A request's drafts from its prompt's entry: recording it on its first run, else
        replaying it (and, fast, remembering where the replay stands)."""
        tokens = runner.batch.token_ids[st.slot, :st.num_tokens]
        prompt = tuple(tokens[:st.num_prompt_tokens].tolist())
        if prompt not in self.recorded:
            return []
        rec, miss_rate = self.recorded[prompt]
        outputs = tokens[st.num_prompt_tokens:].tolist()
        if rec is None or st.req_id in self.recording:
            # the first run records: junk drafts (nearly all rejected) make every step a verify
            # step, so the recording has the verify steps' numerics, which the replays then meet
            self.recording[st.req_id] = prompt
            self.recorded[prompt] = (outputs, miss_rate)
            return [(outputs[-1] + 1 + i) % self.vocab for i in range(self.k)]
        miss_rate = self.miss if miss_rate is None else miss_rate
        if fast:
            self.replays[st.req_id] = replay = _Replay(st, np.asarray(rec, dtype=np.int64), miss_rate)
            return self._replay(runner, st, replay)
        n_out = len(outputs)
        if rec[:n_out] != outputs:
            return []
        return self._missed(rec[n_out:n_out + self.k], miss_rate)

    def _missed(self, drafts: list[int], miss_rate: float) -> list[int]:
        """Each draft replaced by a wrong one with probability miss_rate."""
        if drafts and miss_rate > 0:
            miss = self.rng.random(len(drafts)) < miss_rate
            drafts = [(t + 1) % self.vocab if m else t for t, m in zip(drafts, miss.tolist())]
        return drafts
