"""Two micro-batches per large tensor-parallel step, so that NCCL sums while the GPU computes.

Under tensor parallelism every layer ends twice in an all-reduce (after o_proj and after
down_proj). A prefill step's sums are large (8,192 tokens of Qwen3-8B: 64 MiB each) and go
through NCCL, and the compute stream would wait for each. So such a step runs as two
micro-batches, A and B, layer by layer: A's attention, then B's while NCCL sums A's; A's MLP
(its norm waits for A's sum, long done) while NCCL sums B's; B's MLP while NCCL sums A's; and
so on (`AsyncSum`, workers/distributed.py). On two H200s a 64 MiB sum takes ~0.25 ms of a
~95 ms Qwen3-8B prefill step, 72 times per step.

The cut falls between two sequences, never inside one: each keeps its whole query and its
context in one micro-batch, so attention needs nothing but the metadata's halves. A step is cut
when the halves' sums would still go through NCCL (smaller ones take symmetric memory, where a
wait would save less than the cut costs) and the sequence boundary nearest the middle leaves each
half at least a quarter of the tokens.

LOOM_MICRO_BATCHES: "auto" (default, as above), "always" (every step of two sequences or
more, on any device: the tests run it on CPU under gloo), "never" (A/B runs).
"""
from __future__ import annotations

import os
from dataclasses import dataclass, replace

import numpy as np
import torch

from workers.attention import AttentionMetadata


def _mode() -> str:
    mode = os.environ.get("LOOM_MICRO_BATCHES", "auto")
    if mode not in ("auto", "always", "never"):
        raise ValueError(f"LOOM_MICRO_BATCHES must be auto, always or never, got {mode!r}")
    return mode


@dataclass
class MicroBatch:
    tokens: slice               # its rows of the step's tokens
    meta: AttentionMetadata     # its sequences' metadata


def cut_point(qsl: np.ndarray, sums_use_nccl) -> int | None:
    """The sequence boundary at which to cut a step (qsl: query start locations, host), or None.
    sums_use_nccl(tokens): whether a micro-batch of that many tokens sums through NCCL."""
    mode, num_seqs, total = _mode(), len(qsl) - 1, int(qsl[-1])
    if mode == "never" or num_seqs < 2 or (mode == "auto" and not sums_use_nccl(total // 4)):
        return None
    cut = 1 + int(np.argmin(np.abs(qsl[1:-1] - total / 2)))
    smaller = min(int(qsl[cut]), total - int(qsl[cut]))
    if mode == "always" or (smaller >= total // 4 and sums_use_nccl(smaller)):
        return cut
    return None


def split(meta: AttentionMetadata, qsl: np.ndarray, cut: int) -> list[MicroBatch]:
    """The step's metadata as two micro-batches: sequences [0, cut) and [cut, B)."""
    at, total = int(qsl[cut]), int(qsl[-1])
    first = replace(meta, query_start_loc=meta.query_start_loc[:cut + 1], seq_lens=meta.seq_lens[:cut],
                    block_table=meta.block_table[:cut], slot_mapping=meta.slot_mapping[:at],
                    num_decodes=min(meta.num_decodes, cut), seq_order=None, micro_batches=None)
    second = replace(meta, query_start_loc=meta.query_start_loc[cut:] - at, seq_lens=meta.seq_lens[cut:],
                     block_table=meta.block_table[cut:], slot_mapping=meta.slot_mapping[at:total],
                     num_decodes=max(meta.num_decodes - cut, 0), seq_order=None, micro_batches=None)
    return [MicroBatch(slice(0, at), first), MicroBatch(slice(at, total), second)]


def run_layers(model, hidden: torch.Tensor, positions: torch.Tensor, kv_caches: list,
               micro_batches: list[MicroBatch]) -> torch.Tensor:
    """A decoder stack (`model.layers`, then `model.norm`) over the micro-batches in turn, each
    sum left to NCCL while the other micro-batch computes; the final hidden states, in order."""
    states = [(hidden[mb.tokens], None) for mb in micro_batches]
    positions = [positions[..., mb.tokens] for mb in micro_batches]
    for layer, kv_cache in zip(model.layers, kv_caches, strict=True):
        states = [layer.self_attn(pos, h, res, layer.input_layernorm, kv_cache, mb.meta, async_sum=True)
                  for (h, res), pos, mb in zip(states, positions, micro_batches)]
        states = [layer.mlp(h, res, layer.post_attention_layernorm, async_sum=True) for h, res in states]
    return torch.cat([model.norm(h, res)[0] for h, res in states])
