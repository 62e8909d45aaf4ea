"""Warm-up and CUDA graph capture, once the KV cache is allocated and before serving: the
kernels run once per kind of batch (so that Triton compiles its variants now, not mid-run),
then the decode graphs and the piecewise graphs are captured.

Functions of the runner: they read its model, cache and helpers, and return the graphs,
which the runner owns."""
from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, NamedTuple

import numpy as np
import torch

from ipc import envs
from ipc.sampling_params import SamplingParams
from workers.compile_ahead import compile_ahead, dry_running
from workers.decode_graphs import DecodeGraphs
from workers.distributed import tp_size
from workers.piecewise_graphs import PiecewiseGraphs, enabled as piecewise_enabled
from workers.sampler import SamplingRow
from workers.step_inputs import StepArrays, attention_metadata, decode_order

if TYPE_CHECKING:
    from workers.model_runner import ModelRunner

logger = logging.getLogger(__name__)

# Query lengths of the warm-up batches, so that Triton compiles its variants now, not mid-run:
# decodes, prefills whose longest query hits each attention tile size (1 to 128 rows, one tile
# per sequence or several), and mixed batches (decodes first, then prefills).
WARMUP_BATCHES = ([1], [1] * 5, [1] * 17, [2], [3], [5], [8], [12], [16], [24], [32], [48], [64], [100],
                  [512], [1] * 3 + [37], [1] * 16 + [64])

# The sampler's kinds of rows (plain, top-k, top-p / min-p, adjusted, all of them)
_WARMUP_PARAMS = (SamplingParams(temperature=0.7), SamplingParams(temperature=0.7, top_k=20),
                  SamplingParams(temperature=0.7, top_p=0.9, min_p=0.05),
                  SamplingParams(temperature=0.7, repetition_penalty=1.1, presence_penalty=0.5,
                                 logit_bias={1: 1.0}, min_tokens=2),
                  SamplingParams(temperature=0.7, top_k=20, top_p=0.9, repetition_penalty=1.1))

# Rows whose sampler launches change with the batch size: the chunked top-p route splits each row
# over about four programs per SM (kernels/sampling.py), so its launches' int arguments, and with
# them Triton's specializations, change with the sampled rows. Top-p alone reads the logits in the
# model's dtype; with penalties, the float32 adjusted logits (as the decode graphs' penalty head).
_SIZED_PARAMS = (SamplingParams(temperature=0.7, top_p=0.95),
                 SamplingParams(temperature=0.7, top_p=0.95, repetition_penalty=1.1, presence_penalty=0.5))


class CapturedGraphs(NamedTuple):
    decode: DecodeGraphs | None      # pure-decode steps' graphs
    piecewise: PiecewiseGraphs | None  # the other steps' graphs


# Query lengths of short prompt chunks that come many to a step (the tails after prefix-cache hits,
# verify steps): one per attention tile height (BLOCK_M: query tokens x a KV head's group)
_SHORT_CHUNKS = (2, 4, 8, 16, 32, 48)


def _warmup_batches(runner: ModelRunner) -> list[list[int]]:
    """WARMUP_BATCHES; a prompt joining as many decodes as take attention's shorter decode
    tiles (kernels/paged_attention.py: enough programs per SM); and steps of as many short
    chunks as fill the SMs (no longer a "short chunk" launch: other key tiles). Without them the
    first such step of a run compiled its variant: a mixed one 0.4 s, about 7% of the offline
    workload; the prompts' tails after prefix-cache hits 0.54 s (session 37)."""
    from kernels.jit import sm_count
    from kernels.paged_attention import FEW_PREFILL_PROGRAMS_PER_SM, LONG_TILE_PROGRAMS_PER_SM
    config, sms, kv_heads = runner.config, sm_count(runner.device), runner.kv_spec.num_kv_heads
    many = -(-LONG_TILE_PROGRAMS_PER_SM * sms // kv_heads) + 1
    batches = list(WARMUP_BATCHES)
    if many < config.max_num_seqs:
        batches.append([1] * many + [64])
    chunks = -(-int(FEW_PREFILL_PROGRAMS_PER_SM * sms) // kv_heads) + 1
    for q in _SHORT_CHUNKS:
        n = min(chunks, config.max_num_seqs, config.max_num_batched_tokens // q)
        if n > 1:
            batches.append([q] * n)
    return batches


def _warmup_inputs(runner: ModelRunner, query_lens: list[int]) -> tuple[StepArrays, np.ndarray]:
    """A batch of these query lengths, each after a little context, writing no KV."""
    num_scheduled = np.asarray(query_lens, dtype=np.int64)
    seq_lens = num_scheduled + 4  # a little context before each query
    total = int(num_scheduled.sum())
    positions = np.concatenate([np.arange(s - q, s) for q, s in zip(query_lens, seq_lens)])
    if runner.uses_mrope:  # the rotary kernel's 3-row variant, as image prompts use it
        positions = np.stack([positions] * 3)
    host = StepArrays(
        input_ids=np.zeros(total, np.int64), positions=positions, slot_mapping=np.full(total, -1, np.int64),
        query_start_loc=np.concatenate([[0], np.cumsum(num_scheduled)]).astype(np.int32),
        seq_lens=seq_lens.astype(np.int32),
        block_table=np.zeros((len(num_scheduled), -(-int(seq_lens.max()) // runner.block_size)), np.int32),
        decode_order=decode_order(num_scheduled, seq_lens))
    return host, num_scheduled


def warm_up(runner: ModelRunner) -> None:
    """Run the kernels once per kind of batch (with no cache writes) before serving, their
    Triton variants compiled in parallel first (workers/compile_ahead.py)."""
    if runner.device.type != "cuda" or runner.backend != "triton":
        return
    # one dry run for the warm-up and the graph capture after it: their compiles share one pool
    compile_ahead(lambda: (_warm_up(runner), _graph_bodies(runner)), runner.device, "warm-up and graph capture")
    _warm_up(runner)


@torch.inference_mode()
def _warm_up(runner: ModelRunner) -> None:
    t0 = time.perf_counter()
    config, model, sampler = runner.config, runner.model, runner.sampler
    limit = min(config.max_num_batched_tokens, config.max_model_len - 8)
    for query_lens in _warmup_batches(runner):
        query_lens = [min(q, limit) for q in query_lens[:config.max_num_seqs]]
        host, num_scheduled = _warmup_inputs(runner, query_lens)
        device = runner.h2d.upload(host)
        meta = attention_metadata(host, device, num_scheduled, runner.backend)
        hidden = model(device.input_ids, device.positions, runner.kv_caches, meta)
        logits = model.compute_logits(hidden[-len(query_lens):])
        # the plain rows' logits: this rank's shard at TP (its kernels and exchanges), else the same
        plain_logits = model.compute_logits(hidden[-len(query_lens):], plain=True) if tp_size() > 1 else logits
        for params in _WARMUP_PARAMS:
            rows = [SamplingRow(params, 0, 0, 0, (0,))] * len(query_lens)  # slot 0: the sampler's stand-in state
            plain = sampler.plain(rows, model.config.vocab_size)
            sampler(plain_logits if plain else logits, rows, runner.h2d.upload(sampler.host_params(rows)))
    _warmup_sampler_sizes(runner)
    _warmup_split_kv(runner)
    _warmup_cascade(runner)
    for rows in runner.logit_row_counts:  # the lm_head's shapes (ModelRunner._padded_rows)
        model.compute_logits(torch.zeros(rows, model.config.hidden_size, dtype=runner.dtype, device=runner.device))
    if runner.device.type == "cuda":   # (the CPU: the tests' dry runs of it, tests/test_compile_ahead.py)
        torch.cuda.synchronize()
    if not dry_running():
        logger.info("warmed up the kernels in %.1fs", time.perf_counter() - t0)


def _warmup_sampler_sizes(runner: ModelRunner) -> None:
    """The eager sampler over _SIZED_PARAMS rows at every row count up to --max-num-seqs (an eager
    step may sample any count). On a fresh compile cache, the variants first met mid-run compiled
    there, 0.2-1 s each: top-p alone ran at 0.89x plain temperature, with penalties at 0.63x (warm
    cache: 0.98x and 0.93x; bench/RESULTS.md, session 37)."""
    model, sampler = runner.model, runner.sampler
    hidden = torch.zeros(runner.config.max_num_seqs, model.config.hidden_size, dtype=runner.dtype,
                         device=runner.device)
    logits = model.compute_logits(hidden)
    for params in _SIZED_PARAMS:
        for n in range(1, len(hidden) + 1):
            rows = [SamplingRow(params, 0, 0, 0, (0,))] * n   # slot 0: the sampler's stand-in state
            sampler(logits[:n], rows, runner.h2d.upload(sampler.host_params(rows)))


def _warmup_split_kv(runner: ModelRunner) -> None:
    """Attention over long contexts splits the KV: decodes 2, 4, ... ways, a short prompt
    chunk in two; a long prompt's chunks take the long-prefill tiles. Compile each split count
    (and those tiles) a batch of this --max-model-len can pick (graph capture compiles the decode
    graphs' own), for each kind of attention layer the model has (full, sliding-window,
    soft-capped, with sinks: each a kernel variant of its own)."""
    from kernels.paged_attention import CHUNK_SPLIT_MIN_KEYS, LONG_PREFILL_KEYS, MAX_KV_SPLITS, MIN_SPLIT_TOKENS
    from workers.attention import Attention
    seq_len = runner.config.max_model_len
    group = runner.model.config.num_attention_heads // tp_size() // runner.kv_spec.num_kv_heads
    chunk = 2 * max(1, 64 // group) + 1  # three query tiles of the largest size: one program per SM or fewer
    kinds = {(m.sliding_window, m.logits_soft_cap, m.sinks is not None)
             for m in runner.model.modules() if isinstance(m, Attention)}
    for kind in sorted(kinds, key=str):
        splits = 2
        while splits <= min(MAX_KV_SPLITS, seq_len // MIN_SPLIT_TOKENS):
            _attention_once(runner, 1, seq_len, splits, *kind)
            splits *= 2
        if seq_len >= CHUNK_SPLIT_MIN_KEYS and chunk < seq_len:
            _attention_once(runner, chunk, seq_len, None, *kind)
        if seq_len >= LONG_PREFILL_KEYS:   # a long prompt's chunks take the long-prefill tiles
            _attention_once(runner, min(runner.config.max_num_batched_tokens, seq_len), seq_len, None, *kind)


def _warmup_cascade(runner: ModelRunner) -> None:
    """Cascade attention's kernel variants on its eager route (workers/cascade_attn.py: steps with
    prompt chunks, in the piecewise graphs; pure decodes without a cascade graph of their size;
    the decode graphs compile their own at capture). Its launches pick their variants from the
    step's shape: the prefix launch's splits from its queries and the prefix's length (capped at
    one split per 256 keys), the suffix's tiles and splits from its decodes, its own keys and its
    chunks' lengths, and the merge's from the two. So each prefix length that caps the splits
    differently runs under decode counts that take each decode tile, pure (short and long own
    keys) and with prompt chunks (one short, one long, many): at 512 x 2,048 shared keys, 15
    variants the old warm-up (decodes of 64 and --max-num-seqs) missed compiled mid-run."""
    if runner.cascade is None:
        return
    from kernels.cascade_attention import MAX_PREFIX_SPLITS, MIN_PREFIX_SPLIT_KEYS
    config, block_size = runner.config, runner.block_size
    # decode counts at each power of two and half way between (the tiles, the programs per SM and the
    # splits they pick change at such steps), from the planner's least (MIN_REQUESTS)
    decodes = sorted({d for p in range(3, max(3, config.max_num_seqs.bit_length()) + 1)
                      for d in (1 << p, 3 << (p - 1)) if d <= config.max_num_seqs} | {config.max_num_seqs})
    length = MIN_PREFIX_SPLIT_KEYS
    while length <= min(MAX_PREFIX_SPLITS * MIN_PREFIX_SPLIT_KEYS, config.max_model_len - 2):   # (longer: as 4,096)
        prefix_len = length // block_size * block_size
        longest_own = config.max_model_len - prefix_len - 1
        for num_decodes in decodes:
            shapes = [([1] * num_decodes, 64), ([1] * num_decodes, longest_own)]
            shapes += [([1] * num_decodes + chunks, 64) for chunks in ([16], [64], [64] * 32, [512])]
            for query_lens, own in shapes:
                if prefix_len + own + max(query_lens) <= config.max_model_len and \
                        sum(query_lens) <= config.max_num_batched_tokens:
                    _cascade_once(runner, query_lens, prefix_len, own)
        length *= 2


def _cascade_once(runner: ModelRunner, query_lens: list[int], prefix_len: int, own: int) -> None:
    """Cascade attention over layer 0's cache for sequences of these query lengths (decodes
    first), each after a shared prefix of prefix_len keys and `own` keys of its own, with the
    split counts the runner's planner picks for that step."""
    from kernels.cascade_attention import cascade_attention
    key_cache, value_cache = runner.kv_caches[0]
    device, num_seqs = runner.device, len(query_lens)
    num_scheduled = np.asarray(query_lens, np.int64)
    query_start_loc = torch.tensor(np.concatenate([[0], np.cumsum(num_scheduled)]), dtype=torch.int32, device=device)
    seq_lens_host = prefix_len + own + num_scheduled
    seq_lens = torch.tensor(seq_lens_host, dtype=torch.int32, device=device)
    block_table = torch.zeros((num_seqs, runner.max_blocks_per_req), dtype=torch.int32, device=device)
    prefix = runner.cascade.prefix(prefix_len, query_start_loc, block_table, num_scheduled, int(seq_lens_host.max()))
    q = torch.randn(int(num_scheduled.sum()), runner.cascade.num_q_heads, runner.kv_spec.head_dim,
                    dtype=runner.dtype, device=device)
    num_decodes = int((num_scheduled == 1).sum())
    cascade_attention(q, key_cache, value_cache, query_start_loc, seq_lens, block_table, 1.0,
                      int(num_scheduled.max()), prefix, num_decodes=num_decodes,
                      seq_order=torch.arange(num_decodes, dtype=torch.int32, device=device))


def _attention_once(runner: ModelRunner, num_tokens: int, seq_len: int, splits: int | None,
                    sliding_window: int | None = None, logits_soft_cap: float | None = None,
                    sinks: bool = False) -> None:
    """Attention over layer 0's cache for one sequence's last num_tokens of seq_len, its KV
    split `splits` ways (None: as the kernel picks), with this window and soft cap (and sinks)."""
    from kernels.paged_attention import paged_attention
    device = runner.device
    key_cache, value_cache = runner.kv_caches[0]
    query_heads = runner.model.config.num_attention_heads // tp_size()  # this rank's query heads
    q = torch.randn(num_tokens, query_heads, runner.kv_spec.head_dim, dtype=runner.dtype, device=device)
    query_start_loc = torch.tensor([0, num_tokens], dtype=torch.int32, device=device)
    seq_lens = torch.tensor([seq_len], dtype=torch.int32, device=device)
    block_table = torch.zeros((1, runner.max_blocks_per_req), dtype=torch.int32, device=device)
    sink_logits = torch.zeros(query_heads, dtype=runner.dtype, device=device) if sinks else None
    paged_attention(q, key_cache, value_cache, query_start_loc, seq_lens, block_table, 1.0, num_tokens, seq_len,
                    num_kv_splits=splits, sliding_window=sliding_window, logits_soft_cap=logits_soft_cap,
                    sinks=sink_logits)


# ------------------------------------------------------------ CUDA graphs

def _captures(runner: ModelRunner) -> bool:
    """Whether capture_graphs captures (or, LOOM_DECODE_GRAPHS_ON_CPU=1, runs uncaptured) graphs."""
    device = runner.device
    on_cpu = device.type == "cpu" and envs.LOOM_DECODE_GRAPHS_ON_CPU
    return not runner.config.enforce_eager and (on_cpu or device.type == "cuda" and runner.backend == "triton")


def _captures_piecewise(runner: ModelRunner) -> bool:
    # (an encoder-decoder's cross-attention sizes its prompt steps from host ints: no fixed graph)
    return runner.device.type == "cuda" and piecewise_enabled() and getattr(runner.model, "cross_kv", None) is None


def _graph_bodies(runner: ModelRunner) -> None:
    """What capture_graphs runs eagerly before it captures (each decode graph's step, the
    piecewise graphs' forwards), on graph objects of their own that are then dropped: run in
    the warm-up's dry run, the kernels the capture needs compile along with the warm-up's."""
    if not _captures(runner):
        return
    lora = runner.lora.ctx if runner.lora is not None else None
    active = lora.active if lora is not None else None
    if lora is not None:   # as _capture_graphs records them
        lora.active = True
    try:
        DecodeGraphs(runner.model, runner.kv_caches, runner.config, runner.device, runner.backend,
                     runner.kv_splits, lora_ctx=lora, cascade=runner.cascade).run_once()   # (each base variant's too)
        if _captures_piecewise(runner):
            _piecewise_graphs(runner).eager_forwards()
    finally:
        if lora is not None:
            lora.active = active


def capture_graphs(runner: ModelRunner) -> CapturedGraphs:
    """The decode graphs (workers/decode_graphs.py) and the piecewise graphs. On the CPU,
    LOOM_DECODE_GRAPHS_ON_CPU=1 runs the decode graphs' work uncaptured (tests). The runner
    holds none while they are captured (it has just allocated the cache, or woken up). Their
    kernels were compiled ahead in the warm-up's dry run (_graph_bodies)."""
    if not _captures(runner):
        return CapturedGraphs(None, None)
    lora = runner.lora.ctx if runner.lora is not None else None
    decode = DecodeGraphs(runner.model, runner.kv_caches, runner.config, runner.device, runner.backend,
                          runner.kv_splits, lora_ctx=lora, cascade=runner.cascade)
    decode.capture()
    if hasattr(runner.model, "capture_encoder_graphs") and envs.LOOM_ENCODER_GRAPHS:
        runner.model.capture_encoder_graphs(capture=runner.device.type == "cuda")
    return CapturedGraphs(decode, _capture_piecewise(runner) if _captures_piecewise(runner) else None)


def _piecewise_graphs(runner: ModelRunner) -> PiecewiseGraphs:
    return PiecewiseGraphs(runner.model, runner.kv_caches, runner.config.max_num_batched_tokens,
                           runner.model.config.num_attention_heads // tp_size(), runner.device,
                           runner.uses_mrope, runner.backend, runner.dtype)


def _capture_piecewise(runner: ModelRunner) -> PiecewiseGraphs:
    """The graphs of every other step (prefill, mixed), in pieces around attention."""
    t0 = time.perf_counter()
    graphs = _piecewise_graphs(runner)
    graphs.capture()
    logger.info("captured piecewise CUDA graphs of %d to %d tokens (%d sizes) in %.1fs",
                graphs.sizes[0], graphs.sizes[-1], len(graphs.sizes), time.perf_counter() - t0)
    return graphs
