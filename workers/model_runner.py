"""ModelRunner: owns the model, the KV cache and the persistent batch, and runs one step."""
from __future__ import annotations

import bisect
import functools
import logging
import time
from dataclasses import dataclass, field

import numpy as np
import torch

from ipc import envs
from ipc.config import EngineConfig
from ipc.messages import GrammarOutput, ModelRunnerOutput, SchedulerOutput
from ipc.profiling import step_stats_enabled
from ipc.sampling_params import SamplingParams
from workers.attention import AttentionMetadata
from workers.decode_graphs import STAGED, DecodeGraphs, decode_batch_sizes
from workers.distributed import tp_size
from workers.host_to_device import HostToDevice
from workers.input_batch import CachedRequestState, InputBatch
from workers.logprobs import (PromptLogprobSpans, pack_logprobs, pack_prompt_logprobs, prompt_logprob_rows,
                              prompt_logprob_spans, prompt_logprobs)
from workers.mm_inputs import MultimodalInputs
from workers.piecewise_graphs import PiecewiseGraphs, enabled as piecewise_enabled
from workers.sampler import Sampler, SamplingRow
from workers.step_stats import StepStats, StepToken

logger = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "float": torch.float32, "bfloat16": torch.bfloat16,
           "float16": torch.float16, "half": torch.float16}


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


def _num_decodes(n: np.ndarray) -> int:
    """How many of a step's sequences lead it with one query token each."""
    return int(np.argmax(n != 1)) if (n != 1).any() else len(n)


@dataclass
class PendingStep:
    """A step launched on the device whose sampled tokens are not yet on the CPU."""
    req_ids: list[str]
    states: list[CachedRequestState]
    sample_rows: np.ndarray
    tokens: torch.Tensor | None = None        # on the device
    tokens_host: torch.Tensor | None = None   # pinned copy, valid once `event` has fired
    event: object = None
    topk: tuple | None = None                 # logprob tensors; pinned host copies after copy_back()
    prompt_logprobs: "PromptLogprobSpans | None" = None
    stats_mark: tuple | None = None           # StepStats bookkeeping (LOOM_STEP_STATS=1)
    unsampled: tuple | None = None            # (StepBatch, logits) while its sampling waits for a bitmask
    failed: dict | None = None                # req_id -> error: requests that failed alone in this step
    refused: dict | None = None               # ... for their own inputs: no token left, an unreadable image
    masked: torch.Tensor | None = None        # bool per sampled row: no token was left to sample (a pinned copy after copy_back)
    graph_sampled: bool = False               # tokens is the decode graphs' `tokens` (the next step's graph reads it)


@dataclass
class StepBatch:
    """One step's inputs, as prepare() builds them for forward() and sample()."""
    states: list[CachedRequestState]
    n: np.ndarray                             # tokens scheduled per request
    start: np.ndarray                         # computed tokens before the step
    end: np.ndarray
    sample_rows: np.ndarray                   # requests that sample a token (not mid-prompt)
    rows: list[SamplingRow]
    host: dict[str, np.ndarray]
    dev: dict[str, torch.Tensor]
    inputs: dict | None                       # input_ids, positions, attention metadata (None: a decode graph's)
    graph_bs: int | None                      # the decode CUDA graph that runs it, if any
    stats_token: StepToken | None = None
    inputs_embeds: torch.Tensor | None = None  # multimodal: encoder outputs at the placeholders
    piecewise_size: int | None = None          # else the piecewise graphs' size that runs it, if any
    graph_samples: bool = False                # the decode graph's head samples it
    plain: bool = False                        # every sampled row samples plainly, now (Sampler.plain)
    plp_spans: list = field(default_factory=list)  # logprobs.prompt_logprob_spans: computed once, in prepare()

    @property
    def kind(self) -> str:
        """How it runs, as the step stats count it."""
        return "graph" if self.graph_bs is not None else "piecewise" if self.piecewise_size is not None else "eager"


class ModelRunner:
    def __init__(self, config: EngineConfig, rank: int = 0):
        from workers.model_loader import load_model, model_kv_shape
        self.config = config
        self.device = resolve_device(config, rank)
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        self.dtype = resolve_dtype(config, self.device)
        backend = config.attention_backend
        self.backend = ("triton" if self.device.type == "cuda" else "torch") if backend == "auto" else backend
        torch.manual_seed(config.seed)
        t0 = time.perf_counter()
        self.weights_dir = config.model   # where sleep level 2 reloads from (update_weights_from_disk moves it)
        self.model = load_model(config.model, self.dtype, self.device, config.load_format,
                                config.language_model_only)
        if self.backend == "triton":
            from workers.models.layers import use_triton_kernels
            use_triton_kernels()
        logger.info("loaded %s in %.2fs (%s, %s)", config.model, time.perf_counter() - t0, self.device, self.dtype)
        self.num_layers, self.num_kv_heads, self.head_dim = model_kv_shape(self.model.config)
        self.sampler = Sampler(use_triton=self.backend == "triton")
        self.h2d = HostToDevice(self.device)
        self.block_size = config.block_size
        self.max_blocks_per_req = -(-config.max_model_len // self.block_size)
        self.batch = InputBatch(config.max_num_seqs, config.max_model_len, self.max_blocks_per_req,
                                self.model.config.vocab_size, self.device)
        self.kv_caches: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.num_blocks = 0
        self._weights_backup: dict[str, torch.Tensor] | None = None  # level-1 sleep
        self.graphs: DecodeGraphs | None = None  # pure-decode steps' graphs
        self.piecewise: PiecewiseGraphs | None = None  # the other steps' graphs
        self._weights_asleep = False
        self.stats = StepStats(self.device) if step_stats_enabled() else None
        # every worker of every engine reads the API servers' stores as a reader of its own
        self.mm = MultimodalInputs(self.model, config.data_parallel_rank * config.tensor_parallel_size + rank)
        self.uses_mrope = self.mm.uses_mrope

    # ------------------------------------------------------------ KV cache

    def block_bytes(self) -> int:
        elem = torch.tensor([], dtype=self.dtype).element_size()
        return 2 * self.num_layers * self.block_size * self.num_kv_heads * self.head_dim * elem

    def determine_num_blocks(self) -> int:
        cfg = self.config
        if cfg.num_gpu_blocks_override is not None:
            return cfg.num_gpu_blocks_override
        if self.device.type == "cuda":
            return self._profile_num_blocks()
        budget = cfg.kv_cache_memory_bytes
        if budget is None:
            full = cfg.max_num_seqs * self.max_blocks_per_req * self.block_bytes()
            budget = min(full, 2 << 30)
        return max(budget // self.block_bytes(), 1)

    @torch.inference_mode()
    def _profile_num_blocks(self) -> int:
        """Run the largest step once, then give the KV cache what the memory budget leaves."""
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        if self.config.mm_encoder_budget and hasattr(self.model, "dummy_image"):
            # the encoder's peak too: the largest image the processor can make, once
            self.model.encode_images([self.model.dummy_image(self.config.mm_max_item_tokens)])
        n = min(self.config.max_num_batched_tokens, self.config.max_model_len)
        ids = torch.zeros(n, dtype=torch.long, device=self.device)
        meta = AttentionMetadata(
            torch.tensor([0, n], dtype=torch.int32, device=self.device),
            torch.tensor([n], dtype=torch.int32, device=self.device),
            torch.zeros((1, self.max_blocks_per_req), dtype=torch.int32, device=self.device),
            torch.full((n,), -1, dtype=torch.long, device=self.device), n, n, self.backend)
        dummy = [(torch.empty(1, self.block_size, self.num_kv_heads, self.head_dim, dtype=self.dtype,
                              device=self.device),) * 2 for _ in range(self.num_layers)]
        hidden = self.model(ids, torch.arange(n, device=self.device), dummy, meta)
        self.model.compute_logits(hidden[-self.config.max_num_seqs:]).float()  # as logprobs/penalties need
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated()
        free, total = torch.cuda.mem_get_info()
        used_by_others = total - free - torch.cuda.memory_reserved()
        budget = total * self.config.gpu_memory_utilization - peak - max(used_by_others, 0)
        del hidden, dummy
        torch.cuda.empty_cache()
        return max(int(budget // self.block_bytes()), 0)

    def initialize_cache(self, num_blocks: int) -> None:
        self.num_blocks = num_blocks
        shape = (num_blocks, self.block_size, self.num_kv_heads, self.head_dim)
        self.kv_caches = [(torch.zeros(shape, dtype=self.dtype, device=self.device),
                           torch.zeros(shape, dtype=self.dtype, device=self.device))
                          for _ in range(self.num_layers)]
        if not self._weights_asleep:
            self.warmup()
            self.capture_cudagraphs()
            if self.stats is not None and not self.stats.serving:
                self.stats.start_serving()

    # Query lengths of the warm-up batches, so that Triton compiles its variants now, not mid-run:
    # decodes, prefills whose longest query hits each attention tile size (1 to 128 rows, one tile
    # per sequence or several), and mixed batches (decodes first, then prefills).
    _WARMUP_BATCHES = ([1], [1] * 5, [1] * 17, [2], [3], [5], [8], [12], [16], [24], [32], [48], [64], [100],
                       [512], [1] * 3 + [37], [1] * 16 + [64])

    def _warmup_batches(self) -> list[list[int]]:
        """_WARMUP_BATCHES, and a prompt joining as many decodes as take attention's shorter
        decode tiles (kernels/paged_attention.py: enough programs per SM). Without it, the first
        such mixed step of a run compiled that variant: 0.4 s, about 7% of the offline workload."""
        from kernels.jit import sm_count
        from kernels.paged_attention import LONG_TILE_PROGRAMS_PER_SM
        many = -(-LONG_TILE_PROGRAMS_PER_SM * sm_count(self.device) // self.num_kv_heads) + 1
        batches = list(self._WARMUP_BATCHES)
        if many < self.config.max_num_seqs:
            batches.append([1] * many + [64])
        return batches

    @torch.inference_mode()
    def warmup(self) -> None:
        """Run the kernels once per kind of batch (with no cache writes) before serving."""
        if self.device.type != "cuda" or self.backend != "triton":
            return
        t0 = time.perf_counter()
        limit = min(self.config.max_num_batched_tokens, self.config.max_model_len - 8)
        for q_lens in self._warmup_batches():
            q_lens = [min(q, limit) for q in q_lens[:self.config.max_num_seqs]]
            seq_lens = np.asarray(q_lens, dtype=np.int64) + 4  # a little context before each query
            n = np.asarray(q_lens, dtype=np.int64)
            host = {"input_ids": np.zeros(int(n.sum()), np.int64),
                    "positions": np.concatenate([np.arange(s - q, s) for q, s in zip(q_lens, seq_lens)]),
                    "slot_mapping": np.full(int(n.sum()), -1, np.int64),
                    "qsl": np.concatenate([[0], np.cumsum(n)]).astype(np.int32), "seq_lens": seq_lens.astype(np.int32),
                    "block_table": np.zeros((len(n), -(-int(seq_lens.max()) // self.block_size)), np.int32),
                    **self._decode_order(n, seq_lens)}
            if self.uses_mrope:  # the rotary kernel's 3-row variant, as image prompts use it
                host["positions"] = np.stack([host["positions"]] * 3)
            inputs = self._device_inputs(host, self.h2d(host), n)
            hidden = self.model(inputs["input_ids"], inputs["positions"], self.kv_caches, inputs["meta"])
            logits = self.model.compute_logits(hidden[-len(n):])
            # the plain rows' logits: this rank's shard at TP (its kernels and exchanges), else the same
            plain_logits = self.model.compute_logits(hidden[-len(n):], plain=True) if tp_size() > 1 else logits
            for params in (SamplingParams(temperature=0.7), SamplingParams(temperature=0.7, top_k=20),
                           SamplingParams(temperature=0.7, top_p=0.9, min_p=0.05),
                           SamplingParams(temperature=0.7, repetition_penalty=1.1, presence_penalty=0.5,
                                          logit_bias={1: 1.0}, min_tokens=2),
                           SamplingParams(temperature=0.7, top_k=20, top_p=0.9, repetition_penalty=1.1)):
                rows = [SamplingRow(params, 0, 0, 0, (0,))] * len(n)  # slot 0: the sampler's stand-in state
                plain = self.sampler.plain(rows, self.model.config.vocab_size)
                self.sampler(plain_logits if plain else logits, rows, self.h2d(self.sampler.host_params(rows)))
        self._warmup_split_kv()
        for rows in self._logit_row_counts:  # the lm_head's shapes (_padded_rows)
            self.model.compute_logits(torch.zeros(rows, self.model.config.hidden_size, dtype=self.dtype,
                                                  device=self.device))
        torch.cuda.synchronize()
        logger.info("warmed up the kernels in %.1fs", time.perf_counter() - t0)

    def _warmup_split_kv(self) -> None:
        """Attention over long contexts splits the KV: decodes 2, 4, ... ways, a short prompt
        chunk in two. Compile each split count a batch of this --max-model-len can pick (graph
        capture compiles the decode graphs' own)."""
        from kernels.paged_attention import CHUNK_SPLIT_MIN_KEYS, MAX_KV_SPLITS, MIN_SPLIT_TOKENS
        seq_len = self.config.max_model_len
        splits = 2
        while splits <= min(MAX_KV_SPLITS, seq_len // MIN_SPLIT_TOKENS):
            self._attention_once(1, seq_len, splits)
            splits *= 2
        group = self.model.config.num_attention_heads // tp_size() // self.num_kv_heads
        chunk = 2 * max(1, 64 // group) + 1  # three query tiles of the largest size: one program per SM or fewer
        if seq_len >= CHUNK_SPLIT_MIN_KEYS and chunk < seq_len:
            self._attention_once(chunk, seq_len, None)

    def _attention_once(self, num_tokens: int, seq_len: int, splits: int | None) -> None:
        """Layer 0's attention for one sequence's last num_tokens of seq_len, its KV split
        `splits` ways (None: as the kernel picks)."""
        from kernels.paged_attention import paged_attention
        key_cache, value_cache = self.kv_caches[0]
        hq = self.model.config.num_attention_heads // tp_size()  # this rank's query heads
        q = torch.randn(num_tokens, hq, self.head_dim, dtype=self.dtype, device=self.device)
        qsl = torch.tensor([0, num_tokens], dtype=torch.int32, device=self.device)
        seq_lens = torch.tensor([seq_len], dtype=torch.int32, device=self.device)
        block_table = torch.zeros((1, self.max_blocks_per_req), dtype=torch.int32, device=self.device)
        paged_attention(q, key_cache, value_cache, qsl, seq_lens, block_table, 1.0, num_tokens, seq_len,
                        num_kv_splits=splits)

    # ------------------------------------------------------------ CUDA graphs (decode)

    def capture_cudagraphs(self) -> None:
        """Capture the decode graphs (workers/decode_graphs.py) and the piecewise graphs. On the
        CPU, LOOM_DECODE_GRAPHS_ON_CPU=1 runs the decode graphs' work uncaptured (tests)."""
        self.graphs = None
        on_cpu = self.device.type == "cpu" and envs.LOOM_DECODE_GRAPHS_ON_CPU
        if self.config.enforce_eager or not (on_cpu or self.device.type == "cuda" and self.backend == "triton"):
            return
        self.graphs = DecodeGraphs(self.model, self.kv_caches, self.config, self.device, self.backend,
                                   self._kv_splits)
        self.graphs.capture()
        if not on_cpu:
            self._capture_piecewise()

    def _capture_piecewise(self) -> None:
        """The graphs of every other step (prefill, mixed), in pieces around attention."""
        self.piecewise = None
        if not piecewise_enabled():
            return
        t0 = time.perf_counter()
        pw = PiecewiseGraphs(self.model, self.kv_caches, self.config.max_num_batched_tokens,
                             self.model.config.num_attention_heads // tp_size(), self.device,
                             self.uses_mrope, self.backend)
        pw.capture()
        self.piecewise = pw
        logger.info("captured piecewise CUDA graphs of %d to %d tokens (%d sizes) in %.1fs",
                    pw.sizes[0], pw.sizes[-1], len(pw.sizes), time.perf_counter() - t0)

    def _kv_splits(self, num_seqs: int) -> int:
        from kernels.paged_attention import choose_num_kv_splits
        return choose_num_kv_splits(num_seqs, self.num_kv_heads, 1, self.config.max_model_len, self.device)

    # ------------------------------------------------------------ sleep / wake

    def sleep(self, level: int) -> None:
        """Level 1: weights to CPU memory, KV cache freed. Level 2: both discarded."""
        if self._weights_asleep:  # asleep already: a deeper level only drops the CPU copy
            if level == 2:
                self._weights_backup = None
            return
        self._weights_backup = None
        if level == 1:
            pin = self.device.type == "cuda"
            self._weights_backup = {n: t.detach().to("cpu").pin_memory() if pin else t.detach().clone()
                                    for n, t in self.model.state_dict(keep_vars=True).items()}
        for t in self.model.state_dict(keep_vars=True).values():
            t.data = torch.empty(0, dtype=t.dtype, device=self.device)
        self._weights_asleep = True
        self.kv_caches = []
        self.graphs, self.piecewise = None, None  # they point at the freed memory; recaptured on wake-up
        self._release_memory()

    def wake_up(self, tags: list[str], weights_dir: str | None = None, load_format: str | None = None) -> int:
        """The parts in `tags` back; level-2 weights are loaded from `weights_dir` (default: the
        checkpoint last loaded), which then becomes the one to reload. The tensors loaded."""
        loaded = 0
        if "weights" in tags:
            if self._weights_backup is not None:
                for n, t in self.model.state_dict(keep_vars=True).items():
                    t.data = self._weights_backup[n].to(self.device, non_blocking=True)
                self._weights_backup = None
            else:  # level 2: reload from the model directory
                from workers.model_loader import load_model
                from workers.weight_update import check_checkpoint_dir
                if weights_dir is not None:   # a weight update while asleep: checked as one while awake
                    check_checkpoint_dir(weights_dir, self.model.config)
                torch.manual_seed(self.config.seed)
                weights_dir = weights_dir or self.weights_dir
                fresh = load_model(weights_dir, self.dtype, self.device, load_format or self.config.load_format,
                                   self.config.language_model_only)
                for (n, t), (_, src) in zip(self.model.state_dict(keep_vars=True).items(),
                                            fresh.state_dict(keep_vars=True).items()):
                    t.data = src.data
                    loaded += 1
                del fresh
                self.weights_dir = weights_dir
            self._weights_asleep = False
            if self.kv_caches:
                self.capture_cudagraphs()
        if "kv_cache" in tags:
            self.initialize_cache(self.num_blocks)
        return loaded

    def _release_memory(self) -> None:
        import gc
        gc.collect()
        if self.device.type == "cuda":
            torch.cuda.synchronize()
            torch.cuda.empty_cache()

    def memory_info(self) -> dict:
        """Bytes held by model weights and KV cache; on CUDA also the device's view, and the
        caching allocator's cudaMalloc / cudaFree counts (a retry frees cached blocks, which
        waits for the device: steps then stop overlapping)."""
        info = {"weights": sum(t.numel() * t.element_size() for t in self.model.state_dict().values()),
                "kv_cache": sum(k.numel() * k.element_size() * 2 for k, _ in self.kv_caches)}
        if self.device.type == "cuda":
            free, total = torch.cuda.mem_get_info()
            stats = torch.cuda.memory_stats()
            info.update(allocated=torch.cuda.memory_allocated(), reserved=torch.cuda.memory_reserved(),
                        device_used=total - free,
                        **{k: stats.get(k, 0) for k in ("num_alloc_retries", "num_device_alloc", "num_device_free")})
        return info

    # ------------------------------------------------------------ one step

    def _apply_diff(self, so: SchedulerOutput) -> None:
        for rid in so.finished_req_ids:
            self.batch.remove(rid)
        for r in so.new_requests:
            self.batch.add(r.req_id, r.prompt_token_ids, r.output_token_ids, r.block_ids,
                           r.num_computed_tokens, r.sampling_params, r.seed, r.eos_token_ids)
            if r.mm_items:
                self.mm.add_request(self.batch.requests[r.req_id], r)
        self.mm.release(so.released_mm)
        c = so.cached_requests
        for rid, blocks, num_computed in zip(c.req_ids, c.new_block_ids, c.num_computed_tokens):
            if blocks:
                self.batch.append_blocks(rid, blocks)
            self.batch.requests[rid].num_computed_tokens = num_computed

    @torch.inference_mode()
    def launch(self, so: SchedulerOutput, prev: "PendingStep | None" = None) -> "PendingStep":
        """Queue one step on the device without waiting for it: prepare, forward, sample,
        copy back (finish() waits). Decode inputs that are tokens of `prev` (still in
        flight) are taken from prev's device tensor."""
        batch = self.prepare(so, prev)
        if batch is None:
            return PendingStep(list(so.req_ids), [], np.zeros(0, np.int64), refused=self.mm.take_refused())
        step = PendingStep(list(so.req_ids), batch.states, batch.sample_rows, refused=self.mm.take_refused())
        if batch.stats_token is not None:
            self.stats.lap(batch.stats_token, "prepare")
        hidden, logits = self.forward(batch)
        if batch.stats_token is not None:
            self.stats.lap(batch.stats_token, "forward")
        if len(batch.sample_rows) and so.defer_sample:
            if batch.graph_bs is not None:  # its parameters lie in the graphs' staging, which the next step rewrites
                batch.dev = {k: v.clone() for k, v in batch.dev.items()}
            step.unsampled = (batch, logits)   # sample_deferred() samples it once the bitmask comes
        elif len(batch.sample_rows):
            self._sample_into(step, logits, batch, so.grammar)
        step.prompt_logprobs = prompt_logprobs(self.model, batch, hidden)
        if step.unsampled is None:
            self.copy_back(step)
        for st, e in zip(batch.states, batch.end):
            st.num_computed_tokens = int(e)
        if batch.stats_token is not None:
            self.stats.lap(batch.stats_token, "sample")  # with prompt logprobs and the copy back
            step.stats_mark = self.stats.end(batch.stats_token, batch.kind, int(batch.n.sum()))
        return step

    def prepare(self, so: SchedulerOutput, prev: "PendingStep | None") -> "StepBatch | None":
        """Apply the step's diff and build its inputs and metadata on the host, then on the
        device (a decode graph's staging, else one copy per dtype); None when nothing is
        scheduled."""
        self._apply_diff(so)
        if not so.req_ids:
            self.mm.free(so.free_encoder_hashes)
            return None
        stats_token = self.stats.begin() if self.stats is not None else None
        states = [self.batch.requests[rid] for rid in so.req_ids]
        n = np.asarray(so.num_scheduled_tokens, dtype=np.int64)
        start = np.fromiter((s.num_computed_tokens for s in states), dtype=np.int64, count=len(states))
        slots = np.fromiter((s.slot for s in states), dtype=np.int64, count=len(states))
        end = start + n
        num_tokens = np.fromiter((s.num_tokens for s in states), dtype=np.int64, count=len(states))
        sample_rows = np.nonzero(end >= num_tokens)[0]  # the others are mid-prompt
        rows = [self._sampling_row(states[i], int(end[i])) for i in sample_rows]
        if so.scheduled_encoder_inputs:
            enc_token = self.stats.begin() if self.stats is not None else None
            self.mm.run_encoders(self.batch.requests, so)
            if enc_token is not None:  # the encoder's share of step time (LOOM_STEP_STATS=1)
                self.stats.finished(self.stats.end(enc_token, "encoder", sum(map(len, so.scheduled_encoder_inputs.values()))))
        host = self._host_inputs(n, start, slots)
        mm = self.mm.spans(states, start, n, host["qsl"]) if self.mm.enabled else []
        graph_bs = self._decode_graph_size(n, bool(mm))
        every_row_samples = len(sample_rows) == len(n)
        # whether the sampled rows all sample plainly, asked only where it matters (it walks every
        # row): a decode graph's head samples such a step, and under TP its logits may stay sharded
        plain = (((graph_bs is not None and every_row_samples) or tp_size() > 1)
                 and self._samples_plainly(so, rows))
        graph_samples = graph_bs is not None and every_row_samples and plain
        if self.uses_mrope:
            host["positions"] = self.batch.mrope_positions(states, host["positions"], host["qsl"])
        if not graph_samples:
            host["sample_index"] = self._padded_rows(host["qsl"][1:][sample_rows] - 1)
        host.update(self.sampler.host_params(rows))
        plp_spans = prompt_logprob_spans(states, start, n)
        host.update(prompt_logprob_rows(plp_spans, states, host["qsl"], self.batch.token_ids))
        if prev is not None and prev.tokens is not None:
            host.update(self._feed_indices(prev, states, start, host["qsl"], graph_bs is not None))
        dev, inputs = self._upload(host, graph_bs, n)
        if "feed_dst" in dev:  # decode inputs that are prev's tokens come straight from the device
            dev["input_ids"].index_copy_(0, dev["feed_dst"], prev.tokens.index_select(0, dev["feed_rows"]))
        embeds = self.mm.embeddings(mm, inputs["input_ids"]) if mm else None
        self.mm.free(so.free_encoder_hashes)   # after this step's use: the scheduler frees as it advances
        piecewise_size = None
        if graph_bs is None and embeds is None and self.piecewise is not None:
            piecewise_size = self.piecewise.size_for(int(n.sum()))
        return StepBatch(states, n, start, end, sample_rows, rows, host, dev, inputs, graph_bs, stats_token, embeds,
                         piecewise_size, graph_samples, plain, plp_spans)

    def _decode_graph_size(self, n: np.ndarray, has_mm: bool) -> int | None:
        """The decode graph size that runs the step (pure decodes, no image placeholder). Its head
        samples the step when every row samples, plainly: then there is no eager lm_head or
        sampler at all."""
        if self.graphs is None or has_mm or not (n == 1).all():
            return None
        return self.graphs.size_for(len(n))

    def _samples_plainly(self, so: SchedulerOutput, rows: list[SamplingRow]) -> bool:
        """No top-k / top-p, penalties, logprobs or grammar among the sampled rows (Sampler.plain)."""
        return (not so.defer_sample and not (so.grammar is not None and len(so.grammar.rows))
                and self.sampler.plain(rows, self.model.config.vocab_size))

    @functools.cached_property
    def _logit_row_counts(self) -> list[int]:
        """The row counts the lm_head runs at on CUDA: the decode graphs' batch sizes."""
        return decode_batch_sizes(self.config.max_num_seqs)

    def _padded_rows(self, index: np.ndarray) -> np.ndarray:
        """The sampled rows' hidden-state index, padded (with row 0) to one of
        _logit_row_counts. cuBLAS's first call at a new shape costs 2-3 ms of host time, and up
        to 1.5 s where it loads a new kernel family (bench/RESULTS.md): a shrinking offline batch
        met ~200 new shapes mid-run. The warm-up runs the lm_head at every padded count."""
        if self.device.type != "cuda" or not len(index):
            return index
        sizes = self._logit_row_counts
        i = bisect.bisect_left(sizes, len(index))
        return np.pad(index, (0, sizes[i] - len(index))) if i < len(sizes) else index

    def forward(self, batch: "StepBatch") -> tuple[torch.Tensor, torch.Tensor | None]:
        """The model (or its CUDA graph): hidden states, and the logits of the sampled rows
        (None when none samples, or when the decode graph's head samples them)."""
        inputs = batch.inputs
        if batch.graph_bs is not None:
            hidden = self.graphs.run_model(batch.graph_bs, len(batch.n))
        elif batch.piecewise_size is not None:
            hidden = self.piecewise.run(batch.piecewise_size, inputs["input_ids"], inputs["positions"], inputs["meta"])
        elif batch.inputs_embeds is not None:
            hidden = self.model(inputs["input_ids"], inputs["positions"], self.kv_caches, inputs["meta"],
                                batch.inputs_embeds)
        else:
            hidden = self.model(inputs["input_ids"], inputs["positions"], self.kv_caches, inputs["meta"])
        if not len(batch.sample_rows) or batch.graph_samples:
            return hidden, None
        # (plain rows may get this rank's LogitsShard under tensor parallelism: Sampler takes either)
        logits = self.model.compute_logits(hidden.index_select(0, batch.dev["sample_index"]), batch.plain)
        return hidden, logits[:len(batch.sample_rows)]

    def sample(self, logits: torch.Tensor | None, batch: "StepBatch", grammar: GrammarOutput | None
               ) -> tuple[torch.Tensor, tuple | None, dict, torch.Tensor | None]:
        """This step's tokens (on the device), where asked their top-k logprobs, {row: error}
        of the rows whose parameters the sampler refused, and the rows left with no token to
        sample (those requests fail alone). The tokens go into the penalty counts and last
        outputs on the device at once: the next step's penalties and bad words see them even
        while their values are still on the way to the host. The constrained rows sample from
        what their grammar bitmask allows. A step the decode graph's head samples has no row
        with penalties or bad words, so its tokens need not be recorded."""
        if batch.graph_samples:
            return self.graphs.run_head(batch.graph_bs, len(batch.n)), None, {}, None
        if grammar is not None and len(grammar.rows):
            self._apply_grammar(logits, batch.sample_rows, grammar)
        tokens, topk, failed, masked = self.sampler(logits, batch.rows, batch.dev, self.batch.penalty_state(),
                                                    self.batch.recent_outputs)
        self.batch.record_sampled(batch.dev["slots"], tokens)
        return tokens, topk, failed, masked

    @torch.inference_mode()
    def sample_deferred(self, step: "PendingStep", grammar: GrammarOutput | None) -> None:
        """Sample a launched step whose bitmask needed the previous step's tokens."""
        if step.unsampled is None:
            return
        (batch, logits), step.unsampled = step.unsampled, None
        self._sample_into(step, logits, batch, grammar)
        self.copy_back(step)

    def _sample_into(self, step: "PendingStep", logits: torch.Tensor | None, batch: "StepBatch",
                     grammar: GrammarOutput | None) -> None:
        step.tokens, step.topk, failed, step.masked = self.sample(logits, batch, grammar)
        step.graph_sampled = batch.graph_samples
        if failed:
            step.failed = {batch.states[batch.sample_rows[i]].req_id: why for i, why in failed.items()}

    def _apply_grammar(self, logits: torch.Tensor, sample_rows: np.ndarray, grammar: GrammarOutput) -> None:
        """One kernel masks every constrained row. grammar.rows index the step's requests;
        those that sample nothing this step (mid-prompt) are dropped."""
        from kernels.bitmask import apply_bitmask
        rows = np.asarray(grammar.rows, dtype=np.int64)
        pos = np.minimum(np.searchsorted(sample_rows, rows), len(sample_rows) - 1)
        keep = sample_rows[pos] == rows
        mask_rows = np.arange(len(rows)) if grammar.mask_rows is None else np.asarray(grammar.mask_rows)
        dev = self.h2d({"bitmask": np.array(grammar.bitmask),  # a writable copy of the received frame
                        "bitmask_rows": pos[keep].astype(np.int32), "mask_rows": mask_rows[keep].astype(np.int32)})
        apply_bitmask(logits, dev["bitmask"], dev["bitmask_rows"], dev["mask_rows"])

    def copy_back(self, step: "PendingStep") -> None:
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
            step.topk = tuple(to_host(t) for t in step.topk)
        if step.masked is not None:
            step.masked = to_host(step.masked)
        if step.prompt_logprobs is not None:
            step.prompt_logprobs.tensors = tuple(to_host(t) for t in step.prompt_logprobs.tensors)
        if step.tokens is not None or step.prompt_logprobs is not None:
            step.event = torch.cuda.Event()
            step.event.record()

    @staticmethod
    def is_done(step: "PendingStep") -> bool:
        """Whether finish(step) would return without waiting for the device."""
        return step.event is None or step.event.query()

    def finish(self, step: "PendingStep") -> ModelRunnerOutput:
        """Wait for a launched step and record its tokens."""
        sampled = [-1] * len(step.req_ids)
        logprobs = None
        if step.event is not None:
            step.event.synchronize()
        if step.tokens is not None:
            token_list = step.tokens_host.tolist()
            for j, i in enumerate(step.sample_rows.tolist()):
                sampled[i] = token_list[j]
                st = step.states[i]
                if self.batch.requests.get(st.req_id) is st:  # not dropped by a later step's diff
                    self.batch.append_token(st, token_list[j])
            if step.topk is not None:
                logprobs = pack_logprobs(step.states, step.sample_rows, step.topk)
            if step.masked is not None and step.masked.any():
                step.refused = {**(step.refused or {}), **{
                    step.states[step.sample_rows[j]].req_id: "no token is left to sample: allowed_token_ids, "
                    "bad_words, logit_bias and min_tokens (which bans the stop tokens) exclude every one"
                    for j in step.masked.nonzero().flatten().tolist()}}
        if self.stats is not None:
            self.stats.finished(step.stats_mark)
        return ModelRunnerOutput(step.req_ids, sampled, logprobs, pack_prompt_logprobs(step.prompt_logprobs),
                                 step.failed, step.refused)

    @staticmethod
    def _feed_indices(prev: "PendingStep", states, start: np.ndarray, qsl: np.ndarray,
                      decode_graph: bool) -> dict[str, np.ndarray]:
        """Where this step's inputs are prev's sampled tokens (still on the device): for a decode
        graph after a step its head sampled, each row's row in prev's tokens (feed_src, -1: none;
        the graph reads them itself); else the token indices and prev's rows (feed_dst, feed_rows)."""
        src_row = {id(prev.states[i]): j for j, i in enumerate(prev.sample_rows)}
        dst, src = [], []
        for i, st in enumerate(states):
            j = src_row.get(id(st))
            if j is not None and start[i] == st.num_tokens:  # its first input is the token prev samples
                dst.append(int(qsl[i]))
                src.append(j)
        if decode_graph and prev.graph_sampled:
            feed = np.full(len(states), -1, np.int64)
            feed[dst] = src  # one token per row: the token index is the row
            return {"feed_src": feed}
        return {"feed_dst": np.asarray(dst, np.int64), "feed_rows": np.asarray(src, np.int64)} if dst else {}

    def _upload(self, host: dict[str, np.ndarray], graph_bs: int | None, n: np.ndarray) -> tuple[dict, dict | None]:
        """The step's host arrays on the device, and the eager forward's inputs (None for a
        decode graph, which reads its staging: the rest, if any, goes in one copy per dtype)."""
        if graph_bs is None:
            dev = self.h2d(host)
            return dev, self._device_inputs(host, dev, n)
        dev = self.graphs.stage(graph_bs, {k: v for k, v in host.items() if k in STAGED})
        extra = {k: v for k, v in host.items() if k not in STAGED and k != "qsl"}
        if extra:
            dev.update(self.h2d(extra))
        return dev, None

    def _host_inputs(self, n: np.ndarray, start: np.ndarray, slots: np.ndarray) -> dict[str, np.ndarray]:
        """The step's inputs and attention metadata as host arrays, built without per-token loops."""
        bs = self.block_size
        qsl = np.zeros(len(n) + 1, dtype=np.int32)  # int32 metadata: no conversions on the device
        np.cumsum(n, out=qsl[1:])
        tok_row = np.repeat(np.arange(len(n)), n)
        positions = np.arange(int(qsl[-1])) - np.repeat(qsl[:-1] - start, n)
        tok_slot = slots[tok_row]
        blocks = self.batch.block_table[tok_slot, positions // bs]
        seq_lens = (start + n).astype(np.int32)
        max_blocks = int(-(-seq_lens.max() // bs))
        return {"input_ids": self.batch.token_ids[tok_slot, positions], "positions": positions,
                "slot_mapping": blocks.astype(np.int64) * bs + positions % bs, "qsl": qsl,
                "seq_lens": seq_lens, "block_table": self.batch.block_table[slots, :max_blocks],
                **self._decode_order(n, seq_lens)}

    @staticmethod
    def _decode_order(n: np.ndarray, seq_lens: np.ndarray) -> dict[str, np.ndarray]:
        """The decodes' attention launch order, longest context first (a mixed batch's
        decodes lead it): with contexts of 100 to 2,000 tokens it takes a batch-128
        decode's attention from 182 to 147 us (Qwen3-0.6B; bench.tune_attention --mixed)."""
        num_decodes = _num_decodes(n)
        if num_decodes == 0:
            return {}
        return {"seq_order": np.argsort(-seq_lens[:num_decodes], kind="stable").astype(np.int32)}

    def _device_inputs(self, host: dict, dev: dict, n: np.ndarray) -> dict:
        meta = AttentionMetadata(  # the host built qsl, seq_lens and block_table as int32
            query_start_loc=dev["qsl"], seq_lens=dev["seq_lens"],
            block_table=dev["block_table"], slot_mapping=dev["slot_mapping"],
            max_query_len=int(n.max()), max_seq_len=int(host["seq_lens"].max()), backend=self.backend,
            num_decodes=_num_decodes(n), seq_order=dev.get("seq_order"))
        return {"input_ids": dev["input_ids"], "positions": dev["positions"], "meta": meta}

    def _sampling_row(self, st: CachedRequestState, position: int) -> SamplingRow:
        # the token drawn lands at `position`: its output index is fixed whatever the schedule
        return SamplingRow(st.params, st.seed, position - st.num_prompt_tokens, st.slot, st.eos_token_ids,
                           st.bad_words)
