"""OracleProposer (measurement only): replays the target's own recorded greedy output, so that a
benchmark separates the engine's cost of speculation from a draft's quality.

oracle_path holds a JSON list of {"prompt_token_ids": [...], "output_token_ids": [...]} (a run
without speculation records it, as bench/spec_decode.py does). A request whose prompt is
recorded gets the next k recorded tokens as drafts while its outputs follow the recording (an
entry without "output_token_ids" is recorded by the prompt's first run in this engine, with the
verify steps' numerics: bf16 decode and verify steps can differ in a near tie); each
draft token is replaced by a wrong one with probability oracle_miss_rate, or the entry's own
"miss_rate" (a fixed acceptance rate: acceptance length 1 + sum_{i<=k} (1 - miss)^i for greedy
requests).

An entry this engine recorded follows the engine: a greedy run that leaves it or outlives it
records on from there (its outputs so far become the recording). The recording run computes
each token in the first row of a verify step of junk drafts, a replay in any row of a step of
accepted ones, and a replay's prompt ends in its prefix-cache hit: in bf16 a near tie can come
out the other way, and a replay that only stopped drafting there would run plain steps to its
end, every later run alike (issue 47: 24 of 160 steps verified at batch 1). Each full run after
the recording settles it up to the next such tie (bench.spec_decode.SETTLE_RUNS)."""
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


# From this many requests the replays are checked at once (~55 us a step on a CPU core, against
# ~18 us per request one by one; bench: the oracle at batch 8 and 1)
BATCHED_FROM = 4


@dataclass
class _Replay:
    """A request replaying a recording (LOOM_SPEC_FAST_HOST): its recording sits in row `slot` of
    the proposer's table, and its outputs so far matched the recording's first `matched`."""
    state: object                # the request's CachedRequestState (a resumed request's is new)
    slot: int
    length: int                  # of the recording
    miss_rate: float
    follows: bool                # records on where it leaves or outlives the recording (_follows)
    matched: int = 0


class OracleProposer:
    def __init__(self, spec, vocab_size: int, seed: int):
        self.k, self.miss, self.vocab = spec.num_speculative_tokens, spec.oracle_miss_rate, vocab_size
        self.recorded = load_recording(spec.oracle_path)
        self.own = {p for p, (rec, _) in self.recorded.items() if rec is None}   # recorded by this engine
        self.recording: dict[str, tuple[int, ...]] = {}   # req id -> its prompt, while its run records
        self.replays: dict[str, _Replay] = {}   # req id -> where its replay stands (LOOM_SPEC_FAST_HOST)
        self.table = np.zeros((0, 0), dtype=np.int64)   # the replays' recordings, by persistent-batch slot
        self.rng = np.random.default_rng(seed)   # every rank draws the same misses

    def propose(self, runner, states) -> dict[str, list[int]]:
        out = {}
        live = runner.batch.requests
        self.recording = {r: p for r, p in self.recording.items() if r in live}
        if not envs.LOOM_SPEC_FAST_HOST or len(states) < BATCHED_FROM:
            for st in states:
                if (drafts := self._match(runner, st, False)):
                    out[st.req_id] = drafts
            return out
        self.replays = {r: p for r, p in self.replays.items() if r in live}
        replaying = []
        for st in states:
            replay = self.replays.get(st.req_id)
            if replay is not None and replay.state is st:
                replaying.append(replay)
            elif (drafts := self._match(runner, st, True)):   # (a new replay joins `replaying` next step)
                out[st.req_id] = drafts
        if replaying:
            out.update(self._replay(runner, replaying))
        return out

    def _replay(self, runner, replays: list[_Replay]) -> dict[str, list[int]]:
        """The replays' next k recorded tokens, at once: each request's new outputs (since its last
        check) must follow its recording; a request that left it drafts no more."""
        replays = [r for r in replays if r.matched >= 0]
        n = len(replays)
        if not n:
            return {}
        slots = np.fromiter((r.slot for r in replays), dtype=np.int64, count=n)
        matched = np.fromiter((r.matched for r in replays), dtype=np.int64, count=n)
        length = np.fromiter((r.length for r in replays), dtype=np.int64, count=n)
        npt = np.fromiter((r.state.num_prompt_tokens for r in replays), dtype=np.int64, count=n)
        n_out = np.fromiter((r.state.num_tokens for r in replays), dtype=np.int64, count=n) - npt
        new = np.maximum(n_out - matched, 0)   # (a request's outputs only grow: a resumed one replays anew)
        row = np.repeat(np.arange(n), new)
        at = matched[row] + np.arange(len(row)) - np.repeat(np.cumsum(new) - new, new)   # output index
        inside = at < length[row]
        same = inside & (runner.batch.token_ids[slots[row], npt[row] + at]
                         == self.table[slots[row], np.minimum(at, self.table.shape[1] - 1)])
        left = np.bincount(row, weights=~same, minlength=n) > 0
        cols = n_out[:, None] + np.arange(self.k)
        valid = cols < length[:, None]
        drafts = self.table[slots[:, None], np.minimum(cols, self.table.shape[1] - 1)]
        miss = self.rng.random((n, self.k)) < np.fromiter((r.miss_rate for r in replays), dtype=np.float64,
                                                           count=n)[:, None]
        drafts = np.where(miss, (drafts + 1) % self.vocab, drafts).tolist()
        counts = valid.sum(axis=1).tolist()
        out = {}
        for r, m, bad, d, c in zip(replays, n_out.tolist(), left.tolist(), drafts, counts):
            if r.follows and (bad or not c):   # left or outlived its recording: records on
                del self.replays[r.state.req_id]
                if (recorded := self._match(runner, r.state, True)):
                    out[r.state.req_id] = recorded
                continue
            if bad:
                r.matched = -1
                continue
            r.matched = m
            if c:
                out[r.state.req_id] = d[:c]
        return out

    def _start_replay(self, st, prompt: tuple[int, ...], rec: list[int], miss_rate: float) -> None:
        """Put a request's recording in its slot's row of the table (grown to fit)."""
        rows, cols = self.table.shape
        if st.slot >= rows or len(rec) > cols:
            grown = np.zeros((max(rows, st.slot + 1), max(cols, len(rec))), dtype=np.int64)
            grown[:rows, :cols] = self.table
            self.table = grown
        self.table[st.slot, :len(rec)] = rec
        self.replays[st.req_id] = _Replay(st, st.slot, len(rec), miss_rate, self._follows(st, prompt))

    def _match(self, runner, st, fast: bool) -> list[int]:
        """A request's drafts from its prompt's entry: recording it on its first run, else
        replaying it (fast: it joins the batched replays from its next step)."""
        tokens = runner.batch.token_ids[st.slot, :st.num_tokens]
        prompt = tuple(tokens[:st.num_prompt_tokens].tolist())
        if prompt not in self.recorded:
            return []
        rec, miss_rate = self.recorded[prompt]
        outputs = tokens[st.num_prompt_tokens:].tolist()
        n_out = len(outputs)
        if rec is not None and st.req_id not in self.recording:
            if rec[:n_out] == outputs and (n_out < len(rec) or not self._follows(st, prompt)):
                miss_rate = self.miss if miss_rate is None else miss_rate
                if fast:
                    self._start_replay(st, prompt, rec, miss_rate)
                    self.replays[st.req_id].matched = n_out
                return self._missed(rec[n_out:n_out + self.k], miss_rate)
            if not self._follows(st, prompt):
                return []
        # the first run records (and a run that left or outlived this engine's recording records
        # on): junk drafts (nearly all rejected) make every step a verify step, so the recording
        # has the verify steps' numerics, which the replays then meet
        self.recording[st.req_id] = prompt
        self.recorded[prompt] = (outputs, miss_rate)
        return [(outputs[-1] + 1 + i) % self.vocab for i in range(self.k)]

    def _follows(self, st, prompt: tuple[int, ...]) -> bool:
        """Whether a request records on where it leaves or outlives its prompt's recording: a
        greedy one, on a recording this engine made (a given one is the truth it drafts)."""
        return prompt in self.own and st.params.greedy

    def _missed(self, drafts: list[int], miss_rate: float) -> list[int]:
        """Each draft replaced by a wrong one with probability miss_rate."""
        if drafts and miss_rate > 0:
            miss = self.rng.random(len(drafts)) < miss_rate
            drafts = [(t + 1) % self.vocab if m else t for t, m in zip(drafts, miss.tolist())]
        return drafts
