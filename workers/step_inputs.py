"""A step's inputs: what prepare() builds on the host, uploads, and hands to forward() and sample().

StepArrays holds them as numpy arrays on the host and, with the same field names, as torch
tensors on the device (HostToDevice.upload copies one into the other, one transfer per
dtype; a decode graph's step travels in the graph's staging instead: workers/decode_graphs.py).
StepBatch is the whole step as the runner's phases pass it along.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Generic, NamedTuple

import numpy as np
import torch

from workers.attention import AttentionMetadata
from workers.host_to_device import Array
from workers.input_batch import CachedRequestState, InputBatch
from workers.logprobs import PromptSpan
from workers.sampler import SamplingArrays, SamplingRow
from workers.spec_decode.verify_layout import SpecLayout
from workers.step_stats import StepToken

if TYPE_CHECKING:
    from workers.model_runner import PendingStep


@dataclass
class StepArrays(Generic[Array]):
    """One step's arrays: T scheduled tokens of B requests (decodes first)."""
    input_ids: Array             # int64 [T]
    positions: Array             # int64 [T] ([3, T] under M-RoPE)
    slot_mapping: Array          # int64 [T]: the KV cache slot each token writes
    query_start_loc: Array       # int32 [B + 1]: where each request's tokens start
    seq_lens: Array              # int32 [B]: each request's context, this step's tokens included
    block_table: Array           # int32 [B, blocks]: each request's KV blocks, as wide as the longest needs
    decode_order: Array | None = None     # int32 [decodes]: the decodes' attention launch order (decode_order())
    sample_index: Array | None = None     # int64: the hidden-state row of each sampled request (padded)
    prompt_logprob_rows: Array | None = None     # int64: the rows whose next prompt token's logprob is asked
    prompt_logprob_targets: Array | None = None  # int64: those next prompt tokens
    # decode inputs that are the previous step's sampled tokens, still on the device (feed_indices())
    graph_feed_rows: Array | None = None  # int64 [B]: a decode graph's row -> row in those tokens (-1: none)
    fed_token_index: Array | None = None  # int64: an eager step's tokens that take one of them ...
    fed_from_rows: Array | None = None    # int64: ... and which one (the row in those tokens)
    sampling: SamplingArrays[Array] | None = None  # the sampled rows' parameters (Sampler.host_params)


HostInputs = StepArrays[np.ndarray]
DeviceInputs = StepArrays[torch.Tensor]


@dataclass
class StepBatch:
    """One step's inputs, as prepare() builds them for forward() and sample()."""
    states: list[CachedRequestState]
    num_scheduled: np.ndarray                 # tokens scheduled per request
    computed_before: np.ndarray               # computed tokens before the step
    computed_after: np.ndarray
    sample_rows: np.ndarray                   # requests that sample a token (not mid-prompt)
    sampling_rows: list[SamplingRow]          # (a verify step the graph head samples: one per request)
    host: HostInputs
    device: DeviceInputs
    attention: AttentionMetadata | None       # None: a decode graph's step (the graph holds its own)
    decode_graph_size: int | None             # the decode CUDA graph that runs it, if any
    stats_token: StepToken | None = None
    inputs_embeds: torch.Tensor | None = None  # multimodal: encoder outputs at the placeholders
    piecewise_size: int | None = None          # else the piecewise graphs' size that runs it, if any
    graph_samples: bool = False                # the decode graph's head samples it
    plain: bool = False                        # every sampled row samples plainly, now (Sampler.plain)
    prompt_logprob_spans: list[PromptSpan] = field(default_factory=list)  # computed once, in prepare()
    spec: SpecLayout | None = None             # a verify step's drafts (speculative decoding)
    grammar_head: bool = False                 # graph_samples in the decode graph's grammar head
    graph_penalties: bool = False              # the head samples it with penalties (Sampler.penalties_only)
    cascade_graph: bool = False                # its decode graph is the one with cascade attention

    @property
    def kind(self) -> str:
        """How it runs, as the step stats count it (a verify step apart: " verify")."""
        if self.decode_graph_size is not None:
            how = "cascade_graph" if self.cascade_graph else "graph"
        else:
            how = "piecewise" if self.piecewise_size is not None else "eager"
        return how if self.spec is None else f"{how} verify"


@dataclass
class HostStep:
    """A step built on the host, none of its device work queued yet (ModelRunner.prepare_host):
    the worker builds the next step so while the step before waits for its grammar bitmask,
    and stages it (ModelRunner.stage) once that step is sampled. batch.device and
    batch.attention are filled by the staging."""
    batch: StepBatch
    token_starts: np.ndarray          # each request's first token row (a verify step in a decode graph: its rows)
    mm: list                          # multimodal spans whose encoder outputs become input embeddings
    cascade: int                      # the shared prefix its attention reads once (0: none)
    calibrate: bool                   # --calculate-kv-scales: this step sets the scales
    free_encoder_hashes: list[str]    # encoder outputs the scheduler frees after this step


class FeedIndices(NamedTuple):
    """Where a step's inputs are the previous step's sampled tokens (StepArrays' fields of the
    same names): graph_feed_rows for a decode graph after a step its head sampled, else the
    other two."""
    graph_feed_rows: np.ndarray | None = None
    fed_token_index: np.ndarray | None = None
    fed_from_rows: np.ndarray | None = None


def num_decodes(num_scheduled: np.ndarray) -> int:
    """How many of a step's sequences lead it with one query token each."""
    not_decode = num_scheduled != 1
    return int(np.argmax(not_decode)) if not_decode.any() else len(num_scheduled)


def decode_order(num_scheduled: np.ndarray, seq_lens: np.ndarray) -> np.ndarray | None:
    """The decodes' attention launch order, longest context first (a mixed batch's
    decodes lead it): with contexts of 100 to 2,000 tokens it takes a batch-128
    decode's attention from 182 to 147 us (Qwen3-0.6B; bench.tune_attention --mixed)."""
    decodes = num_decodes(num_scheduled)
    if decodes == 0:
        return None
    return np.argsort(-seq_lens[:decodes], kind="stable").astype(np.int32)


def host_inputs(batch: InputBatch, num_scheduled: np.ndarray, start: np.ndarray, slots: np.ndarray,
                block_size: int) -> HostInputs:
    """The step's inputs and attention metadata as host arrays, built without per-token loops
    (start: each request's computed tokens; slots: its persistent-batch row)."""
    query_start_loc = np.zeros(len(num_scheduled) + 1, dtype=np.int32)  # int32 metadata: no conversions on the device
    np.cumsum(num_scheduled, out=query_start_loc[1:])
    token_request = np.repeat(np.arange(len(num_scheduled)), num_scheduled)
    positions = np.arange(int(query_start_loc[-1])) - np.repeat(query_start_loc[:-1] - start, num_scheduled)
    token_slot = slots[token_request]
    blocks = batch.block_table[token_slot, positions // block_size]
    seq_lens = (start + num_scheduled).astype(np.int32)
    max_blocks = int(-(-seq_lens.max() // block_size))
    return StepArrays(input_ids=batch.token_ids[token_slot, positions], positions=positions,
                      slot_mapping=blocks.astype(np.int64) * block_size + positions % block_size,
                      query_start_loc=query_start_loc, seq_lens=seq_lens,
                      block_table=batch.block_table[slots, :max_blocks],
                      decode_order=decode_order(num_scheduled, seq_lens))


def attention_metadata(host: HostInputs, device: DeviceInputs, num_scheduled: np.ndarray,
                       backend: str) -> AttentionMetadata:
    """The eager forward's attention metadata (the host built its arrays as int32)."""
    return AttentionMetadata(
        query_start_loc=device.query_start_loc, seq_lens=device.seq_lens,
        block_table=device.block_table, slot_mapping=device.slot_mapping,
        max_query_len=int(num_scheduled.max()), max_seq_len=int(host.seq_lens.max()), backend=backend,
        num_decodes=num_decodes(num_scheduled), seq_order=device.decode_order)


def feed_indices(prev: PendingStep, states: list[CachedRequestState], start: np.ndarray,
                 query_start_loc: np.ndarray, decode_graph: bool) -> FeedIndices | None:
    """Where this step's inputs are prev's sampled tokens (still on the device): for a decode
    graph after a step its head sampled, each row's row in prev's tokens (-1: none; the graph
    reads them itself); else the token indices and prev's rows. None: no input is one."""
    src_row = {id(prev.states[i]): j for j, i in enumerate(prev.sample_rows)}
    dst, src = [], []
    for i, st in enumerate(states):
        j = src_row.get(id(st))
        if j is not None and start[i] == st.num_tokens:  # its first input is the token prev samples
            dst.append(int(query_start_loc[i]))
            src.append(j)
    if decode_graph and prev.graph_sampled:
        feed = np.full(len(states), -1, np.int64)
        feed[dst] = src  # one token per row: the token index is the row
        return FeedIndices(graph_feed_rows=feed)
    if not dst:
        return None
    return FeedIndices(fed_token_index=np.asarray(dst, np.int64), fed_from_rows=np.asarray(src, np.int64))
