"""Decode CUDA graphs: a pure-decode step (one token per request) replayed whole.

A batch of B decodes runs in the graph of the smallest captured size >= B, or of a
larger one that replays faster (pick_graph_sizes); its padding rows write no KV
(slot -1) and are dropped.

Each size has two graphs:
- the model: the step's inputs -> hidden states. Its first kernel
  (kernels/decode_inputs.py) takes each row's input token from the previous step's
  sampled tokens where the host does not know it yet, and spreads the packed block
  table over the full-width table that attention reads.
- the head: lm_head and the plain sampler (greedy, temperature, min-p, and top-p without
  top-k) -> `tokens` (under tensor parallelism, a large batch samples from each rank's
  vocabulary shard, without top-p). A step whose rows all sample plainly replays both
  graphs. Rows that add repetition / presence / frequency penalties (and no other logits
  processing) replay the penalty head instead: lm_head, the penalties (kernels/penalties.py,
  reading the persistent batch's output counts and prompt mask), then the same sampler; it is
  captured at a size's first such step (on a side stream, no device sync), since that state
  exists only once a request has penalties. Any other step (top-k, logit_bias, min_tokens,
  logprobs) replays the model and samples eagerly.
- the grammar head (one GPU): the head with every row masked by its grammar bitmask row
  first (kernels/bitmask.py; -1: an unconstrained row). A structured-output step samples
  when the engine's bitmask comes, behind the model graph already replayed: it then costs
  two small copies and one replay, where the eager logits and sampler cost ~40 launches on
  the path every constrained step waits on (LOOM_GRAMMAR_GRAPH_HEAD=0: eagerly).

With --enable-lora each size's model graph is also captured without the LoRA ops (a step with
no adapter row replays it: none of the adapters' launches, and the base linears keep their fused
GEMV paths; LOOM_LORA_BASE_GRAPHS=0: every step replays the graph with them), and each head
over it too. A graph is picked by one key, (size, base, kind): `base` the model graph without
the LoRA ops, `kind` "model" or the head ("plain", "grammar", "penalty").

With cascade attention on (workers/cascade_attn.py), each size from CASCADE_GRAPH_MIN_ROWS up is
also captured with it (kind "cascade"): the model's step with every attention layer run as
prefix + suffix + merge (kernels/cascade_attention.py). The prefix's length travels in the
staging (`prefix_len`, int32: 0 in any other step), its blocks are row 0 of the graph's block
table, and its split counts are fixed per size, so one capture serves every shared prefix. It
writes its hidden states into the plain model graph's output, so the same heads sample either.

Why: at batch 1 the host's launch of a step, op by op, was longer than the device's
step (Qwen3-0.6B: 1.34 ms of host time against ~0.9 ms of device work; bench/RESULTS.md,
session 9). Here a step's inputs reach the device in one copy from a pinned buffer laid
out for the graph's size (StagingLayout), and the host launches two graphs (0.26-0.29 ms of
host time per step, 44 torch calls instead of 165).

On the CPU, LOOM_DECODE_GRAPHS_ON_CPU=1 runs the same work uncaptured (_Replay), so that
the CPU suite checks this path against eager steps.
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Literal, NamedTuple

import numpy as np
import torch

from ipc import envs
from ipc.config import EngineConfig
from kernels.bitmask import apply_bitmask
from workers.attention import AttentionMetadata
from workers.cascade_attn import CASCADE_GRAPH_MIN_ROWS, CascadePlanner
from workers.distributed import all_reduce_max, tp_size
from workers.host_to_device import Alternating
from workers.sampler import SamplingArrays, sample_plain
from workers.step_inputs import DeviceInputs, HostInputs

logger = logging.getLogger(__name__)

# The staged fields (name, dtype, value in padding rows: None = the row's index), [rows]
# each; positions are [3, rows] for M-RoPE. The block table follows them, packed
# [B, table_width]. Their names are StepArrays' (workers/step_inputs.py), the last seven
# the sampler's per-row parameters (SamplingArrays), which travel here too.
_FIELDS = (
    ("input_ids", np.int64, 0), ("positions", np.int64, 0), ("slot_mapping", np.int64, -1),
    ("graph_feed_rows", np.int64, -1), ("seq_lens", np.int32, 1), ("decode_order", np.int32, None),
    ("seeds", np.int64, 0), ("output_indices", np.int64, 0), ("slots", np.int64, 0),
    ("temperature", np.float32, 0.0), ("top_p", np.float32, 1.0), ("min_p", np.float32, 0.0), ("top_k", np.int32, 0),
    # the penalty head's (rows with repetition / presence / frequency penalties; off in padding rows)
    ("penalty_slots", np.int64, 0), ("repetition_penalty", np.float32, 1.0), ("presence_penalty", np.float32, 0.0),
    ("frequency_penalty", np.float32, 0.0),
)
_STEP_FIELDS = tuple(name for name, _, _ in _FIELDS[:6])
_SAMPLING_FIELDS = tuple(name for name, _, _ in _FIELDS[6:13])
_PENALTY_FIELDS = tuple(name for name, _, _ in _FIELDS[13:])
STAGED = frozenset(name for name, _, _ in _FIELDS) | {"block_table"}
SAMPLING_STAGED = frozenset(_SAMPLING_FIELDS + _PENALTY_FIELDS)   # (staged only when every row samples)
_TORCH = {np.int64: torch.int64, np.int32: torch.int32, np.float32: torch.float32}


def pick_graph_sizes(times: dict[int, float], margin: float = 0.05) -> list[int]:
    """For each batch size b (index; 0 unused) the captured graph size to run it in: the
    smallest size >= b, unless a larger one replays more than `margin` faster. (cuBLAS
    picks its kernels by shape: on an H200 some projections run slower at 1 row than at
    16, e.g. Qwen3-0.6B's o_proj 12.3 vs 5.2 us.)"""
    sizes = sorted(times)
    out = [sizes[0]]
    for b in range(1, sizes[-1] + 1):
        fits = [s for s in sizes if s >= b]
        best = fits[0]
        for s in fits[1:]:
            if times[s] < times[best] * (1 - margin):
                best = s
        out.append(best)
    return out


def decode_batch_sizes(limit: int, requested: list[int] | None = None) -> list[int]:
    """The batch sizes of the decode CUDA graphs, up to `limit`: 1, 2, 4, 8, 16, then every 32
    (13 sizes to 256, where every 16 took 20: each size is two captures and a timed replay at
    start-up; pick_graph_sizes may still run a batch in a larger, faster graph). requested
    (--cuda-graph-sizes, vLLM's): one value N, that pattern up to N; several, exactly those."""
    if requested and len(requested) > 1:
        return sorted({min(b, limit) for b in requested if b > 0})
    if requested:
        limit = min(limit, requested[0])
    return sorted({b for b in [1, 2, 4, 8, 16, *range(32, limit + 1, 32), limit] if b <= limit})


@dataclass
class StagingLayout:
    """Where each field of a size-`rows` step lies in the staging buffer (bytes, 16-aligned:
    a kernel sees the same pointer alignment every step)."""
    rows: int
    offsets: dict[str, tuple[int, np.dtype, tuple[int, ...]]]
    table_offset: int                      # the packed block table, int32, to the buffer's end

    @classmethod
    def build(cls, rows: int, mrope: bool) -> "StagingLayout":
        offsets, at = {}, 0
        for name, dtype, _ in _FIELDS:
            shape = (3, rows) if name == "positions" and mrope else (rows,)
            offsets[name] = (at, np.dtype(dtype), shape)
            at += -(-int(np.prod(shape)) * np.dtype(dtype).itemsize // 16) * 16
        offsets["prefix_len"] = (at, np.dtype(np.int32), (1,))   # a cascade step's shared prefix, in keys
        offsets["table_width"] = (at + 16, np.dtype(np.int32), (1,))
        return cls(rows, offsets, at + 32)

    def views(self, flat):
        """Views of a flat uint8 buffer (numpy or torch) as the fields; the packed table as
        flat int32 up to the buffer's end."""
        out = {}
        for name, (at, dtype, shape) in self.offsets.items():
            nbytes = int(np.prod(shape)) * dtype.itemsize
            chunk = flat[at:at + nbytes]
            out[name] = chunk.view(dtype).reshape(shape) if isinstance(flat, np.ndarray) else \
                chunk.view(_TORCH[dtype.type]).view(shape)
        table = flat[self.table_offset:]
        out["block_table"] = table.view(np.int32) if isinstance(flat, np.ndarray) else table.view(torch.int32)
        return out


Kind = Literal["model", "cascade", "plain", "grammar", "penalty"]


class Staged(NamedTuple):
    rows: int      # the step's B
    nbytes: int    # the bytes of the staging buffer to copy


def _staged_value(host: HostInputs | None, i: int, name: str) -> np.ndarray | None:
    if host is None:
        return None
    return getattr(host, name) if i < len(_STEP_FIELDS) else getattr(host.sampling, name, None)


def write_staged(views: dict[str, np.ndarray], layout: StagingLayout, host: HostInputs | None,
                 prefix_len: int = 0, sampling: bool = True) -> Staged:
    """Write a step's fields into a staging buffer's views (layout.views of it): B rows from
    `host` (a field it lacks takes its padding value; None: idle inputs, all padding rows),
    padding rows past B, the block table [B, width] packed, and a cascade step's prefix length
    (keys; 0: none). sampling=False: the sampling parameters are not one per row (a row in its
    prompt samples nothing) and are left as padding (the eager sampler gets them uploaded)."""
    bs = layout.rows
    table = np.zeros((0, 1), np.int32) if host is None else host.block_table
    rows, width = table.shape
    for i, (name, _, pad) in enumerate(_FIELDS):
        v = views[name]
        value = _staged_value(host, i, name) if sampling or i < len(_STEP_FIELDS) else None
        real = rows if value is not None else 0  # a field the host lacks: padding values in every row
        if real:
            v[..., :real] = value
        v[..., real:] = np.arange(real, bs) if pad is None else pad
    views["table_width"][0] = width
    views["prefix_len"][0] = prefix_len
    packed = views["block_table"][:bs * width].reshape(bs, width)
    packed[:rows] = table
    packed[rows:] = 0
    return Staged(rows, layout.table_offset + 4 * bs * width)


class _Replay:
    """A captured CUDA graph and the static output its replays rewrite. Uncaptured (the CPU,
    LOOM_DECODE_GRAPHS_ON_CPU=1) the same work runs as it is at each replay, so that the CPU
    suite checks the decode graphs' staging, input kernel and head against the eager steps."""

    def __init__(self, fn, capture: bool, pool=None):
        self.fn, self.graph, self.output = fn, None, None
        if capture:
            self.graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(self.graph, pool=pool):
                self.output = fn()

    def replay(self) -> None:
        if self.graph is not None:
            self.graph.replay()
        else:
            self.output = self.fn()


class DecodeGraphs:
    """The captured sizes of one model, their staging and static buffers, and the replays."""

    def __init__(self, model, kv_caches, config: EngineConfig, device: torch.device, backend: str, kv_splits,
                 lora_ctx=None, cascade: CascadePlanner | None = None):
        """backend: the attention backend (CUDA graphs are captured for "triton" only; the CPU
        runs the graphs' work uncaptured). kv_splits(num_seqs) -> the split-KV count of a decode
        batch of that many sequences. lora_ctx: the LoRAContext with --enable-lora (each size
        is then also captured without the LoRA ops, for steps with no adapter row, unless
        LOOM_LORA_BASE_GRAPHS=0). cascade: the runner's planner, with cascade attention on (the
        sizes from CASCADE_GRAPH_MIN_ROWS up are then also captured with it)."""
        self.model, self.kv_caches, self.device, self.kv_splits = model, kv_caches, device, kv_splits
        self.lora_ctx = lora_ctx if lora_ctx is not None and envs.LOOM_LORA_BASE_GRAPHS else None
        self._bases = (False, True) if self.lora_ctx is not None else (False,)   # the model graphs of a size
        self.backend, self.capturing = backend, device.type == "cuda"
        self.max_model_len = config.max_model_len
        uses_mrope = bool(getattr(model, "uses_mrope", False))
        # a verify step runs as a decode batch of one row per token (workers/spec_decode/verify_graph.py)
        spec = config.speculative
        rows_per_seq = 1 + (spec.num_speculative_tokens if spec is not None else 0)
        self.sizes = decode_batch_sizes(min(config.max_num_seqs * rows_per_seq, 512), config.cuda_graph_sizes)
        max_bs = self.sizes[-1]   # larger decode batches run eagerly (size_for)
        max_blocks = -(-config.max_model_len // config.block_size)
        self.graph_for: list[int] = []   # batch size -> the captured size that runs it
        self.cascade = cascade
        self.cascade_sizes = [bs for bs in self.sizes if bs >= CASCADE_GRAPH_MIN_ROWS] if cascade is not None else []
        self.layouts = {bs: StagingLayout.build(bs, uses_mrope) for bs in self.sizes}
        capacity = self.layouts[max_bs].table_offset + 4 * max_bs * max_blocks
        self._dev = torch.zeros(capacity, dtype=torch.uint8, device=device)
        self._host = [torch.zeros(capacity, dtype=torch.uint8, pin_memory=self.capturing) for _ in range(2)]
        self._turns = Alternating(device)
        # (size, B) -> the step's and the sampler's staged fields, cut to B rows
        self._rows: dict[tuple[int, int], tuple[dict, dict]] = {}
        self._dev_views = {bs: lay.views(self._dev) for bs, lay in self.layouts.items()}
        self._host_views = [{bs: lay.views(h.numpy()) for bs, lay in self.layouts.items()}
                            for h in self._host]
        self.ids = torch.zeros(max_bs, dtype=torch.int64, device=device)          # the model's input tokens
        self.table = torch.zeros((max_bs, max_blocks), dtype=torch.int32, device=device)
        self.tokens = torch.zeros(max_bs, dtype=torch.int64, device=device)       # the head graphs' samples
        self._query_start_loc = torch.arange(max_bs + 1, dtype=torch.int32, device=device)  # one token per row
        # (size, base, kind) -> the graph: a model graph's output is its hidden states; a head
        # samples the output of the model graph of its size and base, into `tokens`
        self.graphs: dict[tuple[int, bool, Kind], _Replay] = {}
        self._base_replayed: dict[int, bool] = {}   # size -> whether its last model replay was the base one
        # the grammar heads' inputs: each row's bitmask row (-1: unconstrained) in `mask`, which
        # holds the step's distinct bitmask rows (set_grammar); one GPU only (whole-vocabulary logits)
        self.grammar_heads = envs.LOOM_GRAMMAR_GRAPH_HEAD and tp_size() <= 1
        if self.grammar_heads:
            self.mask_words = -(-model.config.vocab_size // 32)
            self.mask = torch.zeros((max_bs, self.mask_words), dtype=torch.int32, device=device)
            self.mask_rows = torch.full((max_bs,), -1, dtype=torch.int32, device=device)
            self._all_rows = torch.arange(max_bs, dtype=torch.int32, device=device)
        # the penalty heads (penalties, then the plain sampler; one GPU only), captured at a size's
        # first step with penalty rows (the penalty state exists from the first request with penalties on)
        self.penalty_heads = envs.LOOM_PENALTY_HEAD_GRAPHS and tp_size() <= 1
        self._penalty_state: tuple[torch.Tensor, torch.Tensor] | None = None
        self._pool = None

    # ------------------------------------------------------------ per step

    def size_for(self, num_reqs: int) -> int | None:
        return self.graph_for[num_reqs] if 0 < num_reqs < len(self.graph_for) else None

    def has_cascade(self, bs: int) -> bool:
        """Whether the size-bs graphs include one captured with cascade attention."""
        return (bs, False, "cascade") in self.graphs

    def stage(self, bs: int, host: HostInputs | None, device: DeviceInputs | None = None, prefix_len: int = 0,
              sampling: bool = True) -> None:
        """Write a step's staged fields (host arrays of B rows; the block table [B, width]; a
        cascade step's prefix length) for the size-bs graph, padding rows past B (host None: idle
        inputs, all padding), and copy them to the device in one transfer. Sets the device views of
        the row fields (not the table), cut to B rows, on `device` (the step's other fields,
        uploaded apart; sampling=False: the sampling parameters too, write_staged's)."""
        parity = self._turns.turn()
        rows, nbytes = write_staged(self._host_views[parity][bs], self.layouts[bs], host, prefix_len, sampling)
        self._dev[:nbytes].copy_(self._host[parity][:nbytes], non_blocking=True)
        self._turns.copied()
        if device is None:
            return
        if (bs, rows) not in self._rows:  # slicing 13 views anew cost ~25 us of every step
            dev = self._dev_views[bs]
            self._rows[bs, rows] = ({name: dev[name][..., :rows] for name in _STEP_FIELDS},
                                    {name: dev[name][..., :rows] for name in _SAMPLING_FIELDS},
                                    {name: dev[name][..., :rows] for name in _PENALTY_FIELDS})
        step_fields, sampling_fields, penalty_fields = self._rows[bs, rows]
        vars(device).update(step_fields)   # (the fields by name: StepArrays' and SamplingArrays')
        if not sampling:
            return
        vars(device.sampling).update(sampling_fields)
        if host is not None and host.sampling.penalty_slots is not None:   # (else they stay None: no adjustment)
            vars(device.sampling).update(penalty_fields)

    def run_model(self, bs: int, rows: int, cascade: bool = False) -> torch.Tensor:
        """Replay the size-bs model graph (cascade: the one with cascade attention, over the
        staged prefix length); the hidden states of the step's rows."""
        # (the step's adapter rows were set before: LoRAContext.active is this step's)
        base = self.lora_ctx is not None and not self.lora_ctx.active
        self._base_replayed[bs] = base   # (its head may sample later: a grammar step's, when the bitmask comes)
        graph = self.graphs[bs, base, "cascade" if cascade else "model"]
        graph.replay()
        return graph.output[:rows]

    def run_head(self, bs: int, rows: int, *, grammar: bool = False,
                 penalty_state: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        """Sample the model graph's hidden states just replayed: the tokens, on the device
        (grammar: each row masked as set_grammar set it). With penalty_state (the persistent
        batch's output counts and prompt mask), the rows' penalties first (penalty_head_samples:
        no other adjustment). The head is the one over the model graph run_model replayed."""
        base = self._base_replayed.get(bs, False)
        if penalty_state is None:
            self.graphs[bs, base, "grammar" if grammar else "plain"].replay()
            return self.tokens[:rows]
        if self._penalty_state is None or any(a is not b for a, b in zip(penalty_state, self._penalty_state)):
            # (captured on these tensors, which the batch allocates once)
            self.graphs = {key: g for key, g in self.graphs.items() if key[2] != "penalty"}
            self._penalty_state = penalty_state
        key = (bs, base, "penalty")
        if key not in self.graphs:
            self.graphs[key] = self._capture_mid_run(self._head(bs, base, penalty_state=penalty_state))
        else:
            self.graphs[key].replay()
        return self.tokens[:rows]

    def set_grammar(self, bs: int, distinct: torch.Tensor, mask_rows: torch.Tensor) -> None:
        """The next grammar head's masks: distinct [D, words] bitmask rows (D <= bs) and each of
        the bs rows' index into them (-1: unconstrained), both on the device."""
        words = min(distinct.shape[1], self.mask_words)
        self.mask[:distinct.shape[0], :words].copy_(distinct[:, :words])
        if words < self.mask_words:   # tokens past the engine's vocabulary: never allowed
            self.mask[:distinct.shape[0], words:].zero_()
        self.mask_rows[:bs].copy_(mask_rows)

    # ------------------------------------------------------------ capture

    @torch.inference_mode()
    def capture(self) -> None:
        t0 = time.perf_counter()
        for bs in reversed(self.sizes):  # the largest first: the others reuse its memory
            self._capture_model(bs, bs)
        # every rank must run a batch in the same graph size (their all-reduces pair up): they
        # pick from the slowest rank's times
        times = all_reduce_max([self._time(bs) if self.capturing else 1.0 for bs in self.sizes], self.device)
        self.graph_for = pick_graph_sizes(dict(zip(self.sizes, times)))
        # a graph that now also runs smaller batches splits the KV as for the smallest of them
        # (split-KV is chosen per graph: a padded batch-1 step keeps its long-context speed)
        for g in self.sizes:
            smallest = next((b for b in range(1, len(self.graph_for)) if self.graph_for[b] == g), g)
            if self.kv_splits(smallest) != self.kv_splits(g):
                self._capture_model(g, smallest)
        for bs in reversed(self.cascade_sizes):   # (after the model graphs whose output they write)
            self._capture_cascade(bs)
        for bs in reversed(self.sizes):
            for base in self._bases:
                self._capture_head(bs, base)
                if self.grammar_heads:
                    self._capture_head(bs, base, grammar=True)
            if self.penalty_heads:   # its kernels now (its graph: at the size's first penalty step)
                self._head(bs, self._bases[0], penalty_state=self._stand_in_state())()
        padded = {b: g for b, g in enumerate(self.graph_for) if b and g != next(s for s in self.sizes if s >= b)}
        logger.info("%s %d decode graphs (batch 1..%d; %d with cascade attention too) in %.1fs; run in a larger "
                    "graph because it is faster: %s", "captured" if self.capturing else "set up (uncaptured, on the CPU)",
                    len(self.sizes), self.sizes[-1], len(self.cascade_sizes), time.perf_counter() - t0,
                    padded or "none")

    @torch.inference_mode()
    def run_once(self) -> None:
        """Every size's model (each base variant) and head work once, eagerly, on idle inputs
        (what capture runs before capturing each): the dry run that compiles capture's kernels
        ahead of it (workers/compile_ahead.py)."""
        for bs, base in ((bs, base) for bs in reversed(self.sizes) for base in self._bases):
            self.stage(bs, None)
            if bs in self.cascade_sizes:
                self._lora_set(self._model_step(bs, bs, cascade=True), base)()
            hidden = self._lora_set(self._model_step(bs, bs), base)()
            logits = self.model.compute_logits(hidden, plain=True)
            self._head_tokens(logits, bs, grammar=self.grammar_heads)   # (the grammar head's mask kernel too)
            if self.penalty_heads:   # its float32 logits take the sampler's other variants
                self._head_tokens(logits, bs, penalty_state=self._stand_in_state())

    def _model_step(self, bs: int, split_for: int, cascade: bool = False):
        """The model graph's work: the input kernel, then the forward on the static buffers
        (cascade: every attention layer as cascade, over the staged prefix length)."""
        from kernels.decode_inputs import decode_inputs
        v = self._dev_views[bs]
        meta = AttentionMetadata(self._query_start_loc[:bs + 1], v["seq_lens"], self.table[:bs], v["slot_mapping"],
                                 1, self.max_model_len, self.backend, num_decodes=bs,
                                 num_kv_splits=self.kv_splits(split_for), seq_order=v["decode_order"])
        if cascade:
            meta.cascade = self.cascade.graph_prefix(bs, v["prefix_len"], self.table, self.max_model_len)

        def step():
            meta.sdpa_plan = None  # the CPU attention's per-step layout (never set under a capture)
            decode_inputs(v["input_ids"], v["graph_feed_rows"], self.tokens, v["block_table"], v["table_width"],
                          self.ids[:bs], self.table[:bs])
            return self.model(self.ids[:bs], v["positions"], self.kv_caches, meta)
        return step

    def _capture_model(self, bs: int, split_for: int) -> None:
        """Capture the batch-bs model graphs (with the LoRA ops, and without them: base), their
        KV split as for a batch of split_for."""
        step = self._model_step(bs, split_for)
        for base in self._bases:
            self.stage(bs, None)  # idle inputs: all padding rows
            self.graphs[bs, base, "model"] = self._capture(self._lora_set(step, base))

    def _capture_cascade(self, bs: int) -> None:
        """Capture the batch-bs model graphs with cascade attention (each base variant). Each
        writes its hidden states into the plain model graph's output (looked up at each run:
        uncaptured on the CPU, that graph's output is a new tensor per replay), which the heads
        sample from."""
        step = self._model_step(bs, bs, cascade=True)
        for base in self._bases:
            def run(base=base):
                return self.graphs[bs, base, "model"].output.copy_(step())
            self.stage(bs, None)
            self.graphs[bs, base, "cascade"] = self._capture(self._lora_set(run, base))

    def _capture_head(self, bs: int, base: bool, grammar: bool = False) -> None:
        self.stage(bs, None)
        self.graphs[bs, base, "grammar" if grammar else "plain"] = self._capture(self._head(bs, base, grammar))

    def _head(self, bs: int, base: bool, grammar: bool = False,
              penalty_state: tuple[torch.Tensor, torch.Tensor] | None = None):
        """A head's work over the (bs, base) model graph's output: lm_head; the grammar bitmask
        (grammar), or the rows' repetition / presence / frequency penalties (penalty_state, the
        persistent batch's output counts and prompt mask; kernels/penalties.py, float32 logits,
        as the eager sampler's); then the plain sampler."""
        def head():
            logits = self.model.compute_logits(self.graphs[bs, base, "model"].output, plain=True)
            self.tokens[:bs].copy_(self._head_tokens(logits, bs, grammar, penalty_state))
        return head

    def _head_tokens(self, logits: torch.Tensor, bs: int, grammar: bool = False,
                     penalty_state: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        """A head's sampling of its logits (bs rows): masked by the grammar bitmask, or adjusted
        by the penalties, then drawn as the eager sampler draws (the Triton kernels with the
        Triton backend)."""
        from kernels.penalties import apply_penalties
        v = self._dev_views[bs]
        params = SamplingArrays(**{name: v[name] for name in _SAMPLING_FIELDS})
        if grammar:
            apply_bitmask(logits, self.mask, self._all_rows[:bs], self.mask_rows[:bs])
        if penalty_state is not None:
            none_ids = torch.full((bs, 0), -1, dtype=torch.int32, device=self.device)   # (no logit_bias, bad words)
            none_values = torch.zeros((bs, 0), dtype=torch.float32, device=self.device)
            logits = apply_penalties(logits, v["penalty_slots"], *penalty_state, v["repetition_penalty"],
                                     v["presence_penalty"], v["frequency_penalty"], none_ids, none_values, none_ids)
        return sample_plain(logits, params, use_triton=self.backend == "triton")

    def _stand_in_state(self) -> tuple[torch.Tensor, torch.Tensor]:
        """A one-slot all-zero penalty state (output counts, prompt mask) of the batch's dtypes and
        row width, for the penalty head's kernels before any request has penalties (the padding
        rows' slot 0: no penalty)."""
        shape = (1, self.model.config.vocab_size)
        return (torch.zeros(shape, dtype=torch.int32, device=self.device),
                torch.zeros(shape, dtype=torch.uint8, device=self.device))

    def _lora_set(self, fn, base: bool):
        """fn run without the LoRA ops (base) or with them: what its capture holds (uncaptured on
        the CPU, each replay runs it so, as the captured graph would). Without lora_ctx, fn."""
        ctx = self.lora_ctx
        if ctx is None:
            return fn

        def run():
            was, ctx.active = ctx.active, not base
            try:
                return fn()
            finally:
                ctx.active = was
        return run

    def _capture_mid_run(self, fn) -> _Replay:
        """Run fn once (this step's work; it compiles any kernel first), then capture it on a side
        stream into the graphs' pool, without torch.cuda.graph's device sync, gc.collect and cache
        flush, which would stall a running engine at each size's first such step."""
        fn()
        replay = _Replay(fn, False)
        if not self.capturing:
            return replay
        graph, stream = torch.cuda.CUDAGraph(), torch.cuda.Stream(self.device)
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            graph.capture_begin(pool=self._pool)
            try:
                fn()
            finally:
                graph.capture_end()
        torch.cuda.current_stream().wait_stream(stream)
        replay.graph, self._pool = graph, graph.pool()
        return replay

    def _capture(self, fn) -> _Replay:
        """Run fn once (on CUDA: compiles its kernels outside the capture), then capture it."""
        out = fn()
        if not self.capturing:
            replay = _Replay(fn, False)
            replay.output = out
            return replay
        torch.cuda.synchronize()
        replay = _Replay(fn, True, self._pool)
        self._pool = replay.graph.pool()
        torch.cuda.synchronize()
        return replay

    def _time(self, bs: int) -> float:
        """Seconds per replay of the batch-bs model graph, on idle inputs (padding rows: no
        cache writes, one key of context each), so the time is that of its matmul shapes (the
        graph with the LoRA ops, where there are two)."""
        graph = self.graphs[bs, False, "model"]
        self.stage(bs, None)
        graph.replay()
        rounds = []
        for _ in range(3):  # the median of three rounds: one slow round does not decide
            start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(5):
                graph.replay()
            stop.record()
            stop.synchronize()
            rounds.append(start.elapsed_time(stop) / 5e3)
        return sorted(rounds)[1]
