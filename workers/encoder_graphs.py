"""Encoder CUDA graphs: an encoder tower whose every input has one fixed shape (Whisper's: 128
mel bins x 3,000 frames, every clip padded to the 30 s window) replayed whole for small batches.

Why: Whisper-large-v3's encoder is ~650 torch calls (32 layers) whatever the batch. A step that
encodes one or a few clips launches them while the device, which runs them in ~6 ms per clip,
waits (H200, issue 52: a lone clip's encoder step took 28 ms of device time, against 6 ms per
clip at batch 64). A batch of up to the largest captured size (ENCODER_GRAPH_SIZES) is copied
into the graphs' static input, padded to the next captured size (the padding rows hold earlier
clips' features or zeros: clips do not interact in the encoder), replayed, and its outputs copied
out (the encoder cache keeps them past the next replay). Larger batches run eagerly: their
device time hides the launches.

On the CPU, LOOM_DECODE_GRAPHS_ON_CPU=1 runs the same work uncaptured (padded to the size), so
that the CPU suite checks the padding and slicing against the eager encoder.
"""
from __future__ import annotations

import bisect
import logging
import time
from typing import Callable

import torch

logger = logging.getLogger(__name__)

ENCODER_GRAPH_SIZES = (1, 2, 4, 8)


class EncoderGraphs:
    def __init__(self, tower: Callable[[torch.Tensor], torch.Tensor], item_shape: tuple[int, ...],
                 dtype: torch.dtype, device: torch.device, capture: bool, sizes=ENCODER_GRAPH_SIZES):
        """tower: [n, *item_shape] -> [n, ...] (each item's output its own). capture: CUDA graphs
        (else the same work runs uncaptured at each call)."""
        self.tower, self.sizes, self.capture = tower, sorted(sizes), capture
        self.inputs = torch.zeros((self.sizes[-1], *item_shape), dtype=dtype, device=device)
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        if capture:
            t0 = time.perf_counter()
            pool = None
            for n in reversed(self.sizes):   # the largest first: the smaller ones fit in its pool
                pool = self._capture(n, pool)
            logger.info("captured encoder CUDA graphs of %s items in %.2fs", self.sizes, time.perf_counter() - t0)

    @torch.inference_mode()
    def _capture(self, n: int, pool):
        x = self.inputs[:n]
        side = torch.cuda.Stream()   # warm (kernel choices, cuBLAS workspace) off the capture, as torch advises
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            self.tower(x)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=pool):
            out = self.tower(x)
        self.graphs[n] = (graph, out)
        return graph.pool()

    def size_for(self, n: int) -> int | None:
        i = bisect.bisect_left(self.sizes, n)
        return self.sizes[i] if i < len(self.sizes) else None

    def __call__(self, feats: torch.Tensor) -> torch.Tensor:
        """The tower's output for feats [n, *item_shape] (in the inputs' dtype): replayed where a
        size holds n, else eagerly."""
        n = feats.shape[0]
        size = self.size_for(n)
        if size is None:
            return self.tower(feats)
        self.inputs[:n].copy_(feats)
        if self.capture:
            graph, out = self.graphs[size]
            graph.replay()
        else:
            out = self.tower(self.inputs[:size])
        return out[:n].clone()   # (the static output is the next replay's)
