"""Cascade attention's per-step decision: the common prefix of the step's block tables, and
whether reading it once for the whole step pays (kernels/cascade_attention.py runs it).

As vLLM V1: one common prefix for the whole batch (its scheduler's num_common_prefix_blocks,
here read off the step's block tables: the prefix cache gives requests that share a prompt
prefix the same physical blocks), at most every request's computed tokens, whole blocks; and
`use_cascade_attention`'s gates (a prefix of 256 keys or more, 8 requests or more) before a
cost model. Ours compares bytes and FLOPs per layer: without cascade every decode reads the
prefix's KV (B x P x bytes per key); with it the prefix is read once, but the decodes' FLOPs
against it run on tensor cores at prefill efficiency, plus two more launches (a prompt chunk's
FLOPs are the same either way).

Where a cascade step runs (workers/model_runner.py):
- pure decodes: in the decode CUDA graph of its size captured with cascade (graph_prefix: the
  prefix's length is a staged device int and its blocks row 0 of the graph's block table, so one
  capture serves every prefix; the split counts fixed per size). Those graphs exist from
  CASCADE_GRAPH_MIN_ROWS rows on; a smaller decode step keeps the plain decode graph, whose
  whole step at that size costs less than an eager attention step's host work.
  (vLLM runs cascade steps under piecewise graphs only: at 512 rows its eager attention
  between the pieces cost ~40 ms of host time per step here, more than cascade saves.)
- a step with prompt chunks: in the piecewise CUDA graphs, attention eager between the pieces
  (prefix: its length and split counts from the step's host ints).
"""
from __future__ import annotations

import numpy as np
import torch

from ipc import envs
from ipc.config import EngineConfig
from kernels.cascade_attention import CascadePrefix, choose_prefix_splits, choose_suffix_splits
from workers.attention import Attention

MIN_COMMON_PREFIX_TOKENS = 256   # vLLM's: a shorter prefix is not worth it
MIN_REQUESTS = 8                 # vLLM's: nor are fewer requests
HBM_BYTES_PER_S = 4.8e12         # H200
PREFIX_FLOPS_PER_S = 2.5e14      # the prefix launch's tensor-core rate (prefill tiles, a fraction of the peak)
EXTRA_LAUNCH_S = 10e-6           # the prefix launch and the merge, per layer
CASCADE_GRAPH_MIN_ROWS = 64      # the smallest decode graph captured with cascade too


def common_prefix_blocks(block_table: np.ndarray) -> int:
    """How many leading columns every row of block_table [B, blocks] has equal to row 0's
    (columns past a row's own blocks may match too: the caller caps by its computed tokens).
    Cheap where nothing is shared: the first column decides most batches."""
    if block_table.shape[0] < 2 or block_table.shape[1] == 0 or not (block_table[:, 0] == block_table[0, 0]).all():
        return 0
    same = (block_table == block_table[0]).all(axis=0)
    return int(same.size if same.all() else np.argmin(same))


def use_cascade_attention(prefix_len: int, query_lens: np.ndarray, num_q_heads: int, num_kv_heads: int,
                          head_dim: int, kv_elem_bytes: int) -> bool:
    """Whether one layer's attention over the prefix is faster as cascade (the own keys cost the
    same either way). Plain: each decode reads the prefix's KV (bytes-bound), each prompt
    chunk's queries multiply against it (FLOP-bound, as in cascade). Cascade: the prefix read
    once, every query's FLOPs in one launch, and two more launches."""
    num_reqs = len(query_lens)
    if prefix_len < MIN_COMMON_PREFIX_TOKENS or num_reqs < MIN_REQUESTS:
        return False
    key_bytes = 2 * num_kv_heads * head_dim * kv_elem_bytes
    flops_per_query = 4 * num_q_heads * prefix_len * head_dim
    decodes = int((query_lens == 1).sum())
    chunk_queries = int(query_lens.sum()) - decodes
    plain = decodes * prefix_len * key_bytes / HBM_BYTES_PER_S + chunk_queries * flops_per_query / PREFIX_FLOPS_PER_S
    cascade = max(prefix_len * key_bytes / HBM_BYTES_PER_S,
                  (decodes + chunk_queries) * flops_per_query / PREFIX_FLOPS_PER_S) + EXTRA_LAUNCH_S
    return cascade < plain


class CascadePlanner:
    """Decides, per step, whether its attention runs as cascade, and builds the CascadePrefix."""

    def __init__(self, model: torch.nn.Module, config: EngineConfig, kv_dtype: torch.dtype, block_size: int):
        layers = [m for m in model.modules() if isinstance(m, Attention)]
        # a layer with a window or sinks runs the plain path: with none left, never plan
        eligible = [m for m in layers if m.sliding_window is None and m.sinks is None]
        mode = str(envs.LOOM_CASCADE_ATTN).lower()
        self.mode = "off" if config.disable_cascade_attn or mode in ("0", "off", "false", "no") or not eligible \
            else ("force" if mode == "force" else "auto")
        self.block_size = block_size
        if eligible:
            self.num_q_heads, self.num_kv_heads = eligible[0].num_heads, eligible[0].num_kv_heads
            self.head_dim = eligible[0].head_dim
        self.kv_elem_bytes = torch.tensor([], dtype=kv_dtype).element_size()
        self.beside = envs.LOOM_CASCADE_BESIDE   # the prefix launch on a side stream (CascadePrefix.beside)

    @classmethod
    def build(cls, model: torch.nn.Module, config: EngineConfig, kv_dtype: torch.dtype, block_size: int,
              backend: str) -> "CascadePlanner | None":
        """None where cascade never runs: the torch backend, or switched off."""
        if backend != "triton":
            return None
        planner = cls(model, config, kv_dtype, block_size)
        return None if planner.mode == "off" else planner

    def prefix_len(self, block_table: np.ndarray, computed_before: np.ndarray, num_scheduled: np.ndarray) -> int:
        """The step's common prefix in keys when cascade pays for it, else 0. block_table: the
        step's [B, blocks] host table; computed_before: each request's tokens before the step
        (every query sits at or after them, so each sees the whole prefix)."""
        if len(num_scheduled) < 2:
            return 0
        blocks = common_prefix_blocks(block_table)
        if blocks == 0:
            return 0
        length = min(blocks, int(computed_before.min()) // self.block_size) * self.block_size
        if length == 0:
            return 0
        if self.mode == "force":
            return length
        pays = use_cascade_attention(length, num_scheduled, self.num_q_heads, self.num_kv_heads, self.head_dim,
                                     self.kv_elem_bytes)
        return length if pays else 0

    def prefix(self, length: int, query_start_loc: torch.Tensor, block_table: torch.Tensor,
               num_scheduled: np.ndarray, max_seq_len: int) -> CascadePrefix:
        """The step's CascadePrefix over its device inputs, for an eager (piecewise) step (no host
        sync: the prefix launch's query_start_loc is [0, T] gathered on the device, its length a
        fill), its split counts for this step's shape."""
        device = block_table.device
        num_tokens, max_query_len = int(num_scheduled.sum()), int(num_scheduled.max())
        return CascadePrefix(
            query_start_loc[::len(num_scheduled)].contiguous(), torch.full((1,), length, dtype=torch.int32, device=device),
            block_table[:1, :length // self.block_size],
            choose_prefix_splits(num_tokens, self.num_q_heads // self.num_kv_heads, self.num_kv_heads, length, device),
            choose_suffix_splits(len(num_scheduled), self.num_kv_heads, max_query_len, max_seq_len - length, device),
            self.beside)

    def graph_prefix(self, rows: int, length: torch.Tensor, block_table: torch.Tensor,
                     max_model_len: int) -> CascadePrefix:
        """The CascadePrefix a decode graph of `rows` decodes captures: length (int32 [1]) is the
        graph's staged prefix length, block_table its static table (row 0, a real request in any
        cascade step, holds the shared blocks). Its split counts are fixed here, for a prefix and own
        keys as long as the context allows: more prefix splits than a short prefix needs leave
        some empty (a program that reads no key), and the suffix splits as a plain decode graph
        of this size would (1 from 64 rows of 8 KV heads up)."""
        device = block_table.device
        return CascadePrefix(
            torch.tensor([0, rows], dtype=torch.int32, device=device), length, block_table[:1],
            choose_prefix_splits(rows, self.num_q_heads // self.num_kv_heads, self.num_kv_heads, max_model_len, device),
            choose_suffix_splits(rows, self.num_kv_heads, 1, max_model_len, device), self.beside)
