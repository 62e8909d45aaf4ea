"""Sampler: logits of the rows that finished their prompt -> next tokens (+ logprobs).

Order: raw logprobs are taken first (what users compare with the model), then
logit_bias, min_tokens and penalties (one launch for the whole batch:
kernels/penalties.py, reading the per-slot output counts and prompt masks the
persistent batch keeps on the device), and finally temperature / top-k /
top-p / min-p sampling. The random draw of a row is a pure function of the request's
seed and the index of the token being generated, so a seeded request gives the
same output whatever else is in the batch and however it was scheduled.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Generic, NamedTuple

import numpy as np
import torch

from ipc.sampling_params import SamplingParams
from workers.distributed import LogitsShard, all_gather
from workers.host_to_device import Array


ANY_TOKEN = -2   # in a bad word's padded prefix: before the word's start, matches any output


@dataclass(frozen=True)
class BadWords:
    """A request's bad_words_token_ids as the sampler bans them, made once per request: every
    prefix right-aligned in `prefix` [W, P] (ANY_TOKEN before a shorter one's start), the last
    tokens in `last` [W]. A word's last token is banned when the outputs end with its prefix."""
    prefix: np.ndarray
    last: np.ndarray

    @classmethod
    def of(cls, words: list[list[int]]) -> "BadWords":
        p = max(map(len, words)) - 1
        prefix = np.full((len(words), p), ANY_TOKEN, dtype=np.int64)
        for i, w in enumerate(words):
            prefix[i, p - len(w) + 1:] = w[:-1]
        return cls(prefix, np.array([w[-1] for w in words], dtype=np.int64))


@dataclass
class SamplingRow:
    params: SamplingParams
    seed: int
    output_index: int                 # which output token this draw produces (= outputs so far)
    slot: int = 0                     # the request's persistent-batch slot: its penalty state
    eos_token_ids: tuple[int, ...] = ()
    bad_words: BadWords | None = None

    @property
    def adjusts(self) -> bool:
        """Whether the row's logits change before sampling (penalties, logit_bias, min_tokens,
        allowed_token_ids, bad_words)."""
        p = self.params
        return bool(p.needs_penalties or p.logit_bias or p.allowed_token_ids or self.bad_words or self.banned())

    def banned(self) -> list[int]:
        """Ids the row may not draw yet: eos and stop tokens until min_tokens are out."""
        p = self.params
        if self.output_index >= p.min_tokens:
            return []
        return [*p.stop_token_ids, *(() if p.ignore_eos else self.eos_token_ids)]

    def bad_ids(self, vocab: int) -> str | None:
        """An error naming the ids outside [0, vocab) that the row's logit_bias or bans hold (the
        boundaries refuse them; a row that still has them fails alone)."""
        ids = [*(self.params.logit_bias or ()), *self.banned()]
        bad = sorted({t for t in ids if not 0 <= t < vocab}) if ids else None
        return f"IndexError: token ids {bad} outside the vocabulary [0, {vocab})" if bad else None


def keep_allowed(logits: torch.Tensor, allow_ids: torch.Tensor) -> torch.Tensor:
    """-inf for every token a row's allowed_token_ids leave out. allow_ids: int64 [B, N], each row
    padded with -1; a row of -1 alone (no allow-list) keeps every token. Ids outside the
    vocabulary (the boundaries refuse them) land in a spare column and are dropped."""
    bsz, vocab = logits.shape
    inside = (allow_ids >= 0) & (allow_ids < vocab)
    keep = torch.zeros((bsz, vocab + 1), dtype=torch.bool, device=logits.device)
    keep.scatter_(1, torch.where(inside, allow_ids, vocab), True)
    keep = keep[:, :vocab] | (allow_ids[:, :1] < 0)
    return logits.masked_fill(~keep, float("-inf"))


def ban_bad_words(logits: torch.Tensor, recent: torch.Tensor, prefix: torch.Tensor, last: torch.Tensor
                  ) -> torch.Tensor:
    """-inf for each bad word's last token where a row's latest outputs equal the word's prefix.
    recent: int64 [B, H], each row's last H outputs, oldest first (-1 before its first);
    prefix: [B, W, P] (P <= H), right-aligned, ANY_TOKEN before a shorter word's start;
    last: [B, W], -1 where a row has fewer words."""
    bsz, vocab = logits.shape
    tail = recent[:, recent.shape[1] - prefix.shape[2]:]
    hit = ((prefix == tail[:, None, :]) | (prefix == ANY_TOKEN)).all(dim=-1) & (last >= 0) & (last < vocab)
    ban = torch.zeros((bsz, vocab + 1), dtype=torch.bool, device=logits.device)
    ban.scatter_(1, torch.where(hit, last, vocab), True)   # a miss lands in the spare column
    return logits.masked_fill(ban[:, :vocab], float("-inf"))


@dataclass
class SamplingArrays(Generic[Array]):
    """The sampled rows' parameters, one entry per row: numpy arrays as host_params() builds
    them, torch tensors once they are on the device (HostToDevice.upload)."""
    temperature: Array       # float32 (0: greedy)
    top_k: Array             # int32 (0: off)
    top_p: Array             # float32
    min_p: Array             # float32
    seeds: Array             # int64
    output_indices: Array    # int64: which output token each row draws (its random stream's index)
    slots: Array             # int64: each row's persistent-batch slot (penalty counts, last outputs)
    # the adjustments, present only when some row adjusts its logits (SamplingRow.adjusts)
    penalty_slots: Array | None = None    # int64: the slot whose counts a row reads (0 without penalties)
    repetition_penalty: Array | None = None  # float32
    presence_penalty: Array | None = None    # float32
    frequency_penalty: Array | None = None   # float32
    bias_ids: Array | None = None         # int32 [B, N], -1 padded: logit_bias keys
    bias_values: Array | None = None      # float32 [B, N]
    banned_ids: Array | None = None       # int32 [B, N], -1 padded: min_tokens' banned stop ids
    allowed_ids: Array | None = None      # int64 [B, N], -1 padded: allowed_token_ids (some row has it)
    bad_word_prefix: Array | None = None  # int64 [B, W, P] (some row has bad words): ban_bad_words'
    bad_word_last: Array | None = None    # int64 [B, W]

    @property
    def adjusts(self) -> bool:
        return self.penalty_slots is not None


class TopLogprobs(NamedTuple):
    """The sampled rows' logprobs: ids [B, 1 + N] (the sampled token, then the top N by logit),
    their logprobs [B, 1 + N], the sampled token's rank [B]."""
    ids: torch.Tensor
    logprobs: torch.Tensor
    ranks: torch.Tensor


class SampledTokens(NamedTuple):
    """What the sampler returns for a step's sampled rows."""
    tokens: torch.Tensor                 # int64 [B], on the device
    top_logprobs: TopLogprobs | None     # where some row asks for logprobs
    failed: dict[int, str]               # row -> error: parameters naming ids outside the vocabulary
    masked: torch.Tensor | None          # bool [B]: rows left with no token to sample (or None)


def _bad_word_batch(rows: list[SamplingRow]) -> tuple[np.ndarray, np.ndarray]:
    """The rows' BadWords as one [B, W, P] prefix and [B, W] last array (ban_bad_words' inputs)."""
    words = [r.bad_words for r in rows if r.bad_words is not None]
    w, p = max(len(b.last) for b in words), max(b.prefix.shape[1] for b in words)
    prefix = np.full((len(rows), w, p), ANY_TOKEN, dtype=np.int64)
    last = np.full((len(rows), w), -1, dtype=np.int64)
    for i, r in enumerate(rows):
        if (b := r.bad_words) is not None:
            prefix[i, :len(b.last), p - b.prefix.shape[1]:] = b.prefix
            last[i, :len(b.last)] = b.last
    return prefix, last


def _padded(lists: list[list], dtype, fill) -> np.ndarray:
    """Rows of different lengths as one [B, max_len] array (fill past each row's end)."""
    out = np.full((len(lists), max(map(len, lists), default=0)), fill, dtype=dtype)
    for i, xs in enumerate(lists):
        out[i, :len(xs)] = xs
    return out


_INT32_MAX = 2 ** 31 - 1  # validated at the boundaries; clamped here so a bad row can never raise
# vLLM's _MAX_TEMP: a positive temperature below it is raised to it, as 1 / temperature would
# overflow (a subnormal temperature made every score NaN, and token 0 won)
MIN_TEMPERATURE = 1e-2


def _temperature(t: float) -> float:
    return t if t <= 0.0 or t >= MIN_TEMPERATURE else MIN_TEMPERATURE


def sample_plain(logits: torch.Tensor | LogitsShard, params: SamplingArrays, use_triton: bool) -> torch.Tensor:
    """The tokens of rows that all sample plainly (Sampler.plain), from the whole logits or,
    under tensor parallelism, this rank's LogitsShard (every rank then draws the same tokens
    through two small exchanges): the decode graphs' head, and eager steps of such rows.
    From the whole logits, rows may have top-p too (Sampler.plain(top_p=True)): the chunked
    race checks its winner against each row's top-p set (kernels/sampling.py), one more
    launch, whose programs return at once for rows without top-p."""
    from kernels import sampling
    if isinstance(logits, LogitsShard):
        args = (logits.logits, logits.vocab_start, logits.vocab_size, params.temperature, params.min_p,
                params.seeds, params.output_indices, all_gather)
        return sampling.sample_sharded(*args, world=logits.world) if use_triton else sampling.sample_sharded_ref(*args)
    args = (logits, params.temperature, params.top_k, params.top_p, params.min_p, params.seeds,
            params.output_indices)
    return sampling.sample(*args, max_top_k=0) if use_triton else sampling.sample_ref(*args)


class Sampler:
    def __init__(self, use_triton: bool):
        self.use_triton = use_triton
        self._empty_state: tuple[torch.Tensor, torch.Tensor] | None = None

    def _no_state(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """A one-slot all-zero penalty state, for steps before any request had penalties
        (logit_bias / min_tokens rows then read slot 0 of it, to no effect)."""
        if self._empty_state is None:
            shape = (1, logits.shape[-1])
            self._empty_state = (torch.zeros(shape, dtype=torch.int32, device=logits.device),
                                 torch.zeros(shape, dtype=torch.uint8, device=logits.device))
        return self._empty_state

    def _sample(self, logits: torch.Tensor, rows: list[SamplingRow], params: SamplingArrays) -> torch.Tensor:
        from kernels import sampling  # imported on first random draw: greedy-only runs never need it
        args = (logits, params.temperature, params.top_k, params.top_p, params.min_p, params.seeds,
                params.output_indices)
        if not self.use_triton:
            return sampling.sample_ref(*args)
        vocab = logits.shape[-1]
        top_k_top_p = any(0 < r.params.top_k < vocab or r.params.top_p < 1.0 for r in rows)
        max_top_k = max((r.params.top_k for r in rows if 0 < r.params.top_k < vocab), default=0)
        top_p_only = any(r.params.top_p < 1.0 and not 0 < r.params.top_k < vocab and not r.params.greedy
                         for r in rows)
        return sampling.sample(*args, top_k_top_p=top_k_top_p, max_top_k=max_top_k, top_p_only=top_p_only)

    @staticmethod
    def plain(rows: list[SamplingRow], vocab: int, top_p: bool = False) -> bool:
        """Whether every row samples by greedy, temperature or min-p alone (no top-k or top-p,
        logprobs or adjustments): what the decode graphs' head samples (workers/decode_graphs.py).
        top_p=True: top-p rows too, where the logits are whole (sample_plain), not a shard."""
        return all(not 0 < r.params.top_k < vocab and (top_p or r.params.top_p >= 1.0) and r.params.logprobs is None
                   and not r.adjusts for r in rows)

    @staticmethod
    def penalties_only(rows: list[SamplingRow], vocab: int) -> bool:
        """Whether the rows sample as Sampler.plain(top_p=True) but for repetition / presence /
        frequency penalties on some of them (no logit_bias, min_tokens bans, allow-lists or bad
        words): the decode graphs' penalty head samples them (DecodeGraphs.run_head)."""
        def only_penalties(r: SamplingRow) -> bool:
            p = r.params
            return not (p.logit_bias or p.allowed_token_ids or r.bad_words or r.banned())
        return (any(r.params.needs_penalties for r in rows)
                and all(not 0 < r.params.top_k < vocab and r.params.logprobs is None and only_penalties(r)
                        for r in rows))

    @staticmethod
    def host_params(rows: list[SamplingRow]) -> SamplingArrays[np.ndarray]:
        """Per-row parameters as host arrays (they travel to the device with the step's inputs).
        The adjustment inputs (penalties, logit_bias, min_tokens bans) only when a row needs them."""
        p = [r.params for r in rows]
        n = len(rows)
        f32 = lambda xs: np.fromiter(xs, dtype=np.float32, count=n)
        i32 = lambda xs: np.fromiter(xs, dtype=np.int32, count=n)
        i64 = lambda xs: np.fromiter(xs, dtype=np.int64, count=n)
        host = SamplingArrays(temperature=f32(_temperature(x.temperature) for x in p),
                              top_k=i32(min(max(x.top_k, 0), _INT32_MAX) for x in p),
                              top_p=f32(x.top_p for x in p), min_p=f32(x.min_p for x in p),
                              seeds=i64(r.seed & 0x7FFFFFFFFFFFFFFF for r in rows),
                              output_indices=i64(r.output_index for r in rows), slots=i64(r.slot for r in rows))
        if any(r.adjusts for r in rows):
            bias = [x.logit_bias or {} for x in p]
            # only a row with penalties reads its slot's state (others read slot 0 with no effect)
            host.penalty_slots = i64(r.slot if r.params.needs_penalties else 0 for r in rows)
            host.repetition_penalty = f32(x.repetition_penalty for x in p)
            host.presence_penalty = f32(x.presence_penalty for x in p)
            host.frequency_penalty = f32(x.frequency_penalty for x in p)
            host.bias_ids = _padded([[t if 0 <= t <= _INT32_MAX else -1 for t in b] for b in bias], np.int32, -1)
            host.bias_values = _padded([list(b.values()) for b in bias], np.float32, 0.0)
            host.banned_ids = _padded([[t if 0 <= t <= _INT32_MAX else -1 for t in r.banned()] for r in rows],
                                      np.int32, -1)
            if any(x.allowed_token_ids for x in p):  # (no per-id Python here: keep_allowed drops bad ids)
                host.allowed_ids = _padded([x.allowed_token_ids or () for x in p], np.int64, -1)
            if any(r.bad_words for r in rows):
                host.bad_word_prefix, host.bad_word_last = _bad_word_batch(rows)
        return host

    def adjust(self, logits: torch.Tensor, rows: list[SamplingRow], params: SamplingArrays,
               state: tuple[torch.Tensor, torch.Tensor] | None, recent: torch.Tensor | None
               ) -> tuple[torch.Tensor, dict[int, str], torch.Tensor | None]:
        """logit_bias, min_tokens, penalties, allowed_token_ids and bad words on the rows that ask
        (the rejection sampler's too): the adjusted logits, {row: error} and the rows left no token."""
        failed, masked = {}, None
        if params.adjusts:  # some row adjusts its logits
            failed = {i: why for i, r in enumerate(rows) if (why := r.bad_ids(logits.shape[-1]))}
            from kernels.penalties import apply_penalties
            counts, prompt_mask = state if state is not None else self._no_state(logits)
            logits = apply_penalties(logits, params.penalty_slots, counts, prompt_mask, params.repetition_penalty,
                                     params.presence_penalty, params.frequency_penalty, params.bias_ids,
                                     params.bias_values, params.banned_ids)
            if params.allowed_ids is not None:
                logits = keep_allowed(logits, params.allowed_ids)
            if params.bad_word_last is not None:
                logits = ban_bad_words(logits, recent.index_select(0, params.slots), params.bad_word_prefix,
                                       params.bad_word_last)
            if params.allowed_ids is not None:   # only an allow list can leave a row no token (with bans, bad
                # words or a grammar): flagged on the device, read with the tokens (no sync here)
                masked = torch.isneginf(logits.amax(dim=-1))
        return logits, failed, masked

    def __call__(self, logits: torch.Tensor | LogitsShard, rows: list[SamplingRow], params: SamplingArrays,
                 state: tuple[torch.Tensor, torch.Tensor] | None = None, recent: torch.Tensor | None = None
                 ) -> SampledTokens:
        """logits: [B, V] in the model's dtype (or float32); params: host_params() on the device;
        state: the persistent batch's (output_counts, prompt_mask), [slots, V] each, needed
        when a row has penalties (None before any request had them); recent: its last outputs
        per slot [slots, H], needed when a row has bad words. Returns SampledTokens: the
        token ids, TopLogprobs or None (N the most any row asks), {row: error} of rows whose
        parameters name token ids outside the vocabulary (those requests fail alone, the batch
        goes on, the kernels ignoring such ids), and None or a bool [B] tensor of rows that had
        no token left to sample once adjusted (their token is meaningless and their request fails).

        Rounded bf16 logits convert to float32 exactly, so reading them as they are
        (argmax, the sampling kernel) equals reading a float32 copy; a float32 copy is
        made only for logprobs and adjustments (both on the device, no host sync).

        A LogitsShard (tensor parallelism) comes only for rows that all sample plainly."""
        if isinstance(logits, LogitsShard):
            return SampledTokens(sample_plain(logits, params, self.use_triton), None, {}, None)
        max_lp = max((r.params.logprobs for r in rows if r.params.logprobs is not None), default=None)
        # (dtype=: one kernel reads the logits as they are and writes float32, no float copy first)
        raw_logprobs = torch.log_softmax(logits, dim=-1, dtype=torch.float32) if max_lp is not None else None
        raw_logits = logits
        logits, failed, masked = self.adjust(logits, rows, params, state, recent)
        if all(r.params.greedy for r in rows):
            tokens = logits.argmax(dim=-1)
        else:
            tokens = self._sample(logits, rows, params)
        topk = None
        if raw_logprobs is not None:
            sampled_lp = raw_logprobs.gather(1, tokens.view(-1, 1))
            ranks = (raw_logprobs > sampled_lp).sum(dim=-1) + 1
            k = min(max(max_lp, 0), logits.shape[-1])
            # the top ids by logit are the top ids by logprob: select on the narrower raw logits;
            # the sampled token goes first in each row: two tensors to copy back, one list per row
            ids = tokens.view(-1, 1)
            if k:
                ids = torch.cat((ids, raw_logits.topk(k, dim=-1).indices), dim=1)
            topk = TopLogprobs(ids, raw_logprobs.gather(1, ids), ranks)
        return SampledTokens(tokens, topk, failed, masked)
