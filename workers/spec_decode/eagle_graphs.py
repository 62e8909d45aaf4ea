"""DraftGraphs: an EAGLE head's k - 1 one-token draft steps as one CUDA graph per batch size.

The draft steps of a batch-1 step are ~25 small kernels each; replayed, the host launches one
graph for all of them. The graph reads static buffers: each request's first draft and the
head's hidden state there, its last accepted position, its block table (as wide as
max_model_len) and its room (slots past it are -1: nothing written); padding rows have no room.
Attention runs with the captured size's split-KV and max_model_len as its bound, as the decode
graphs' does. Sizes are the decode graphs' (workers/decode_graphs.py); a larger batch drafts
eagerly. On the CPU (LOOM_DECODE_GRAPHS_ON_CPU=1) the same work runs uncaptured, so the CPU
suite checks the static-buffer path; LOOM_EAGLE_DRAFT_GRAPHS=0 drafts eagerly (A/B)."""
from __future__ import annotations

import bisect
import logging
import time

import torch

from ipc import envs
from workers.decode_graphs import decode_batch_sizes

logger = logging.getLogger(__name__)


def enabled() -> bool:
    return envs.LOOM_EAGLE_DRAFT_GRAPHS


class DraftGraphs:
    def __init__(self, proposer, runner):
        from kernels.paged_attention import choose_num_kv_splits
        cfg = runner.config
        self.proposer, self.k = proposer, proposer.k
        self.capturing = runner.device.type == "cuda"
        self.sizes = decode_batch_sizes(min(cfg.max_num_seqs, 512), cfg.cuda_graph_sizes)
        max_bs, dev = self.sizes[-1], runner.device
        self.width = runner.max_blocks_per_req
        self.max_seq = min(cfg.max_model_len + self.k, self.width * cfg.block_size)
        hidden = proposer.head.config.hidden_size
        self.d = torch.zeros(max_bs, dtype=torch.long, device=dev)
        self.h = torch.zeros(max_bs, hidden, dtype=runner.dtype, device=dev)
        self.p0 = torch.zeros(max_bs, dtype=torch.long, device=dev)
        self.room = torch.zeros(max_bs, dtype=torch.long, device=dev)
        self.table = torch.zeros(max_bs, self.width, dtype=torch.int32, device=dev)
        self.out = torch.zeros(max_bs, max(self.k - 1, 1), dtype=torch.long, device=dev)
        kv_heads = proposer.kv_spec.num_kv_heads
        self.splits = {bs: choose_num_kv_splits(bs, kv_heads, 1, cfg.max_model_len, dev) for bs in self.sizes}
        self.graphs: dict[int, torch.cuda.CUDAGraph | None] = {}
        self._pool = None

    def _work(self, bs: int):
        def run():
            drafts = self.proposer.draft_steps(self.d[:bs], self.h[:bs], self.p0[:bs], self.table[:bs],
                                               self.room[:bs], self.width, self.max_seq, self.splits[bs])
            self.out[:bs].copy_(torch.stack(drafts, dim=1))
        return run

    @torch.inference_mode()
    def capture(self) -> None:
        t0 = time.perf_counter()
        for bs in reversed(self.sizes):   # the largest first: the others reuse its memory
            work = self._work(bs)
            work()   # (compiles the kernels outside the capture)
            if not self.capturing:
                self.graphs[bs] = None
                continue
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self._pool):
                work()
            self._pool = graph.pool()
            self.graphs[bs] = graph
        if self.capturing:
            torch.cuda.synchronize()
        logger.info("%s %d EAGLE draft graphs (%d steps, batch 1..%d) in %.1fs",
                    "captured" if self.capturing else "set up (uncaptured)", len(self.sizes), self.k - 1,
                    self.sizes[-1], time.perf_counter() - t0)

    def run(self, d: torch.Tensor, h: torch.Tensor, p0: torch.Tensor, table: torch.Tensor,
            room: torch.Tensor) -> list[torch.Tensor] | None:
        """The drafts d_2 .. d_k of n requests ([n] each), or None: no graph that large."""
        n = len(d)
        i = bisect.bisect_left(self.sizes, n)
        if i == len(self.sizes) or table.shape[1] > self.width:
            return None
        bs = self.sizes[i]
        self.d[:n].copy_(d)
        self.h[:n].copy_(h)
        self.p0[:n].copy_(p0)
        self.room[:n].copy_(room)
        self.table[:n, :table.shape[1]].copy_(table)
        if bs > n:   # padding rows: no room, so nothing written
            self.room[n:bs].zero_()
            self.p0[n:bs].zero_()
        graph = self.graphs[bs]
        if graph is None:
            self._work(bs)()
        else:
            graph.replay()
        return list(self.out[:n].clone().unbind(dim=1))
