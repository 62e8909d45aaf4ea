"""Every LOOM_* environment variable, in one table: its name, default, parser and meaning.

Read lazily, as vLLM's vllm/envs.py: `envs.LOOM_PDL` parses the environment at the moment of
the access, never at import, so a test's monkeypatch.setenv (or a parent that exports a value
before it starts its children) is seen by the next read. Product code reads LOOM_* variables
through this module only (tests/test_envs.py greps the source for any other read).

Switches accept the old spellings and the usual ones: "1"/"true"/"yes"/"on" and
"0"/"false"/"no"/"off" (any case); an empty or unknown value leaves the default, as before
(a default-on switch was off only for "0", a default-off one on only for "1").

Four of them are also engine flags, which win over the variable (the variable stays the default
source): LOOM_STEPS_IN_FLIGHT (--steps-in-flight), LOOM_ATTACHED_OUTPUT_HWM
(--attached-output-hwm), LOOM_WEIGHT_UPDATE_JOIN_TIMEOUT_S (--weight-update-join-timeout-s),
all three EngineConfig fields resolved in the parent (ipc/config.py), and LOOM_LOG_LEVEL
(`loom serve --log-level`, which exports it to every child process).

Set by our code for the processes it starts (children inherit the environment):
LOOM_RUN_ID (shm/object_store.run_id), LOOM_SERVE_PID (ipc/procs.py) and, across nodes, LOOM_ENGINE_AUTH_KEY
(frontend/entrypoints/launcher.py, from --engine-auth-key); LOOM_LOG_LEVEL from --log-level.

Test-only, read by the tests alone and not listed here: LOOM_TEST_* (opt-in test groups) and
LOOM_KERNEL_TESTS_CHILD (tests/test_kernels.py's child process).
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Callable

_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off")


def _switch(raw: str, default: bool) -> bool:
    value = raw.strip().lower()
    return True if value in _TRUE else False if value in _FALSE else default


def _int(raw: str, default: int | None) -> int | None:
    return int(raw) if raw.strip() else default


def _float(raw: str, default: float) -> float:
    return float(raw) if raw.strip() else default


def _text(raw: str, default: str | None) -> str | None:
    return raw or default


def _log_level(raw: str, default: str) -> str:
    return raw.strip().upper() or default


@dataclass(frozen=True)
class EnvVar:
    default: Any
    parse: Callable[[str, Any], Any]   # (the variable's text, the default) -> its value
    doc: str


ENVIRONMENT_VARIABLES: dict[str, EnvVar] = {
    # --- logging, security, run identity
    "LOOM_LOG_LEVEL": EnvVar("INFO", _log_level, "log level of every process (DEBUG, INFO, WARNING, ERROR); "
                             "`loom serve --log-level` sets it for the children"),
    "LOOM_ENGINE_AUTH_KEY": EnvVar(None, _text, "the engine protocol's shared secret (as --engine-auth-key, "
                                   "which wins); exported to the workers across nodes"),
    "LOOM_RUN_ID": EnvVar(None, _text, "this run's id in shared-memory segment names; made and exported by "
                          "the first process of a run (shm/object_store.run_id), inherited by its children"),
    "LOOM_SERVE_PID": EnvVar(None, _int, "the pid of `loom serve` (or a headless node), exported to its "
                             "children: a SIGTERM a child gets while its parent lives is passed there, which "
                             "drains and stops everyone (ipc/procs.py child_signals)"),
    "LOOM_ENGINE_STALL_S": EnvVar(5.0, _float, "seconds an engine may send nothing, not even its heartbeat "
                                  "(one a second), before an API server takes it as stalled: /health answers 503 "
                                  "and new requests go to other data-parallel ranks"),
    "LOOM_CHAT_TEMPLATE_TIMEOUT_S": EnvVar(5.0, _float, "seconds a request's own chat template "
                                           "(--trust-request-chat-template) may take to render, in the tokenizer "
                                           "process, before the request gets a 400"),
    "LOOM_CACHE_ROOT": EnvVar(os.path.join(os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"),
                                           "loom"), _text,
                              "directory of the caches kept across runs: Triton's compiled kernels in "
                              "triton/<Triton and torch versions>/ (ipc/compile_cache.py; TRITON_CACHE_DIR wins)"),
    "LOOM_ALLOW_RUNTIME_LORA_UPDATING": EnvVar(False, _switch, "1: serve POST /v1/load_lora_adapter and "
                                               "/v1/unload_lora_adapter without --enable-control-endpoints "
                                               "(vLLM's VLLM_ALLOW_RUNTIME_LORA_UPDATING)"),
    # --- engine loop (also flags)
    "LOOM_ENABLE_MULTIPROCESSING": EnvVar(True, _switch, "0: the offline LLM runs its engine core and one "
                                          "worker in the calling process (vLLM's VLLM_ENABLE_V1_MULTIPROCESSING); "
                                          "LLM(multiprocess=...) wins"),
    "LOOM_STEPS_IN_FLIGHT": EnvVar(None, _int, "steps the engine keeps in flight with async scheduling "
                                   "(unset: 3 on GPU, 2 on CPU); --steps-in-flight wins"),
    "LOOM_ATTACHED_OUTPUT_HWM": EnvVar(10_000, _int, "outputs queued for an attached client that does not "
                                       "read them before it is dropped; --attached-output-hwm wins"),
    "LOOM_RAY_PLACEMENT_TIMEOUT_S": EnvVar(300.0, _float, "seconds --distributed-executor-backend ray waits "
                                           "for its placement group (one bundle per rank) to be placed"),
    "LOOM_WEIGHT_UPDATE_JOIN_TIMEOUT_S": EnvVar(120.0, _float, "seconds /init_weights_update_group waits for "
                                                "the trainer's group to form; --weight-update-join-timeout-s wins"),
    # --- profiling and statistics
    "LOOM_TORCH_PROFILER_DIR": EnvVar(None, _text, "directory of torch profiler traces (as --profiler-dir, "
                                      "which wins)"),
    "LOOM_PROFILE_DIR": EnvVar(None, _text, "cProfile every process into DIR/<name>.prof (ipc/profiling.py)"),
    "LOOM_STEP_STATS": EnvVar("", _text, "per-step host/device time in the workers and the engine loop: "
                              "1 (on), sync (also warn at every host wait on the device), unset or 0 (off)"),
    "LOOM_DEBUG_DISABLE_GC": EnvVar(False, _switch, "1: the engine core runs without the cyclic garbage "
                                    "collector (leak tests)"),
    # --- kernels and graphs (A/B switches)
    "LOOM_PDL": EnvVar(True, _switch, "0: no programmatic dependent launch of the Triton kernels"),
    "LOOM_COMPILE_THREADS": EnvVar(None, _int, "compile processes (and threads) that compile a worker's "
                                   "start-up Triton kernels ahead of the phase that launches them "
                                   "(workers/compile_ahead.py; unset: one per CPU core, at most 16, none at "
                                   "TP > 1, the processes' cores shared among data-parallel engines; 0: each "
                                   "compiled at its first launch, one by one)"),
    "LOOM_ATTENTION_STREAMS": EnvVar(True, _switch, "0: a mixed step's prompt tiles and decodes launch one "
                                     "after the other, not on two streams"),
    "LOOM_CASCADE_ATTN": EnvVar("auto", _text, "cascade (prefix-aware) attention: auto (when a step's "
                                "sequences share a long enough prefix and its heuristic says it pays), 0 (never: "
                                "as --disable-cascade-attn), force (whenever they share a block: A/B runs, tests)"),
    "LOOM_CASCADE_PREFIX_SPLITS": EnvVar(0, _int, "KV splits of cascade attention's shared-prefix launch "
                                         "(0: chosen per step)"),
    "LOOM_CASCADE_BESIDE": EnvVar(False, _switch, "1: cascade attention's shared-prefix launch runs on a side "
                                  "stream beside its own-keys launch (an A/B)"),
    "LOOM_LONG_PREFILL_TILES": EnvVar("", _text, "BLOCK_M,BLOCK_N,WARPS,STAGES of paged attention's long-prefill "
                                      "tiles (chunks of >= 256 queries over >= 4,096 keys), or off: the short "
                                      "tiles and no causal split (unset: 128,64,8,3)"),
    # (the two below: on since session 34's H200 rows, top-p alone 0.983x, with penalties 0.937x of plain)
    "LOOM_TOP_P_RACE_CHUNKS": EnvVar(16, _int, "programs per row of the top-p route's second race (rows whose "
                                     "first race winner lay outside their top-p set; 0: the first race's split)"),
    "LOOM_PENALTY_HEAD_GRAPHS": EnvVar(True, _switch, "1: decode steps whose rows have repetition / presence / "
                                       "frequency penalties (and no other adjustment) sample in the decode graphs' "
                                       "penalty head, captured at a size's first such step; 0: eagerly"),
    "LOOM_GEMV": EnvVar(True, _switch, "0: no decode GEMV kernel (cuBLAS for every linear)"),
    "LOOM_MOE_GEMV_MAX_TOKENS": EnvVar(4, _int, "up to this many tokens the fused MoE runs its GEMV path "
                                       "(no alignment, no padding), above it the grouped GEMMs (0: never)"),
    "LOOM_MOE_GEMV_TILES": EnvVar("", _text, "the fused MoE GEMV path's tiles, UP_BLOCK_N,UP_BLOCK_K,"
                                  "DOWN_BLOCK_N,DOWN_BLOCK_K,num_warps (unset: 2,2048,2,256,4)"),
    "LOOM_W4A16_DENSE_ROWS": EnvVar(9, _int, "rows from which a W4A16 linear dequantizes its weight whole "
                                    "and runs cuBLAS (from 9 to this: the fused dequantizing GEMM; kernels/w4a16.py)"),
    "LOOM_W4A16_GEMV_TILES": EnvVar("", _text, "BLOCK_N,BLOCK_KW,WARPS,STAGES of the W4A16 decode GEMV "
                                    "at one row (bench/quant_kernels.py --sweep; empty: kernels/w4a16.gemv_tiles)"),
    "LOOM_FP8_GEMV": EnvVar("gemv", _text, "the FP8 decode GEMV: gemv (kernels/gemv.py's, fp8 weights, "
                            "norms fused) or legacy (kernels/fp8_linear.py's session-30 kernel)"),
    "LOOM_GENERIC_FUSED_LAYERS": EnvVar(True, _switch, "0: the generic Transformers path keeps HF's decoder-layer "
                                        "forwards (no fused add+norm; workers/models/transformers_fused.py)"),
    "LOOM_PIECEWISE_GRAPHS": EnvVar(True, _switch, "0: mixed and prompt steps run eagerly, not as "
                                    "piecewise CUDA graphs"),
    "LOOM_ENCODER_GRAPHS": EnvVar(True, _switch, "0: an encoder with one fixed input shape (Whisper's) runs "
                                  "eagerly, not in CUDA graphs for batches of up to 8 clips "
                                  "(workers/encoder_graphs.py)"),
    "LOOM_GRAMMAR_GRAPH_HEAD": EnvVar(True, _switch, "0: a structured-output decode step samples eagerly, "
                                      "not in the decode graph's grammar head"),
    "LOOM_SPEC_FULL_GRAPH": EnvVar(True, _switch, "0: speculative verify steps run in the piecewise graphs "
                                   "(attention eager), not in the decode graphs as one row per token"),
    "LOOM_LORA_BASE_GRAPHS": EnvVar(True, _switch, "with --enable-lora, each decode graph size is also captured "
                                    "without the LoRA ops, and a step with no adapter row replays that one; 0: "
                                    "every step replays the graphs with the LoRA ops (to time both)"),
    "LOOM_LORA_SORTED_ROWS": EnvVar(16, _int, "from this many rows to 256 (the decode batches), the LoRA shrink "
                                    "and expand take the rows in adapter order, a tensor-core tile product per "
                                    "32 rows of one adapter (kernels/lora.py), instead of one program per row; "
                                    "0: never (session 31's kernels)"),
    "LOOM_LORA_SHRINK_K_BLOCKS": EnvVar(4, _int, "K blocks (128 wide) per program of the LoRA shrink split over K "
                                        "at decode sizes (kernels/lora.py): fewer, more programs and partials"),
    "LOOM_LORA_PDL": EnvVar(True, _switch, "0: the LoRA shrink/expand kernels launch without programmatic "
                            "dependent launch (LOOM_PDL=0 turns it off everywhere)"),
    "LOOM_LORA_FUSED_SHRINK": EnvVar(True, _switch, "at batch 1, the LoRA shrink of q/k/v, gate/up and down runs "
                                     "in one kernel with the norm or SiLU that builds the linear's input "
                                     "(kernels/gemv.py lora_shrink_prologue); 0: that op's kernel, then the "
                                     "shrink's own"),
    "LOOM_LORA_FUSED_EXPAND": EnvVar(True, _switch, "at 1-8 rows, the LoRA expand runs in the epilogue of the "
                                     "base linear's GEMV (kernels/gemv.py); 0: its own kernel after it"),
    "LOOM_SPEC_FAST_HOST": EnvVar(True, _switch, "0: a verify step's host work as in session 31 (per-token "
                                  "sampling rows, the oracle drafter matching each request anew), for A/B runs"),
    "LOOM_SPEC_ASYNC": EnvVar(False, _switch, "1: with --speculative-config, the next step is scheduled while a "
                              "verify step runs (as if it accepts every draft) and the worker places its own "
                              "drafts and positions in it, so that two steps stay in flight; 0: one step in "
                              "flight while drafts wait to be verified"),
    "LOOM_WORKER_SPIN_MS": EnvVar(0.5, _float, "milliseconds a worker waiting for its next step busy-polls the "
                                  "step ring before it sleeps (a sleeping reader's wake-up costs ~40 us: "
                                  "shm/broadcast_ring.py); a verify step's next comes after the engine's round trip"),
    "LOOM_ENGINE_REPLY_SPIN_MS": EnvVar(0.0, _float, "milliseconds the engine core busy-polls for a step's reply "
                                        "before it blocks on the workers' sockets (a blocked wait wakes through "
                                        "ZMQ's threads); for A/B runs of speculation's round trip"),
    "LOOM_ENGINE_SWITCH_INTERVAL_MS": EnvVar(0.5, _float, "the engine core's GIL switch interval "
                                             "(sys.setswitchinterval; Python's default is 5): how long the busy loop "
                                             "may keep the GIL from the bitmask fill's thread once its fill is done"),
    "LOOM_DECODE_GRAPHS_ON_CPU": EnvVar(False, _switch, "1: on the CPU, run the decode graphs' work "
                                        "uncaptured (tests of the graph path)"),
    "LOOM_EAGLE_DRAFT_GRAPHS": EnvVar(True, _switch, "0: an EAGLE head's draft steps run eagerly, not as "
                                      "CUDA graphs"),
    # --- tensor-parallel all-reduce (workers/distributed.py)
    "LOOM_ONE_SHOT_ALLREDUCE_MAX_BYTES": EnvVar(1 << 20, _int, "largest all-reduce done one-shot over "
                                                "symmetric memory"),
    "LOOM_TWO_SHOT_ALLREDUCE_MAX_BYTES": EnvVar(16 << 20, _int, "largest all-reduce done two-shot (NCCL above)"),
    "LOOM_DISABLE_ONE_SHOT_ALLREDUCE": EnvVar(False, _switch, "1: NCCL for every all-reduce"),
    "LOOM_FUSED_ALLREDUCE_NORM": EnvVar(True, _switch, "0: no fused all-reduce + add + RMSNorm kernel"),
    "LOOM_FUSED_ALLREDUCE_NORM_MAX_BYTES": EnvVar(4 << 20, _int, "largest all-reduce fused with the next "
                                                  "RMSNorm (0: never)"),
    "LOOM_FUSED_ALLREDUCE_NORM_PROGRAMS": EnvVar(0, _int, "programs of the fused all-reduce + norm "
                                                 "(0: one per SM)"),
    "LOOM_LAMPORT_ALLREDUCE_MAX_ROWS": EnvVar(16, _int, "up to this many rows the fused all-reduce + norm "
                                              "pushes (Lamport) instead of pulling (0: never)"),
    "LOOM_ONE_SHOT_GATHER_MAX_BYTES": EnvVar(1 << 20, _int, "largest per-rank logits the vocab-parallel "
                                             "lm_head gathers with its own kernel (NCCL above)"),
    # --- multimodal inputs (multimodal/processor.py)
    "LOOM_MEDIA_LOADING_THREAD_COUNT": EnvVar(8, _int, "threads of an API server that decode and process "
                                              "images and audio (vLLM's VLLM_MEDIA_LOADING_THREAD_COUNT)"),
}


def read(name: str) -> Any:
    """The variable's value now: parsed from the environment, or its default when unset."""
    var = ENVIRONMENT_VARIABLES[name]
    raw = os.environ.get(name)
    if raw is None:
        return var.default
    try:
        return var.parse(raw, var.default)
    except ValueError:
        raise ValueError(f"{name}={raw!r} is not valid: {var.doc}") from None


def __getattr__(name: str) -> Any:
    if name in ENVIRONMENT_VARIABLES:
        return read(name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted([*globals(), *ENVIRONMENT_VARIABLES])
