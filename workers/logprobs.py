"""Logprobs a step returns: of each sampled token (with its top-k, from the sampler), and of the
prompt tokens of requests that ask for prompt_logprobs (computed here from the step's hidden
states, in one batch on the device).

Prompt position p predicts prompt token p + 1, so a step computes the logprobs of the prompt
positions it runs that still have a prompt token after them. Their rows and target tokens
travel with the step's inputs (`prompt_logprob_rows`: StepArrays.prompt_logprob_rows and _targets); the tensors stay on the device until the
step's copy-back, and `pack_prompt_logprobs` turns them into messages.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import numpy as np
import torch

from ipc.messages import Logprobs, PromptLogprobs


@dataclass
class PromptLogprobSpans:
    """The prompt logprobs a step computes: per request (req_id, first row, rows, top-N), and
    the tensors of all their rows (target ids, target logprob, rank, top ids, top logprobs);
    pinned host copies after copy_back()."""
    spans: list[tuple[str, int, int, int]]
    tensors: tuple


class PromptSpan(NamedTuple):
    """A request's prompt positions whose next prompt token's logprob a step computes."""
    request: int          # its index in the step
    first_position: int
    count: int


class PromptLogprobRows(NamedTuple):
    rows: np.ndarray      # int64: the step's token rows of the spans' positions
    targets: np.ndarray   # int64: the prompt token after each


def prompt_logprob_spans(states, start: np.ndarray, num_scheduled: np.ndarray) -> list[PromptSpan]:
    """The spans whose next prompt token's logprob this step computes: position p predicts
    token p + 1, while that is still a prompt token."""
    spans = []
    for i, st in enumerate(states):
        if st.params.prompt_logprobs is not None and start[i] < st.num_prompt_tokens:
            count = max(int(min(num_scheduled[i], st.num_prompt_tokens - 1 - start[i])), 0)
            spans.append(PromptSpan(i, int(start[i]), count))
    return spans


def prompt_logprob_rows(spans: list[PromptSpan], states, query_start_loc: np.ndarray,
                        token_ids: np.ndarray) -> PromptLogprobRows | None:
    """The rows (into the step's tokens, query_start_loc: each request's first) and the prompt
    tokens (from the persistent batch's token_ids) of the step's prompt_logprob_spans."""
    if not spans:
        return None
    return PromptLogprobRows(
        np.concatenate([np.arange(query_start_loc[i], query_start_loc[i] + cnt, dtype=np.int64)
                        for i, _, cnt in spans]),
        np.concatenate([token_ids[states[i].slot, lo + 1:lo + 1 + cnt] for i, lo, cnt in spans]))


def prompt_logprobs(model, batch, hidden: torch.Tensor) -> PromptLogprobSpans | None:
    """The prompt logprobs of every request of the StepBatch that asks, in one batch on the
    device (no sync): the lm_head over its prompt_logprob_rows, a log-softmax, the targets'
    logprobs and ranks, and the top-N."""
    spans = batch.prompt_logprob_spans
    if not spans:
        return None
    k = min(max(batch.states[i].params.prompt_logprobs for i, _, _ in spans), model.config.vocab_size)
    out, first = [], 0
    for i, _, cnt in spans:
        st = batch.states[i]
        out.append((st.req_id, first, cnt, st.params.prompt_logprobs))
        first += cnt
    if not first:
        return PromptLogprobSpans(out, ())
    rows = batch.device.prompt_logprob_rows
    lp = torch.log_softmax(model.compute_logits(hidden.index_select(0, rows)).float(), dim=-1)
    targets = batch.device.prompt_logprob_targets
    tlp = lp.gather(1, targets.view(-1, 1))
    ranks = (lp > tlp).sum(-1) + 1
    top_lp, top_ids = lp.topk(k, dim=-1) if k else (lp[:, :0], targets[:, None][:, :0])
    return PromptLogprobSpans(out, (targets, tlp.squeeze(1), ranks, top_ids, top_lp))


def pack_prompt_logprobs(plp: PromptLogprobSpans | None) -> dict[str, PromptLogprobs] | None:
    """The copied-back tensors as one PromptLogprobs per request."""
    if plp is None:
        return None
    if not plp.tensors:
        return {rid: PromptLogprobs([], [], []) for rid, _, _, _ in plp.spans}
    targets, tlp, ranks, top_ids, top_lp = (t.tolist() for t in plp.tensors)
    out = {}
    for rid, a, cnt, k in plp.spans:
        b = a + cnt
        out[rid] = PromptLogprobs([[t] + ids[:k] for t, ids in zip(targets[a:b], top_ids[a:b])],
                                  [[v] + vals[:k] for v, vals in zip(tlp[a:b], top_lp[a:b])], ranks[a:b])
    return out


def pack_logprobs(states, sample_rows: np.ndarray, topk) -> dict[str, Logprobs]:
    """Each asking row's sampled token and its top-k: a row of the sampler's [B, 1 + N]
    arrays, cut to 1 + k where the row asks for fewer than the most any row asks. Where every
    row asks for the most (one logprobs value in the whole batch, the usual case) the Logprobs
    are built by C loops alone (zip's 1-tuples encode as the lists they stand for)."""
    ids, lps, ranks = (t.tolist() for t in topk)
    width = len(ids[0]) if ids else 0
    rows = [states[i] for i in sample_rows.tolist()]
    if all(st.params.logprobs is not None and st.params.logprobs + 1 >= width for st in rows):
        return dict(zip([st.req_id for st in rows], map(Logprobs, zip(ids), zip(lps), zip(ranks))))
    out = {}
    for j, st in enumerate(rows):
        k = st.params.logprobs
        if k is not None:
            n = k + 1
            out[st.req_id] = Logprobs([ids[j][:n]], [lps[j][:n]], [ranks[j]])
    return out


def pack_spec_logprobs(states, sample_rows: np.ndarray, topk, spec, num_accepted: list[int]) -> dict[str, Logprobs]:
    """A verify step's logprobs: each asking request's rows of its accepted drafts and the token
    after them (spec.rows), cut to 1 + k per row."""
    ids, lps, ranks = (t.tolist() for t in topk)
    out = {}
    for j, i in enumerate(sample_rows.tolist()):
        k = states[i].params.logprobs
        if k is None:
            continue
        rows = spec.rows[j, :num_accepted[j] + 1].tolist()
        out[states[i].req_id] = Logprobs([ids[r][:k + 1] for r in rows], [lps[r][:k + 1] for r in rows],
                                         [ranks[r] for r in rows])
    return out
