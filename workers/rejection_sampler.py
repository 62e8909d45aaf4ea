"""RejectionSampler: verifies a step's draft tokens (speculative decoding), as vLLM's
v1/sample/rejection_sampler.py, so that every output distribution is the target's.

A request with k drafts d_1..d_k has k + 1 logits rows in the step: row j is the target's
distribution p_j of the token after d_1..d_j (row 0: after its last known token). Each row
is processed exactly as the plain sampler processes a row (logit_bias, min_tokens, allowed
ids, the grammar bitmask; temperature, min-p, top-k, top-p), then:

* greedy rows accept d_{j+1} while it is row j's argmax; the first mismatch emits the argmax
  (so greedy output equals decoding without drafts, token for token);
* random rows accept d_{j+1} with probability min(1, p_j(d) / q_j(d)); on the first rejection
  the token is drawn from the normalised residual max(0, p_j - q_j); when every draft is
  accepted a bonus token is drawn from p_k. Loom's proposers draft greedily, so q_j is one-hot
  at d (draft_probs None): accept with p_j(d), resample from p_j without d.

The runner verifies with verify_samples (below): for one-hot drafts it is this sampler, with each
row's draw the plain sampler's own (so it runs in the decode graphs' head). rejection_sample and
RejectionSampler serve drafts that come with their probabilities (draft_probs).

Randomness is a pure function of (request seed, output index) through mix_seed, with streams
of their own: a seeded request reproduces whatever the batch, on the device with no host sync.
"""
from __future__ import annotations

from typing import NamedTuple

import numpy as np
import torch

from kernels.sampling import mix_seed

_ACCEPT_SALT = 0x5EC_ACCE97       # the acceptance draws' stream
_RESAMPLE_SALT = 0x5EC_5A3971E    # the recovered / bonus tokens' noise


class SpecVerdict(NamedTuple):
    """Per request: the token it emits after its accepted drafts, and how many it accepted."""
    tokens: torch.Tensor          # int64 [B]
    num_accepted: torch.Tensor    # int64 [B]
    final_rows: torch.Tensor      # int64 [B]: the logits row that emitted `tokens`


def uniforms(seeds: torch.Tensor, indices: torch.Tensor, salt: int) -> torch.Tensor:
    """One U(0, 1) float32 per (seed, index), from the top 24 bits of a splitmix64 hash."""
    bits = (mix_seed(seeds ^ salt, indices) >> 40) & 0xFFFFFF
    return (bits.float() + 0.5) * (1.0 / (1 << 24))


def exponential_noise(seeds: torch.Tensor, indices: torch.Tensor, vocab: int) -> torch.Tensor:
    """Exp(1) noise [B, V]: token t of row b from hash(seed_b, index_b, t)."""
    row = mix_seed(seeds ^ _RESAMPLE_SALT, indices)
    tok = torch.arange(vocab, device=seeds.device)
    u = uniforms(row[:, None].expand(-1, vocab), tok[None, :].expand(len(row), -1), 0)
    return -torch.log(u)


def target_probs(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
                 min_p: torch.Tensor, truncates: bool = True) -> torch.Tensor:
    """The distribution the plain sampler draws each row from (kernels/sampling.py's filters, in
    its order: min-p, then top-k, then top-p over what is left), as float32 probabilities.
    truncates: whether some row has top-k or top-p (the host knows; no sync to ask the device)."""
    logits = logits.float()
    vocab = logits.shape[-1]
    t = torch.where(temperature > 0, temperature, torch.ones_like(temperature)).float()
    probs = torch.softmax(logits / t[:, None], dim=-1)
    keep = probs >= (min_p.float()[:, None] * probs.amax(dim=-1, keepdim=True))
    k_on = (top_k > 0) & (top_k < vocab)
    p_on = top_p < 1.0
    if truncates:
        kept = probs * keep
        srt, _ = kept.sort(dim=-1, descending=True)
        kth = srt.gather(1, (top_k.long().clamp(1, vocab) - 1)[:, None])
        keep &= ~k_on[:, None] | (probs >= kth)
        kept = probs * keep
        srt, _ = kept.sort(dim=-1, descending=True)
        before = srt.cumsum(dim=-1) - srt          # mass strictly above each sorted token
        total = srt.sum(dim=-1, keepdim=True)
        # the smallest set with mass >= top_p: the tokens with less than top_p above them
        n_keep = (before < top_p.float()[:, None] * total).sum(dim=-1, keepdim=True).clamp(min=1)
        thr = srt.gather(1, n_keep - 1)
        keep &= ~p_on[:, None] | (probs >= thr)
    probs = probs * keep
    return probs / probs.sum(dim=-1, keepdim=True).clamp(min=1e-30)


def rejection_sample(logits: torch.Tensor, greedy: torch.Tensor, draft: torch.Tensor, rows: torch.Tensor,
                     u: torch.Tensor | None, noise_fn, probs: torch.Tensor | None,
                     draft_probs: torch.Tensor | None = None) -> SpecVerdict:
    """The verdict for B requests whose logits rows are rows [B, K + 1] (-1 past a request's
    last row, which is its bonus row). logits: processed [R, V] (greedy rows read their argmax);
    greedy [R]; draft [R]: the draft token each row checks (-1 on bonus rows); u [R]: U(0, 1)
    per row; noise_fn(final_rows) -> Exp(1) noise [B, V] for the emitting rows; probs [R, V]:
    the random rows' target distribution (None: every row greedy); draft_probs [R, V]: q (None:
    one-hot at the draft, as Loom's proposers draft greedily)."""
    argmax = logits.argmax(dim=-1)
    is_draft = draft >= 0
    d = draft.clamp(min=0)
    accept = argmax == d
    if probs is not None:
        p_d = probs.gather(1, d[:, None]).squeeze(1)
        ratio = p_d if draft_probs is None else p_d / draft_probs.gather(1, d[:, None]).squeeze(1).clamp(min=1e-30)
        accept = torch.where(greedy, accept, u < ratio)
    accept &= is_draft
    valid = rows >= 0
    acc_pad = accept[rows.clamp(min=0)] & valid
    num_accepted = torch.cumprod(acc_pad.long(), dim=1).sum(dim=1)
    final_rows = rows.gather(1, num_accepted[:, None]).squeeze(1)
    tokens = argmax[final_rows]
    if probs is not None:
        p = probs[final_rows]
        if draft_probs is None:   # q one-hot at the rejected draft (zero on a bonus row)
            q = torch.zeros_like(p).scatter_(1, d[final_rows][:, None], is_draft[final_rows][:, None].float())
        else:
            q = draft_probs[final_rows] * is_draft[final_rows][:, None]
        residual = (p - q).clamp(min=0)
        residual = torch.where(residual.sum(dim=-1, keepdim=True) > 0, residual, p)
        drawn = (residual / noise_fn(final_rows)).argmax(dim=-1)
        tokens = torch.where(greedy[final_rows], tokens, drawn)
    return SpecVerdict(tokens, num_accepted, final_rows)


def verify_samples(samples: torch.Tensor, draft: torch.Tensor, rows: torch.Tensor) -> SpecVerdict:
    """The verdict for drafts drawn greedily (q one-hot at each draft, as every Loom proposer
    drafts), from one token per logits row that the plain sampler drew from that row's p_j (with
    the row's own seed and output index, as a step without drafts would draw it): accept d_{j+1}
    while row j drew it; emit the first row's draw that differs (or the bonus row's).

    That is the standard rejection sampler for a one-hot q: d is accepted with probability
    p_j(d) = min(1, p_j(d) / q_j(d)), and a draw from p_j that is not d is distributed as the
    normalised residual max(0, p_j - q_j). Greedy rows draw their argmax. So every token is
    the one the plain sampler draws at its output index: a seeded request's output is the same
    with and without speculation, and the whole verdict is a few device ops on the samples (no
    host sync; in a decode graph's step the graph's head draws them).
    samples, draft [R] (draft -1 on bonus rows); rows [B, K + 1], each request's logits rows
    padded past its last with that last one, its bonus row (bonus_padded)."""
    # a bonus row never matches (draft -1): each request's first mismatch is at or before it,
    # and argmax returns the first of equal maxima (six launches, where cumprod and masks took ten)
    mismatch = (samples != draft).to(torch.uint8)
    num_accepted = mismatch[rows].argmax(dim=1)
    final_rows = rows.gather(1, num_accepted[:, None]).squeeze(1)
    return SpecVerdict(samples[final_rows], num_accepted, final_rows)


def bonus_padded(rows: np.ndarray) -> np.ndarray:
    """A SpecLayout's rows [B, K + 1] (-1 past a request's last) padded with each request's last
    row instead, as verify_samples reads them."""
    return np.where(rows >= 0, rows, rows.max(axis=1, keepdims=True))


class RejectionSampler:
    """The runner's entry: processed logits and the rows' sampling parameters in, a SpecVerdict out."""

    def __call__(self, logits: torch.Tensor, params, draft: torch.Tensor, rows: torch.Tensor,
                 sampling_rows) -> SpecVerdict:
        """params: the rows' SamplingArrays on the device (seeds, output_indices, temperature, ...);
        sampling_rows: their SamplingRows (host), which say what the rows need."""
        greedy = params.temperature <= 0
        if all(r.params.greedy for r in sampling_rows):
            return rejection_sample(logits, greedy, draft, rows, None, None, None)
        vocab = logits.shape[-1]
        truncates = any(0 < r.params.top_k < vocab or r.params.top_p < 1.0 for r in sampling_rows)
        probs = target_probs(logits, params.temperature, params.top_k, params.top_p, params.min_p, truncates)
        u = uniforms(params.seeds, params.output_indices, _ACCEPT_SALT)

        def noise(final_rows: torch.Tensor) -> torch.Tensor:
            return exponential_noise(params.seeds[final_rows], params.output_indices[final_rows], vocab)
        return rejection_sample(logits, greedy, draft, rows, u, noise, probs)
