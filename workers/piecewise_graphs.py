"""Piecewise CUDA graphs: every step that is not a pure decode (prefill, chunked prefill,
decodes mixed with a prompt chunk) replays the model's forward as CUDA graphs of the
pieces between its attention layers, and runs attention itself between the pieces
(attention's launch depends on the batch's layout; everything else depends only on
the token count).

Why: launched op by op, a forward costs the host 16-20 ms on Qwen3-0.6B (~400
launches of 15-50 us each), whatever its token count. In serving, a step in which one
prompt joins 31 decodes took 21 ms that way, and takes 8-9 ms replayed (bench/RESULTS.md,
2026-11-23 session 4). Replayed, the host launches one graph per layer and attention.

The token count is padded up to a captured size (at most an eighth more above 512
tokens). Padding tokens write no KV (slot -1) and their rows are dropped; attention
runs over the real tokens only, and the rows it leaves alone are never read by a real
token (every op between attentions works row by row).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from ipc import envs
from workers.attention import Attention, AttentionMetadata

MIN_TOKENS = 16  # below, a decode graph or the GEMV paths; a step this small is padded to it


def enabled() -> bool:
    """LOOM_PIECEWISE_GRAPHS=0 runs those steps eagerly (A/B measurements)."""
    return envs.LOOM_PIECEWISE_GRAPHS


def capture_sizes(max_tokens: int) -> list[int]:
    """Token counts to capture, up to max_tokens: doubling to 512, then eight per doubling
    (padding costs GEMM work in proportion, while a small step is launch-bound anyway).
    All are multiples of 16, so that Triton compiles no variant of a kernel per size."""
    max_tokens = -(-max(max_tokens, MIN_TOKENS) // 16) * 16
    sizes = [16, 32, 64, 128, 256, 384, 512]
    base = 512
    while base < max_tokens:
        sizes += [base + k * base // 8 for k in range(1, 9)]
        base *= 2
    return sorted({s for s in sizes if s < max_tokens} | {max_tokens})


@dataclass
class _Captured:
    pieces: list[torch.cuda.CUDAGraph]  # one more than the attention layers
    holes: list[tuple[Attention, tuple[torch.Tensor, torch.Tensor]]]  # each attention layer and its KV cache


class PiecewiseGraphs:
    """The captured sizes of one model, their input buffers, and the replay."""

    def __init__(self, model, kv_caches, max_tokens: int, query_heads: int, device: torch.device,
                 uses_mrope: bool, backend: str, dtype: torch.dtype):
        """query_heads: this rank's attention heads; dtype: the activations' (the model's, not an
        FP8 KV cache's)."""
        self.model, self.kv_caches, self.backend = model, kv_caches, backend
        self.sizes = capture_sizes(max_tokens)
        n = self.sizes[-1]
        self.input_ids = torch.zeros(n, dtype=torch.long, device=device)
        self.positions = torch.zeros((3, n) if uses_mrope else n, dtype=torch.long, device=device)
        self.slot_mapping = torch.full((n,), -1, dtype=torch.long, device=device)
        # what crosses from a piece to the eager code, at fixed addresses shared by every layer
        # and size: a tensor left in the graphs' pool would hold its memory for good
        key_cache = kv_caches[0][0]
        self.query = torch.empty((n, query_heads, key_cache.shape[-1]), dtype=dtype, device=device)
        self.attn_out = torch.zeros_like(self.query)  # attention writes it (the padding rows stay finite)
        self.hidden = torch.empty((n, model.config.hidden_size), dtype=dtype, device=device)
        self.captured: dict[int, _Captured] = {}
        self._pool = torch.cuda.graph_pool_handle()
        self._stream = torch.cuda.Stream(device)
        self._pieces: list[torch.cuda.CUDAGraph] = []
        self._holes: list[tuple[Attention, tuple[torch.Tensor, torch.Tensor]]] = []

    def size_for(self, num_tokens: int) -> int | None:
        """The captured size a step of num_tokens runs in; None: too large, run it eagerly."""
        i = int(np.searchsorted(self.sizes, num_tokens))
        return self.sizes[i] if i < len(self.sizes) else None

    # ------------------------------------------------------------ capture

    @torch.inference_mode()
    def capture(self) -> None:
        """Capture every size, the largest first (the others reuse its memory). An eager
        forward at the largest size first compiles the kernels and sets up cuBLAS on the
        capture stream; the kernels do not specialize on the (multiple-of-16) sizes, except
        the decode-sized linears (kernels/gemv.py: a variant per row bucket, and a split-K
        workspace), so every size up to layers.gemv_max_rows runs once eagerly too."""
        self._stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(self._stream):
            self.eager_forwards()
            for size in reversed(self.sizes):
                self._capture(size)
        torch.cuda.current_stream().wait_stream(self._stream)
        torch.cuda.synchronize()

    @torch.inference_mode()
    def eager_forwards(self) -> None:
        """The eager forwards before the capture (capture's docstring); also the dry run that
        compiles their kernels ahead (workers/compile_ahead.py)."""
        from workers.models import layers
        for size in [self.sizes[-1]] + [s for s in self.sizes[:-1] if s <= layers.gemv_max_rows]:
            self.model(*self._args(size, split=False))

    def _args(self, size: int, split: bool) -> tuple:
        """The model's inputs at `size` tokens: one prompt over the buffers (its attention,
        run only by the warm-up forward, reads cache block 0 and writes nothing)."""
        dev = self.input_ids.device
        blocks = -(-size // self.kv_caches[0][0].shape[1])
        meta = AttentionMetadata(
            torch.tensor([0, size], dtype=torch.int32, device=dev), torch.tensor([size], dtype=torch.int32, device=dev),
            torch.zeros((1, blocks), dtype=torch.int32, device=dev), self.slot_mapping[:size], size, size,
            self.backend, graph_split=self._split if split else None)
        return self.input_ids[:size], self.positions[..., :size], self.kv_caches, meta

    def _capture(self, size: int) -> None:
        args = self._args(size, split=True)  # its small tensors are made outside the capture
        self._pieces, self._holes = [], []
        self._begin_piece()
        self.hidden[:size].copy_(self.model(*args))
        self._pieces[-1].capture_end()
        self.captured[size] = _Captured(self._pieces, self._holes)
        self._pieces, self._holes = [], []

    def _begin_piece(self) -> None:
        graph = torch.cuda.CUDAGraph()
        graph.capture_begin(pool=self._pool)
        self._pieces.append(graph)

    def _split(self, attn: Attention, q: torch.Tensor, kv_cache) -> torch.Tensor:
        """In attention's place while capturing: end this piece, remember the hole, start the
        next piece, which reads attention's output from the shared buffer."""
        size = q.shape[0]
        self.query[:size].copy_(q)
        self._pieces[-1].capture_end()
        self._holes.append((attn, kv_cache))
        self._begin_piece()
        return self.attn_out[:size].flatten(1)

    # ------------------------------------------------------------ replay

    def run(self, size: int, input_ids: torch.Tensor, positions: torch.Tensor,
            meta: AttentionMetadata, cpu_tier=None) -> torch.Tensor:
        """The final hidden states [T, hidden] of a step of T <= size tokens. cpu_tier (the CPU KV
        tier, workers/kv_offload.py, when it copies this step): each piece waits for the copies of the
        layer whose keys and values it writes (the piece ends at that layer's attention), so the other
        layers' copies run under it."""
        t = input_ids.shape[0]
        self.input_ids[:t].copy_(input_ids, non_blocking=True)
        self.positions[..., :t].copy_(positions, non_blocking=True)
        self.slot_mapping[:t].copy_(meta.slot_mapping, non_blocking=True)
        self.slot_mapping[t:size].fill_(-1)  # the padding writes no KV
        cap = self.captured[size]
        query, out = self.query[:t], self.attn_out[:t]
        for piece, (attn, kv_cache) in zip(cap.pieces, cap.holes):
            if cpu_tier is not None:
                cpu_tier.wait_layer(kv_cache)
            piece.replay()
            attn(query, kv_cache, meta, out=out)
        if cpu_tier is not None:   # any layer no hole reached
            cpu_tier.wait_forward()
        cap.pieces[-1].replay()
        return self.hidden[:t]
