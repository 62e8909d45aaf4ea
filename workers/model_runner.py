"""ModelRunner: owns the model, the persistent batch and the CUDA graphs, and runs one step:
prepare -> forward -> sample -> copy_back, then finish.

The KV cache and the device memory (sizing, sleep, wake-up) belong to KVCacheMemory
(workers/kv_cache_memory.py); warm-up and graph capture are workers/warmup.py; the step's
inputs are the typed structures of workers/step_inputs.py."""
from __future__ import annotations

import bisect
import logging
import time
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np
import torch

from ipc import envs
from ipc.compile_cache import compiled_kernels, use_compile_cache
from ipc.config import EngineConfig
from ipc.messages import GrammarOutput, ModelRunnerOutput, SchedulerOutput
from ipc.profiling import step_stats_enabled
from ipc.startup import StartupTimes
from kernels.kv_quant import check_device as check_kv_cache_device, kv_cache_torch_dtype
from workers import compile_ahead
from workers.cascade_attn import CascadePlanner
from workers.decode_graphs import SAMPLING_STAGED, STAGED, DecodeGraphs, decode_batch_sizes
from workers.distributed import tp_size
from workers.host_to_device import HostToDevice, map_arrays
from workers.input_batch import CachedRequestState, InputBatch
from workers.kv_cache_memory import KVCacheMemory, KVCacheSpec
from workers.logprobs import (PromptLogprobSpans, pack_logprobs, pack_prompt_logprobs, pack_spec_logprobs,
                              prompt_logprob_rows, prompt_logprob_spans, prompt_logprobs)
from workers.mm_inputs import MultimodalInputs
from workers.piecewise_graphs import PiecewiseGraphs
from workers.rejection_sampler import bonus_padded, verify_samples
from workers.sampler import SampledTokens, Sampler, SamplingRow, TopLogprobs
from workers.spec_decode import make_proposer, may_speculate
from workers.spec_decode.verify_graph import MAX_VERIFY_GRAPH_CONTEXT, is_pure_verify, rows_as_decodes
from workers.spec_decode.verify_layout import SpecLayout, spec_layout
from workers.spec_decode.verify_sampling import first_landings, per_token_params
from workers.step_inputs import (DeviceInputs, HostInputs, HostStep, StepBatch, attention_metadata, feed_indices,
                                 host_inputs)
from workers.step_stats import StepMark, StepStats
from workers.warmup import capture_graphs, warm_up

logger = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "float": torch.float32, "bfloat16": torch.bfloat16,
           "float16": torch.float16, "half": torch.float16}

# A decode graph's step uploads the fields its staging does not carry; it has its own query_start_loc.
_NOT_UPLOADED_WITH_DECODE_GRAPH = STAGED | {"query_start_loc"}


def resolve_device(config: EngineConfig, rank: int = 0) -> torch.device:
    if config.device == "auto":
        return torch.device(f"cuda:{rank}") if torch.cuda.is_available() else torch.device("cpu")
    if config.device == "cuda":
        return torch.device(f"cuda:{rank}")
    return torch.device(config.device)


def resolve_dtype(config: EngineConfig, device: torch.device) -> torch.dtype:
    if config.dtype == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return _DTYPES[config.dtype]


class DeferredSample(NamedTuple):
    """A launched step's forward, waiting for its grammar bitmask to sample."""
    batch: StepBatch
    logits: torch.Tensor | None


@dataclass
class PendingStep:
    """A step launched on the device whose sampled tokens are not yet on the CPU."""
    req_ids: list[str]
    states: list[CachedRequestState]
    sample_rows: np.ndarray
    tokens: torch.Tensor | None = None        # on the device
    tokens_host: torch.Tensor | None = None   # pinned copy, valid once `event` has fired
    event: object = None
    topk: TopLogprobs | None = None           # logprob tensors; pinned host copies after copy_back()
    prompt_logprobs: PromptLogprobSpans | None = None
    stats_mark: StepMark | None = None        # StepStats bookkeeping (LOOM_STEP_STATS=1)
    unsampled: DeferredSample | None = None   # while its sampling waits for a bitmask
    failed: dict | None = None                # req_id -> error: requests that failed alone in this step
    refused: dict | None = None               # ... for their own inputs: no token left, an unreadable image
    masked: torch.Tensor | None = None        # bool per sampled row: no token was left to sample (a pinned copy after copy_back)
    graph_sampled: bool = False               # tokens is the decode graphs' `tokens` (the next step's graph reads it)
    spec: SpecLayout | None = None            # a verify step's drafts (speculative decoding)
    num_accepted: torch.Tensor | None = None  # its accepted drafts per sampled request (pinned after copy_back)
    pooled: torch.Tensor | None = None        # --runner pooling: a vector per sample row (a pinned copy after copy_back)
    spec_drafts: torch.Tensor | None = None   # EAGLE: the next step's drafts per sampled request (pinned after copy_back)
    placed: dict[str, int] | None = None      # LOOM_SPEC_ASYNC: req id -> the drafts placed in its spec_draft_slots


class ModelRunner:
    def __init__(self, config: EngineConfig, rank: int = 0):
        from workers.model_loader import kv_cache_shape, load_model
        self.startup = StartupTimes(f"worker {rank}")
        self.startup.since_process_start("imports")
        use_compile_cache()   # before any kernel compiles: kept across runs (ipc/compile_cache.py)
        self.config = config
        self.device = resolve_device(config, rank)
        if self.device.type == "cuda":
            from workers import device_init
            with self.startup.phase("CUDA init"):   # started in a thread during the imports (transformers imported meanwhile)
                device_init.wait()
                torch.cuda.set_device(self.device)
                torch.empty(1, device=self.device)   # (the context, where no thread created it)
        compile_ahead.note_start(config, self.device)   # a start seen before: no dry runs (kernels cached)
        self.dtype = resolve_dtype(config, self.device)
        backend = config.attention_backend
        self.backend = ("triton" if self.device.type == "cuda" else "torch") if backend == "auto" else backend
        torch.manual_seed(config.seed)
        t0 = time.perf_counter()
        self.model = load_model(config.model, self.dtype, self.device, config.load_format,
                               config.language_model_only, config.model_impl, config.quantization, config,
                               startup=self.startup)   # its phases: config, model built, weights filled
        from workers.models.layers import use_kernels
        use_kernels(self.backend)
        logger.info("loaded %s in %.2fs (%s, %s)", config.model, time.perf_counter() - t0, self.device, self.dtype)
        t0 = time.perf_counter()   # the runner's state, below: a phase of its own (pinned buffers, sampler)
        self.kv_spec = KVCacheSpec(*kv_cache_shape(self.model), config.block_size,
                                   kv_cache_torch_dtype(config.kv_cache_dtype, self.dtype))
        check_kv_cache_device(self.kv_spec.dtype, self.device)
        self.cpu_tier = None   # workers/kv_offload.py HostKVTier, with --kv-offloading-size
        self.memory = KVCacheMemory(self.model, config, self.device, self.kv_spec, self.backend, self.dtype)
        # --calculate-kv-scales with an FP8 cache: the first step with tokens sets every layer's scales
        self.kv_scales_pending = config.calculate_kv_scales and config.kv_cache_dtype != "auto"
        self.sampler = Sampler(use_triton=self.backend == "triton")
        self.h2d = HostToDevice(self.device)
        self.block_size = config.block_size
        self.max_blocks_per_req = -(-config.max_model_len // self.block_size)
        self.batch = InputBatch(config.max_num_seqs, config.max_model_len, self.max_blocks_per_req,
                                self.model.config.vocab_size, self.device)
        # cascade attention for steps whose requests share a prefix's blocks (None: never)
        self.cascade = CascadePlanner.build(self.model, config, self.kv_spec.dtype, self.block_size, self.backend)
        self.decode_graphs: DecodeGraphs | None = None        # pure-decode steps' graphs
        self.piecewise_graphs: PiecewiseGraphs | None = None  # the other steps' graphs
        # the row counts the lm_head runs at on CUDA: the decode graphs' batch sizes (_padded_rows)
        rows_per_seq = 1 + (config.speculative.num_speculative_tokens if config.speculative is not None else 0)
        self.logit_row_counts = decode_batch_sizes(config.max_num_seqs * rows_per_seq)   # (a verify step: k + 1 each)
        self.stats = StepStats(self.device) if step_stats_enabled() else None
        # every worker of every engine reads the API servers' stores as a reader of its own
        self.mm = MultimodalInputs(self.model, config.data_parallel_rank * config.tensor_parallel_size + rank)
        self.uses_mrope = self.mm.uses_mrope
        from workers.cross_kv import make_cross_kv   # an encoder-decoder's cross-attention K/V (Whisper)
        self.cross_kv = make_cross_kv(self.model, config.max_num_seqs, config.block_size, self.dtype, self.device)
        self.spec_config = config.speculative
        self.proposer = make_proposer(config, self)   # None: speculation off
        # req id -> the drafts proposed after the last step that sampled for it, until a step with
        # spec_draft_slots places them (LOOM_SPEC_ASYNC: the scheduler never sees them)
        self.drafts: dict[str, list[int]] = {}
        self.pooler = None   # --runner pooling: finished prompts are pooled, never sampled (workers/pooler.py)
        if config.runner == "pooling":
            from ipc.pooling import PoolerConfig
            from workers.pooler import Pooler
            self.pooler = Pooler(PoolerConfig.from_dict(config.pooler_config), config.max_num_seqs,
                                 self.model.config.hidden_size, self.device)
        self.lora = None   # --enable-lora: the adapters' slots and per-token index (workers/lora/manager.py)
        if config.enable_lora:
            from workers.lora.manager import LoRAManager
            self.lora = LoRAManager(self.model, config, self.device, self.dtype, self.backend)
        self.startup.mark("runner state", t0)

    # ------------------------------------------------------------ memory (KVCacheMemory), warm-up, graphs

    @property
    def kv_caches(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        return self.memory.kv_caches

    @property
    def weights_dir(self) -> str:
        """Where sleep level 2 reloads the weights from (update_weights_from_disk moves it)."""
        return self.memory.weights_dir

    @weights_dir.setter
    def weights_dir(self, path: str) -> None:
        self.memory.weights_dir = path

    def determine_num_blocks(self) -> int:
        with self.startup.phase("profiling run"):
            n = self.memory.determine_num_blocks()
        draft_spec = getattr(self.proposer, "kv_spec", None)   # a draft model's KV cache shares the budget
        if draft_spec is not None and self.config.num_gpu_blocks_override is None:
            n = n * self.kv_spec.block_bytes() // (self.kv_spec.block_bytes() + draft_spec.block_bytes())
        return n

    def kv_sliding_window(self) -> int | None:
        """The window of every attention layer, when they share one: the engine core may trim
        each request's KV blocks to it (--sliding-window-kv-trim)."""
        from workers.attention import model_sliding_window
        return model_sliding_window(self.model)

    def initialize_cache(self, num_blocks: int) -> None:
        """Allocate the KV cache; with the weights awake, warm up and capture the graphs."""
        with self.startup.phase("KV cache"):
            self.memory.allocate(num_blocks)
            if hasattr(self.proposer, "allocate"):
                self.proposer.allocate(num_blocks, self.device)
        if not self.memory.weights_asleep:
            kernels = compiled_kernels()
            with self.startup.phase("warm-up"):
                warm_up(self)
            if kernels is not None:   # Triton's compiles (0 on a restart: the cache is kept)
                self.startup.phases[-1] = (f"warm-up ({compiled_kernels() - kernels} kernels compiled)",
                                           self.startup.phases[-1][1])
            with self.startup.phase("graph capture"):
                self._capture_graphs()
            compile_ahead.mark_started()
            self.startup.log(logger)
            if self.stats is not None and not self.stats.serving:
                self.stats.start_serving()

    def _capture_graphs(self) -> None:
        self.decode_graphs = self.piecewise_graphs = None  # the old graphs' memory goes first
        self._drop_encoder_graphs()
        if self.lora is not None:   # the graphs record the LoRA ops (a base step's index is all -1)
            self.lora.ctx.active = True
        self.decode_graphs, self.piecewise_graphs = capture_graphs(self)
        if self.decode_graphs is not None and hasattr(self.proposer, "capture"):   # EAGLE's draft steps
            self.proposer.capture(self)

    def kv_splits(self, num_seqs: int) -> int:
        """The split-KV count of a decode batch of num_seqs sequences (the decode graphs')."""
        from kernels.paged_attention import choose_num_kv_splits
        return choose_num_kv_splits(num_seqs, self.kv_spec.num_kv_heads, 1, self.config.max_model_len, self.device)

    def sleep(self, level: int) -> None:
        """Level 1: weights to CPU memory, KV cache freed. Level 2: both discarded."""
        if not self.memory.weights_asleep:
            self.decode_graphs, self.piecewise_graphs = None, None  # they point at the freed memory; recaptured on wake-up
            self._drop_encoder_graphs()
        self.memory.sleep(level)

    def _drop_encoder_graphs(self) -> None:
        if getattr(self.model, "encoder_graphs", None) is not None:   # (workers/encoder_graphs.py: Whisper's)
            self.model.encoder_graphs = None

    def wake_up(self, tags: list[str], weights_dir: str | None = None, load_format: str | None = None) -> int:
        """The parts in `tags` back; level-2 weights are loaded from `weights_dir` (default: the
        checkpoint last loaded), which then becomes the one to reload. The tensors loaded."""
        loaded = 0
        if "weights" in tags:
            loaded = self.memory.wake_weights(weights_dir, load_format)
            if self.kv_caches:
                self._capture_graphs()
        if "kv_cache" in tags:
            self.initialize_cache(self.memory.num_blocks)
        return loaded

    def memory_info(self) -> dict:
        return self.memory.memory_info()

    # ------------------------------------------------------------ one step

    @torch.inference_mode()
    def launch(self, so: SchedulerOutput, prev: PendingStep | None = None,
               host_step: HostStep | None = None) -> PendingStep:
        """Queue one step on the device without waiting for it: prepare, forward, sample,
        copy back (finish() waits). Decode inputs that are tokens of `prev` (still in
        flight) are taken from prev's device tensor. host_step: so's host part, built ahead
        (prepare_ahead)."""
        if host_step is not None:
            self._lap(host_step.batch.stats_token, "held")
            batch = self.stage(host_step, prev)
        else:
            if so.kv_transfers is not None:   # the CPU KV tier's copies, before anything of this step
                self.cpu_tier.apply(so.kv_transfers, self.kv_caches)
            batch = self.prepare(so, prev)
        if batch is None:
            if self.cpu_tier is not None:   # copies and no forward: the next step's waits layer by layer
                self.cpu_tier.wait_forward()   # cover only its own copies
            return PendingStep(list(so.req_ids), [], np.zeros(0, np.int64), refused=self.mm.take_refused())
        step = PendingStep(list(so.req_ids), batch.states, batch.sample_rows, refused=self.mm.take_refused())
        if so.spec_draft_slots:
            step.placed = {rid: len(so.scheduled_spec_decode_tokens.get(rid, ())) for rid in so.spec_draft_slots}
        self._lap(batch.stats_token, "prepare")
        if self.cpu_tier is not None and batch.piecewise_size is None:   # (piecewise: waited layer by layer)
            self.cpu_tier.wait_forward()   # the tier's copies (this step's or earlier) run on their own streams
        hidden, logits = self.forward(batch)
        self._lap(batch.stats_token, "forward")
        if self.pooler is not None:   # every step: mean pooling sums the mid-prompt chunks too
            step.pooled = self.pooler(self.model, hidden, batch)
        elif len(batch.sample_rows) and so.defer_sample:
            if batch.decode_graph_size is not None and not batch.grammar_head:
                # its parameters lie in the graphs' staging, which the next step rewrites (the grammar
                # head reads them there: the worker samples this step before it launches the next)
                batch.device = map_arrays(batch.device, torch.clone)
            step.unsampled = DeferredSample(batch, logits)   # sample_deferred() samples it once the bitmask comes
        elif batch.spec is not None:
            self._verify_into(step, logits, batch, so.grammar)
        elif len(batch.sample_rows):
            self._sample_into(step, logits, batch, so.grammar)
        step.prompt_logprobs = prompt_logprobs(self.model, batch, hidden)
        if getattr(self.proposer, "on_device", False):   # EAGLE: the head's pass and drafts, queued behind the step
            self.proposer.on_sampled(self, step, batch, hidden)
        if step.unsampled is None:
            self.copy_back(step)
        for st, computed in zip(batch.states, batch.computed_after):
            st.num_computed_tokens = int(computed)
        if batch.stats_token is not None:
            self.stats.lap(batch.stats_token, "sample")  # with prompt logprobs and the copy back
            # a step that ran the encoder counts apart: its host time holds the encoder's launch
            kind = batch.kind + ("+encoder" if so.scheduled_encoder_inputs else "")
            step.stats_mark = self.stats.end(batch.stats_token, kind, int(batch.num_scheduled.sum()))
        return step

    def _lap(self, token, phase: str) -> None:
        if token is not None:
            self.stats.lap(token, phase)

    def prepare(self, so: SchedulerOutput, prev: PendingStep | None) -> StepBatch | None:
        """Apply the step's diff and build its inputs and metadata on the host, then on the
        device (a decode graph's staging, else one copy per dtype); None when nothing is
        scheduled."""
        host_step = self.prepare_host(so)
        return None if host_step is None else self.stage(host_step, prev)

    def can_prepare_ahead(self, unsampled: PendingStep, so: SchedulerOutput) -> bool:
        """Whether so's host inputs may be built while `unsampled` (launched, its sample waiting
        for a grammar bitmask) is not yet sampled: so queues no device work before its staging
        (no encoder, cross K/V, KV tier copies, LoRA slots, drafts or multimodal items; its new
        requests' penalty rows wait for the staging: InputBatch.write_rows), and no drafter runs
        after `unsampled`'s sample on the batch that so's diff changes."""
        deferred = unsampled.unsampled
        return (bool(so.req_ids) and deferred is not None and deferred.batch.spec is None and self.proposer is None
                and self.cross_kv is None and self.lora is None and not self.kv_scales_pending
                and so.kv_transfers is None and not so.scheduled_encoder_inputs
                and not so.scheduled_spec_decode_tokens and not so.spec_draft_slots
                and not any(r.mm_items for r in so.new_requests))

    def prepare_ahead(self, so: SchedulerOutput) -> HostStep:
        """so's host part while the step before waits for its bitmask (can_prepare_ahead)."""
        host_step = self.prepare_host(so)
        self._lap(host_step.batch.stats_token, "prepare")
        return host_step

    def prepare_host(self, so: SchedulerOutput) -> HostStep | None:
        """prepare()'s host part: the diff applied and the inputs built on the host (and, for a
        step that runs an encoder, its encoder and cross K/V); None when nothing is scheduled."""
        self._apply_diff(so)
        self._place_drafts(so)
        for rid, drafts in so.scheduled_spec_decode_tokens.items():   # the drafts are the inputs after the last token
            st = self.batch.requests[rid]
            self.batch.token_ids[st.slot, st.num_tokens:st.num_tokens + len(drafts)] = drafts
        if self.lora is not None:
            self.lora.prepare_step(so)
        if not so.req_ids:
            self.mm.free(so.free_encoder_hashes)
            return None
        stats_token = self.stats.begin() if self.stats is not None else None
        states = [self.batch.requests[rid] for rid in so.req_ids]
        num_scheduled = np.asarray(so.num_scheduled_tokens, dtype=np.int64)
        start = np.fromiter((s.num_computed_tokens for s in states), dtype=np.int64, count=len(states))
        slots = np.fromiter((s.slot for s in states), dtype=np.int64, count=len(states))
        end = start + num_scheduled
        num_tokens = np.fromiter((s.num_tokens for s in states), dtype=np.int64, count=len(states))
        sample_rows = np.nonzero(end >= num_tokens)[0]  # the others are mid-prompt
        spec = None
        if so.scheduled_spec_decode_tokens:   # a verify step: k + 1 logits rows per request with k drafts
            spec = spec_layout(so.req_ids, sample_rows, end, np.concatenate(([0], np.cumsum(num_scheduled))),
                               so.scheduled_spec_decode_tokens)
        per_request = spec is not None and envs.LOOM_SPEC_FAST_HOST   # (workers/spec_decode/verify_sampling.py)
        if spec is None:
            rows = [self._sampling_row(states[i], int(end[i])) for i in sample_rows]
        elif per_request:   # each request's row at its first draft position, expanded below
            rows = [self._sampling_row(states[i], p) for i, p in zip(sample_rows.tolist(),
                                                                     first_landings(spec).tolist())]
        else:   # one row per draft and one more, each drawing the token at its landing position
            rows = self._verify_rows(states, sample_rows, spec)
        if so.scheduled_encoder_inputs:
            # (LOOM_STEP_STATS: the encoder's and the cross K/V's host time are phases of their own;
            # "prepare" sums the rest, its laps before and after them)
            self._lap(stats_token, "prepare")
            self._run_encoders(so, stats_token)
            self._lap(stats_token, "encoder")
        host = host_inputs(self.batch, num_scheduled, start, slots, self.block_size)
        mm = self.mm.spans(states, start, num_scheduled, host.query_start_loc) if self.mm.enabled else []
        if self.cross_kv is not None:   # the encoder output fills cross-attention K/V, never input embeddings
            from workers.cross_kv import fill_scheduled
            self._lap(stats_token, "prepare")
            fill_scheduled(self.cross_kv, self.model, self.mm, states, slots, start, end)
            mm = []
            self._lap(stats_token, "cross_kv")
        calibrate = self.kv_scales_pending   # (--calculate-kv-scales: this step sets the scales, eagerly)
        cascade = 0 if self.cascade is None else self.cascade.prefix_len(host.block_table, start, num_scheduled)
        graph_size = None if calibrate else self._decode_graph_size(num_scheduled, bool(mm))
        # a pure-decode cascade step replays its size's cascade graph; below CASCADE_GRAPH_MIN_ROWS, the
        # plain one (cascade dropped); a step with prompt chunks runs piecewise, attention eager
        cascade_graph = bool(cascade) and graph_size is not None and self.decode_graphs.has_cascade(graph_size)
        if graph_size is not None and not cascade_graph:
            cascade = 0
        token_starts = host.query_start_loc   # (a verify step in a decode graph: its tokens' rows)
        if spec is not None and not calibrate and not cascade and not mm and (graph_size := self._verify_graph_size(
                num_scheduled, spec, sample_rows, int(end.max()))) is not None:
            host = rows_as_decodes(host, num_scheduled, start)
        every_row_samples = len(sample_rows) == len(num_scheduled)
        # whether the sampled rows all sample plainly, asked only where it matters (it walks every
        # row): a decode graph's head samples such a step, and under TP its logits may stay sharded
        plain = (((graph_size is not None and every_row_samples) or tp_size() > 1)
                 and (spec is None or graph_size is not None) and self._samples_plainly(so, rows))
        graph_samples = graph_size is not None and every_row_samples and plain
        # a structured-output step whose rows otherwise sample plainly: the grammar head samples it
        grammar_head = (not graph_samples and graph_size is not None and every_row_samples and spec is None
                        and self._samples_in_grammar_head(so, rows))
        # rows with penalties (and nothing else to adjust): the decode graphs' penalty head
        graph_penalties = (not graph_samples and not grammar_head and graph_size is not None and every_row_samples
                           and spec is None and self._penalty_head_samples(so, rows))
        graph_samples |= grammar_head or graph_penalties
        if self.uses_mrope:
            host.positions = self.batch.mrope_positions(states, host.positions, token_starts)
        if spec is not None and not graph_samples:
            host.sample_index = self._padded_rows(spec.token_rows)
        elif not graph_samples:
            host.sample_index = self._padded_rows(host.query_start_loc[1:][sample_rows] - 1)
        if per_request and graph_samples:   # the graph's head reads the plain fields only
            host.sampling = per_token_params(self.sampler.host_params(rows), spec)
        else:
            if per_request:
                rows = self._verify_rows(states, sample_rows, spec)
            host.sampling = self.sampler.host_params(rows)
        spans = prompt_logprob_spans(states, start, num_scheduled)
        if (logprob_rows := prompt_logprob_rows(spans, states, token_starts, self.batch.token_ids)):
            host.prompt_logprob_rows, host.prompt_logprob_targets = logprob_rows
        batch = StepBatch(states, num_scheduled, start, end, sample_rows, rows, host, None, None, graph_size,
                          stats_token, None, None, graph_samples, plain, spans, spec, grammar_head,
                          graph_penalties, cascade_graph)
        return HostStep(batch, token_starts, mm, cascade, calibrate, so.free_encoder_hashes)

    def stage(self, host_step: HostStep, prev: PendingStep | None) -> StepBatch:
        """prepare()'s device part: the inputs that are prev's tokens (sampled by now) located, the
        host inputs uploaded, and the attention metadata built."""
        self.batch.write_rows()   # (after the step before has sampled: it records into their slots)
        batch, token_starts, cascade = host_step.batch, host_step.token_starts, host_step.cascade
        host, num_scheduled, graph_size = batch.host, batch.num_scheduled, batch.decode_graph_size
        if prev is not None and prev.tokens is not None:
            if (feed := feed_indices(prev, batch.states, batch.computed_before, token_starts, graph_size is not None)):
                host.graph_feed_rows, host.fed_token_index, host.fed_from_rows = feed
                if batch.spec is not None and feed.graph_feed_rows is not None:   # per token row, not per request
                    host.graph_feed_rows = np.full(len(host.seq_lens), -1, np.int64)
                    host.graph_feed_rows[token_starts[:-1]] = feed.graph_feed_rows
        if batch.stats_token is not None:
            self.stats.device_start(batch.stats_token)
        batch.device = device = self._upload(host, graph_size, cascade)
        if device.fed_token_index is not None:  # decode inputs that are prev's tokens come straight from the device
            device.input_ids.index_copy_(0, device.fed_token_index, prev.tokens.index_select(0, device.fed_from_rows))
        batch.attention = attention = (attention_metadata(host, device, num_scheduled, self.backend)
                                       if graph_size is None else None)
        if host_step.mm:
            batch.inputs_embeds = self.mm.embeddings(host_step.mm, device.input_ids)
        self.mm.free(host_step.free_encoder_hashes)   # after this step's use: the scheduler frees as it advances
        if host_step.calibrate:
            attention.calculate_kv_scales, self.kv_scales_pending = True, False
        if cascade and not batch.cascade_graph:   # (a piecewise or eager step: its attention runs between the pieces)
            attention.cascade = self.cascade.prefix(cascade, device.query_start_loc, device.block_table,
                                                    num_scheduled, attention.max_seq_len)
        if (graph_size is None and batch.inputs_embeds is None and self.piecewise_graphs is not None
                and not host_step.calibrate):
            batch.piecewise_size = self.piecewise_graphs.size_for(int(num_scheduled.sum()))
        return batch

    def _apply_diff(self, so: SchedulerOutput) -> None:
        for rid in so.finished_req_ids:
            self.batch.remove(rid)
            self.drafts.pop(rid, None)
        for r in so.new_requests:
            self.batch.add(r.req_id, r.prompt_token_ids, r.output_token_ids, r.block_ids,
                           r.num_computed_tokens, r.sampling_params, r.seed, r.eos_token_ids,
                           r.shared_from, r.shared_len)
            if r.mm_items:
                st = self.batch.requests[r.req_id]
                self.mm.add_request(st, r, self.batch.prompt(st))
        self.mm.release(so.released_mm)
        c = so.cached_requests
        for rid, blocks, num_computed in zip(c.req_ids, c.new_block_ids, c.num_computed_tokens):
            if blocks:
                self.batch.append_blocks(rid, blocks)
            self.batch.requests[rid].num_computed_tokens = num_computed

    def _place_drafts(self, so: SchedulerOutput) -> None:
        """LOOM_SPEC_ASYNC: the requests of so.spec_draft_slots were scheduled before the step
        before came back, as if it accepted all its drafts. That step is finished here
        (must_finish_before), so each starts at its last token as this worker knows it and
        verifies the drafts proposed after it (self.drafts), as many as it has slots for. so's
        token counts and drafts are rewritten to match: the rest of the step reads them as if the
        scheduler had known (the scheduler learns the counts from the output's spec_num_drafts)."""
        if not so.spec_draft_slots:
            return
        index = {rid: i for i, rid in enumerate(so.req_ids)}
        spec = dict(so.scheduled_spec_decode_tokens)
        for rid, slots in so.spec_draft_slots.items():
            st = self.batch.requests[rid]
            st.num_computed_tokens = st.num_tokens - 1
            drafts = self.drafts.pop(rid, [])[:slots]
            so.num_scheduled_tokens[index[rid]] = 1 + len(drafts)
            if drafts:
                spec[rid] = drafts
        so.scheduled_spec_decode_tokens = spec

    def _run_encoders(self, so: SchedulerOutput, step_token) -> None:
        encoder_token = self.stats.begin() if self.stats is not None else None
        self.mm.run_encoders(self.batch.requests, so)
        if encoder_token is not None:  # the encoder's share of step time (LOOM_STEP_STATS=1)
            images = sum(map(len, so.scheduled_encoder_inputs.values()))
            # read with the step, after the step before it (step_stats.StepToken.inner)
            step_token.inner.append(self.stats.end(encoder_token, "encoder", images))

    def _upload(self, host: HostInputs, graph_size: int | None, cascade: int = 0) -> DeviceInputs:
        """The step's host arrays on the device: one copy per dtype, except for a decode graph,
        which reads its staging (the rest, if any, goes in one copy per dtype; cascade: the
        prefix length its cascade graph reads)."""
        if graph_size is None:
            return self.h2d.upload(host)
        # a row in its prompt (Whisper's, fed a token per step) samples nothing: then the sampled
        # rows' parameters are fewer than the rows and go up apart, for the eager sampler
        every_row = len(host.sampling.temperature) == len(host.block_table)
        device = self.h2d.upload(host, skip=_NOT_UPLOADED_WITH_DECODE_GRAPH if every_row
                                 else _NOT_UPLOADED_WITH_DECODE_GRAPH - SAMPLING_STAGED)
        self.decode_graphs.stage(graph_size, host, device, cascade, sampling=every_row)
        return device

    def _verify_rows(self, states: list[CachedRequestState], sample_rows: np.ndarray, spec: SpecLayout
                     ) -> list[SamplingRow]:
        """A verify step's rows: one per draft and one more, each drawing the token at its landing."""
        return [self._sampling_row(states[sample_rows[j]], p) for j, p in zip(spec.request.tolist(),
                                                                             spec.landing.tolist())]

    def _sampling_row(self, st: CachedRequestState, position: int) -> SamplingRow:
        # the token drawn lands at `position`: its output index is fixed whatever the schedule
        return SamplingRow(st.params, st.seed, position - st.num_prompt_tokens, st.slot, st.eos_token_ids,
                           st.bad_words)

    def _decode_graph_size(self, num_scheduled: np.ndarray, has_mm: bool) -> int | None:
        """The decode graph size that runs the step (pure decodes, no image placeholder). Its head
        samples the step when every row samples, plainly: then there is no eager lm_head or
        sampler at all."""
        if self.decode_graphs is None or has_mm or self.pooler is not None or not (num_scheduled == 1).all():
            return None
        return self.decode_graphs.size_for(len(num_scheduled))

    def _verify_graph_size(self, num_scheduled: np.ndarray, spec: SpecLayout, sample_rows: np.ndarray,
                           max_context: int) -> int | None:
        """The decode graph size that runs a verify step with one row per token
        (workers/spec_decode/verify_graph.py): every token a logits row, no prompt chunk in the
        step, contexts up to MAX_VERIFY_GRAPH_CONTEXT, and a captured size that large
        (LOOM_SPEC_FULL_GRAPH=0: never, for A/B runs)."""
        if (self.decode_graphs is None or self.pooler is not None or not envs.LOOM_SPEC_FULL_GRAPH
                or max_context > MAX_VERIFY_GRAPH_CONTEXT
                or not is_pure_verify(num_scheduled, len(spec.token_rows), sample_rows)):
            return None
        return self.decode_graphs.size_for(len(spec.token_rows))

    def _samples_plainly(self, so: SchedulerOutput, rows: list[SamplingRow]) -> bool:
        """No top-k, penalties, logprobs or grammar among the sampled rows (Sampler.plain), nor
        top-p under tensor parallelism (the plain rows' logits may be a vocabulary shard there)."""
        return (not so.defer_sample and not (so.grammar is not None and len(so.grammar.rows))
                and self.sampler.plain(rows, self.model.config.vocab_size, top_p=tp_size() == 1))

    def _samples_in_grammar_head(self, so: SchedulerOutput, rows: list[SamplingRow]) -> bool:
        """A grammar constrains some row (now or once the bitmask comes) and the rows sample
        plainly otherwise (workers/decode_graphs.py: the grammar head)."""
        return (self.decode_graphs.grammar_heads
                and (so.defer_sample or (so.grammar is not None and len(so.grammar.rows) > 0))
                and self.sampler.plain(rows, self.model.config.vocab_size, top_p=True))
    def _penalty_head_samples(self, so: SchedulerOutput, rows: list[SamplingRow]) -> bool:
        """Rows as _samples_plainly's but for penalties on some (Sampler.penalties_only), the logits
        whole (one rank), LOOM_PENALTY_HEAD_GRAPHS on: the decode graphs' penalty head samples them."""
        return (self.decode_graphs.penalty_heads and self.batch.penalty_state() is not None
                and not so.defer_sample
                and not (so.grammar is not None and len(so.grammar.rows))
                and self.sampler.penalties_only(rows, self.model.config.vocab_size))

    def _padded_rows(self, index: np.ndarray) -> np.ndarray:
        """The sampled rows' hidden-state index, padded (with row 0) to one of
        logit_row_counts. cuBLAS's first call at a new shape costs 2-3 ms of host time, and up
        to 1.5 s where it loads a new kernel family (bench/RESULTS.md): a shrinking offline batch
        met ~200 new shapes mid-run. The warm-up runs the lm_head at every padded count."""
        if self.device.type != "cuda" or not len(index):
            return index
        sizes = self.logit_row_counts
        i = bisect.bisect_left(sizes, len(index))
        return np.pad(index, (0, sizes[i] - len(index))) if i < len(sizes) else index

    def forward(self, batch: StepBatch) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The model (or its CUDA graph): hidden states, and the logits of the sampled rows
        (None when none samples, or when the decode graph's head samples them)."""
        device, attention = batch.device, batch.attention
        if batch.cascade_graph:
            hidden = self.decode_graphs.run_model(batch.decode_graph_size, len(batch.host.seq_lens), cascade=True)
        elif batch.decode_graph_size is not None:
            hidden = self.decode_graphs.run_model(batch.decode_graph_size, len(batch.host.seq_lens))
        elif batch.piecewise_size is not None:
            hidden = self.piecewise_graphs.run(batch.piecewise_size, device.input_ids, device.positions, attention,
                                               self.cpu_tier)
        elif batch.inputs_embeds is not None:
            hidden = self.model(device.input_ids, device.positions, self.kv_caches, attention, batch.inputs_embeds)
        else:
            hidden = self.model(device.input_ids, device.positions, self.kv_caches, attention)
        if not len(batch.sample_rows) or batch.graph_samples or self.pooler is not None:
            return hidden, None
        # (plain rows may get this rank's LogitsShard under tensor parallelism: Sampler takes either)
        logits = self.model.compute_logits(hidden.index_select(0, device.sample_index), batch.plain)
        return hidden, logits[:len(batch.sampling_rows)]

    def sample(self, logits: torch.Tensor | None, batch: StepBatch, grammar: GrammarOutput | None
               ) -> SampledTokens:
        """This step's tokens (on the device), where asked their top-k logprobs, {row: error}
        of the rows whose parameters the sampler refused, and the rows left with no token to
        sample (those requests fail alone). The tokens go into the penalty counts and last
        outputs on the device at once: the next step's penalties and bad words see them even
        while their values are still on the way to the host. The constrained rows sample from
        what their grammar bitmask allows. A step the decode graph's head samples has no row
        with penalties or bad words, so its tokens need not be recorded."""
        if batch.graph_penalties:   # the penalty head: its tokens go into the counts (next step's penalties)
            tokens = self.decode_graphs.run_head(batch.decode_graph_size, len(batch.num_scheduled),
                                                 penalty_state=self.batch.penalty_state())
            self.batch.record_sampled(batch.device.sampling.slots, tokens)
            return SampledTokens(tokens, None, {}, None)
        if batch.graph_samples:
            masked = self._stage_grammar(batch, grammar) if batch.grammar_head else None
            return SampledTokens(self.decode_graphs.run_head(batch.decode_graph_size, len(batch.num_scheduled),
                                                             grammar=batch.grammar_head), None, {}, masked)
        if grammar is not None and len(grammar.rows):
            self._apply_grammar(logits, batch.sample_rows, grammar)
        sampling = batch.device.sampling
        sampled = self.sampler(logits, batch.sampling_rows, sampling, self.batch.penalty_state(),
                               self.batch.recent_outputs)
        self.batch.record_sampled(sampling.slots, sampled.tokens)
        return sampled

    @torch.inference_mode()
    def sample_deferred(self, step: PendingStep, grammar: GrammarOutput | None) -> None:
        """Sample a launched step whose bitmask needed the previous step's tokens."""
        if step.unsampled is None:
            return
        (batch, logits), step.unsampled = step.unsampled, None
        # (a verify step waits here too when its drafts were placed beside a constrained request
        # with a token in flight: LOOM_SPEC_ASYNC)
        (self._sample_into if batch.spec is None else self._verify_into)(step, logits, batch, grammar)
        if getattr(self.proposer, "on_device", False):
            self.proposer.on_sampled(self, step)
        self.copy_back(step)

    def _sample_into(self, step: PendingStep, logits: torch.Tensor | None, batch: StepBatch,
                     grammar: GrammarOutput | None) -> None:
        step.tokens, step.topk, failed, step.masked = self.sample(logits, batch, grammar)
        step.graph_sampled = batch.graph_samples
        if failed:
            step.failed = {batch.states[batch.sample_rows[i]].req_id: why for i, why in failed.items()}

    def _verify_into(self, step: PendingStep, logits: torch.Tensor | None, batch: StepBatch,
                     grammar: GrammarOutput | None) -> None:
        """A verify step's tokens: every logits row draws a token as the plain sampler would at
        its output index (in the decode graph's head when the step runs there and its rows sample
        plainly; else eagerly, with each row's logits processing, grammar bitmask and logprobs),
        and each request accepts its drafts while the rows drew them, then emits the first
        draw that differs (workers/rejection_sampler.py verify_samples: the rejection sampler
        for greedy drafts). logprobs of every row (finish() keeps the emitted ones)."""
        spec, sampling = batch.spec, batch.device.sampling
        draft, layout_rows = self.h2d([spec.draft, bonus_padded(spec.rows)])
        if batch.graph_samples:
            samples = self.decode_graphs.run_head(batch.decode_graph_size, len(spec.token_rows))
            failed, masked = {}, None
        else:
            if grammar is not None and len(grammar.rows):
                self._apply_grammar(logits, batch.sample_rows, grammar, spec)
            samples, step.topk, failed, masked = self.sampler(logits, batch.sampling_rows, sampling,
                                                               self.batch.penalty_state(), self.batch.recent_outputs)
        verdict = verify_samples(samples, draft, layout_rows)
        step.spec, step.tokens, step.num_accepted = spec, verdict.tokens, verdict.num_accepted
        if not batch.graph_samples:   # (the head's rows have no penalties or bad words: nothing to record)
            self.batch.record_sampled(sampling.slots.index_select(0, verdict.final_rows), verdict.tokens)
        if masked is not None:
            step.masked = masked.index_select(0, verdict.final_rows)
        if failed:
            step.failed = {batch.states[batch.sample_rows[spec.request[i]]].req_id: why for i, why in failed.items()}

    def propose(self, step: PendingStep) -> dict[str, list[int]] | None:
        """The next step's drafts for the requests this step sampled (their tokens appended),
        unless the batch is at disable_by_batch_size."""
        limit = self.spec_config.disable_by_batch_size
        if limit is not None and len(step.req_ids) >= limit:
            return None
        live = [st for i in step.sample_rows.tolist() if self.batch.requests.get((st := step.states[i]).req_id) is st
                and may_speculate(st.params, st.bad_words)]
        if not live:
            return None
        if getattr(self.proposer, "on_device", False):   # drafted with the step (spec_drafts)
            return self.proposer.propose(self, live, step) or None
        return self.proposer.propose(self, live) or None

    def _stage_grammar(self, batch: StepBatch, grammar: GrammarOutput | None) -> torch.Tensor | None:
        """The grammar head's masks for this step (every row samples: grammar.rows are rows of
        the head); the rows left with no token to sample (bool per row, on the host), or None."""
        bs, n = batch.decode_graph_size, len(batch.num_scheduled)
        mask_rows = np.full(bs, -1, dtype=np.int32)
        if grammar is None or not len(grammar.rows):
            distinct = np.zeros((0, 1), dtype=np.int32)
        else:
            distinct = np.array(grammar.bitmask)   # (a writable copy of the received frame)
            which = np.arange(len(grammar.rows)) if grammar.mask_rows is None else np.asarray(grammar.mask_rows)
            mask_rows[np.asarray(grammar.rows, dtype=np.int64)] = which
        dev_distinct, dev_rows = self.h2d([np.ascontiguousarray(distinct), mask_rows])
        self.decode_graphs.set_grammar(bs, dev_distinct, dev_rows)
        empty = ~_allows_any(distinct, self.model.config.vocab_size)
        if not empty.any():
            return None
        rows = mask_rows[:n]
        return torch.from_numpy((rows >= 0) & empty[np.maximum(rows, 0)])

    def _apply_grammar(self, logits: torch.Tensor, sample_rows: np.ndarray, grammar: GrammarOutput,
                       spec: SpecLayout | None = None) -> None:
        """One kernel masks every constrained row. grammar.rows index the step's requests;
        those that sample nothing this step (mid-prompt) are dropped."""
        from kernels.bitmask import apply_bitmask
        rows = np.asarray(grammar.rows, dtype=np.int64)
        pos = np.minimum(np.searchsorted(sample_rows, rows), len(sample_rows) - 1)
        keep = sample_rows[pos] == rows
        if spec is not None:   # a verify step: the row of the request's draft position
            logit_row = spec.rows[pos, np.asarray(grammar.draft_pos or [0] * len(rows), dtype=np.int64)]
            keep &= logit_row >= 0
            pos = logit_row
        mask_rows = np.arange(len(rows)) if grammar.mask_rows is None else np.asarray(grammar.mask_rows)
        bitmask, bitmask_rows, mask_rows = self.h2d([
            np.array(grammar.bitmask),  # a writable copy of the received frame
            pos[keep].astype(np.int32), mask_rows[keep].astype(np.int32)])
        apply_bitmask(logits, bitmask, bitmask_rows, mask_rows)

    def copy_back(self, step: PendingStep) -> None:
        """Start the device -> host copies of what finish() reads (tokens, logprobs, prompt
        logprobs) behind the step's work; finish() waits for one event, and never syncs a tensor
        (a .tolist() of a device tensor would also wait for the next step, queued behind this one)."""
        if self.device.type != "cuda":  # already computed; the decode graphs' `tokens` is rewritten by the next step
            step.tokens_host = step.tokens.clone() if step.graph_sampled else step.tokens
            return
        def to_host(t: torch.Tensor) -> torch.Tensor:
            h = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
            return h.copy_(t, non_blocking=True)
        if step.tokens is not None:
            step.tokens_host = to_host(step.tokens)
        if step.topk is not None:
            step.topk = TopLogprobs._make(to_host(t) for t in step.topk)
        if step.masked is not None:
            step.masked = to_host(step.masked)
        if step.num_accepted is not None:
            step.num_accepted = to_host(step.num_accepted)
        if step.prompt_logprobs is not None:
            step.prompt_logprobs.tensors = tuple(to_host(t) for t in step.prompt_logprobs.tensors)
        if step.pooled is not None:
            step.pooled = to_host(step.pooled)
        if step.spec_drafts is not None:
            step.spec_drafts = to_host(step.spec_drafts)
        if step.tokens is not None or step.prompt_logprobs is not None or step.pooled is not None:
            step.event = torch.cuda.Event()
            step.event.record()

    def must_finish_before(self, prev: PendingStep, so: SchedulerOutput) -> bool:
        """Whether prev must be finished before so is launched, on every rank alike (the worker
        loop launches a step that arrives before the pending one is finished first, and ranks
        differ in when steps arrive):
        - so schedules a request whose drafts prev verified: only finish(prev) moves it past the
          drafts it accepted. Rank 0 always has finished prev (the engine scheduled so on prev's
          tokens from rank 0); a later rank may not have, and would build so's inputs at
          positions its peers do not.
        - so places drafts (spec_draft_slots, LOOM_SPEC_ASYNC) for a request prev sampled: the
          engine scheduled so before prev's output, and only finish(prev) gives the request's
          tokens and the drafts to place (on every rank, rank 0 included).
        - the drafter runs its model in finish() across TP ranks (a draft model): its collectives
          must come in the same order on every rank, and launch(so)'s diff changes the batch it
          drafts for (a gloo "data size doesn't match" error when one rank had applied it)."""
        if getattr(self.proposer, "collective", False) and tp_size() > 1:
            return True
        if so.spec_draft_slots and any(prev.req_ids[i] in so.spec_draft_slots for i in prev.sample_rows.tolist()):
            return True   # so's placing needs prev's tokens and drafts (_place_drafts)
        if prev.spec is None:
            return False
        drafted = {prev.req_ids[i] for i, drafts in zip(prev.sample_rows.tolist(), prev.spec.drafts) if drafts}
        return any(rid in drafted for rid in so.req_ids)

    @staticmethod
    def is_done(step: PendingStep) -> bool:
        """Whether finish(step) would return without waiting for the device."""
        return step.event is None or step.event.query()

    def finish(self, step: PendingStep) -> ModelRunnerOutput:
        """Wait for a launched step and record its tokens."""
        sampled = [-1] * len(step.req_ids)
        logprobs = None
        if step.event is not None:
            step.event.synchronize()
        t0 = time.perf_counter()
        accepted = spec_next = None
        if step.tokens is not None:
            token_list = step.tokens_host.tolist()
            if step.spec is not None:
                accepted = self._append_accepted(step)
            for j, i in enumerate(step.sample_rows.tolist()):
                sampled[i] = token_list[j]
                st = step.states[i]
                if self.batch.requests.get(st.req_id) is st:  # not dropped by a later step's diff
                    self.batch.append_token(st, token_list[j])
            if step.topk is not None:
                logprobs = (pack_logprobs(step.states, step.sample_rows, step.topk) if step.spec is None
                            else pack_spec_logprobs(step.states, step.sample_rows, step.topk, step.spec,
                                                    step.num_accepted.tolist()))
            if self.proposer is not None:
                spec_next = self.propose(step)
                if envs.LOOM_SPEC_ASYNC:   # (else the scheduler sends the drafts back: none to keep here)
                    self._keep_drafts(step, spec_next or {})
            if step.masked is not None and step.masked.any():
                step.refused = {**(step.refused or {}), **{
                    step.states[step.sample_rows[j]].req_id: "no token is left to sample: allowed_token_ids, "
                    "bad_words, logit_bias and min_tokens (which bans the stop tokens) exclude every one"
                    for j in step.masked.nonzero().flatten().tolist()}}
        pooled = None
        if step.pooled is not None:
            vectors = step.pooled.numpy()
            pooled = {step.states[i].req_id: vectors[j].tobytes() for j, i in enumerate(step.sample_rows.tolist())}
        if self.stats is not None:
            self.stats.finished(step.stats_mark, host_s=time.perf_counter() - t0)
        return ModelRunnerOutput(step.req_ids, sampled, logprobs, pack_prompt_logprobs(step.prompt_logprobs),
                                 step.failed, step.refused, accepted, spec_next, pooled, step.placed)

    def _keep_drafts(self, step: PendingStep, proposed: dict[str, list[int]]) -> None:
        """The drafts each request step sampled may verify next, for a later step's spec_draft_slots
        (none: an older proposal is stale once the request has new tokens)."""
        for i in step.sample_rows.tolist():
            st = step.states[i]
            if self.batch.requests.get(st.req_id) is st:
                self.drafts[st.req_id] = proposed.get(st.req_id, [])

    def _append_accepted(self, step: PendingStep) -> dict[str, list[int]] | None:
        """A verify step's accepted drafts into the persistent batch (the emitted token follows)."""
        accepted = {}
        for j, (i, a) in enumerate(zip(step.sample_rows.tolist(), step.num_accepted.tolist())):
            st = step.states[i]
            if a and self.batch.requests.get(st.req_id) is st:
                accepted[st.req_id] = step.spec.drafts[j][:a]
                st.num_tokens += a   # (the drafts are in token_ids already: prepare() wrote them)
        return accepted or None


def _allows_any(bitmask: np.ndarray, vocab: int) -> np.ndarray:
    """bool per bitmask row: some token of the vocabulary is allowed."""
    full, rem = divmod(vocab, 32)
    words = bitmask[:, :full]
    out = (words != 0).any(axis=1) if full else np.zeros(len(bitmask), dtype=bool)
    if rem and bitmask.shape[1] > full:
        out |= (bitmask[:, full] & np.int32((1 << rem) - 1)) != 0
    return out
