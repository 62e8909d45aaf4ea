"""Sampler: logits of the rows that finished their prompt -> next tokens (+ logprobs).

Order: raw logprobs are taken first (what users compare with the model), then
logit_bias, min_tokens, penalties, and finally temperature / top-k / top-p /
min-p sampling. The random draw of a row is a pure function of the request's
seed and the index of the token being generated, so a seeded request gives the
same output whatever else is in the batch and however it was scheduled.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from ipc.sampling_params import SamplingParams


@dataclass
class SamplingRow:
    params: SamplingParams
    seed: int
    output_index: int                 # which output token this draw produces
    prompt_token_ids: np.ndarray      # for the repetition penalty
    output_token_ids: np.ndarray
    eos_token_ids: list[int]


_INT32_MAX = 2 ** 31 - 1  # validated at the boundaries; clamped here so a bad row can never raise


class Sampler:
    def __init__(self, use_triton: bool):
        self.use_triton = use_triton

    def _sample(self, logits: torch.Tensor, rows: list[SamplingRow], dev: dict[str, torch.Tensor]) -> torch.Tensor:
        from kernels import sampling  # imported on first random draw: greedy-only runs never need it
        args = (logits, dev["temperature"], dev["top_k"], dev["top_p"], dev["min_p"], dev["seeds"],
                dev["out_positions"])
        if not self.use_triton:
            return sampling.sample_ref(*args)
        vocab = logits.shape[-1]
        top_k_top_p = any(0 < r.params.top_k < vocab or r.params.top_p < 1.0 for r in rows)
        return sampling.sample(*args, top_k_top_p=top_k_top_p)

    @staticmethod
    def host_params(rows: list[SamplingRow]) -> dict[str, np.ndarray]:
        """Per-row parameters as host arrays (they travel to the device with the step's inputs)."""
        p = [r.params for r in rows]
        f32 = lambda xs: np.fromiter(xs, dtype=np.float32, count=len(rows))
        i32 = lambda xs: np.fromiter(xs, dtype=np.int32, count=len(rows))
        i64 = lambda xs: np.fromiter(xs, dtype=np.int64, count=len(rows))
        return {"temperature": f32(x.temperature for x in p), "top_k": i32(min(max(x.top_k, 0), _INT32_MAX) for x in p),
                "top_p": f32(x.top_p for x in p), "min_p": f32(x.min_p for x in p),
                "seeds": i64(r.seed & 0x7FFFFFFFFFFFFFFF for r in rows), "out_positions": i64(r.output_index for r in rows)}

    def __call__(self, logits: torch.Tensor, rows: list[SamplingRow], dev: dict[str, torch.Tensor]):
        """logits: [B, V] in the model's dtype (or float32); dev: host_params() on the device.
        Returns (token_ids int64 [B] tensor, logprobs or None, {row: error} of rows whose
        per-request adjustments failed: those requests fail alone, the batch goes on).

        Rounded bf16 logits convert to float32 exactly, so reading them as they are
        (argmax, the sampling kernel) equals reading a float32 copy; a copy is made
        only for logprobs and per-row adjustments."""
        max_lp = max((r.params.logprobs for r in rows if r.params.logprobs is not None), default=None)
        raw_logprobs = torch.log_softmax(logits.float(), dim=-1) if max_lp is not None else None

        failed: dict[int, str] = {}
        if any(r.params.logit_bias or r.params.min_tokens or r.params.needs_penalties for r in rows):
            logits = logits.to(torch.float32, copy=True)
            for i, r in enumerate(rows):
                try:
                    _adjust_row(logits[i], r)
                except Exception as e:  # noqa: BLE001  (one request's bad parameters fail that request)
                    failed[i] = f"{type(e).__name__}: {e}"

        if all(r.params.greedy for r in rows):
            tokens = logits.argmax(dim=-1)
        else:
            tokens = self._sample(logits, rows, dev)
        topk = None
        if raw_logprobs is not None:
            sampled_lp = raw_logprobs.gather(1, tokens.view(-1, 1))
            ranks = (raw_logprobs > sampled_lp).sum(dim=-1) + 1
            k = max(max_lp, 0)
            top_lp, top_ids = raw_logprobs.topk(k, dim=-1) if k else (raw_logprobs[:, :0], tokens[:, None][:, :0])
            topk = (tokens, sampled_lp.squeeze(1), ranks, top_ids, top_lp)
        return tokens, topk, failed


def _adjust_row(row: torch.Tensor, r: SamplingRow) -> None:
    params = r.params
    if params.logit_bias:
        ids = torch.tensor(list(params.logit_bias.keys()), dtype=torch.long, device=row.device)
        vals = torch.tensor(list(params.logit_bias.values()), dtype=row.dtype, device=row.device)
        valid = ids < row.shape[0]
        row.index_add_(0, ids[valid], vals[valid])
    if params.min_tokens and len(r.output_token_ids) < params.min_tokens:
        banned = set(params.stop_token_ids)
        if not params.ignore_eos:
            banned.update(r.eos_token_ids)
        if banned:
            row[torch.tensor(sorted(banned), dtype=torch.long, device=row.device)] = float("-inf")
    if params.needs_penalties:
        vocab = row.shape[0]
        out = torch.as_tensor(r.output_token_ids, dtype=torch.long, device=row.device)
        counts = torch.zeros(vocab, dtype=row.dtype, device=row.device)
        counts.index_add_(0, out, torch.ones_like(out, dtype=row.dtype))
        if params.repetition_penalty != 1.0:
            seen = counts > 0
            prompt = torch.as_tensor(r.prompt_token_ids, dtype=torch.long, device=row.device)
            seen[prompt] = True
            penalized = torch.where(row > 0, row / params.repetition_penalty, row * params.repetition_penalty)
            row.copy_(torch.where(seen, penalized, row))
        row -= params.frequency_penalty * counts
        row -= params.presence_penalty * (counts > 0).to(row.dtype)
