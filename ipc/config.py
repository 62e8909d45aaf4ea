"""EngineConfig: every option of `loom serve` and `LLM(...)` that the engine
core and workers need. Resolved once (model config read, defaults filled,
limits checked) before any process starts."""
from __future__ import annotations

import json
import logging
import os
from dataclasses import asdict, dataclass, field, fields
from typing import Callable

from ipc import envs


logger = logging.getLogger("loom.config")

# the request fields a generation_config.json (or --override-generation-config) may default, as vLLM
GENERATION_DEFAULT_FIELDS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")
# transformers' GenerationConfig defaults: a file value equal to one of these is not a
# recommendation (vLLM reads the file through GenerationConfig.to_diff_dict())
_HF_GENERATION_DEFAULTS = {"temperature": 1.0, "top_p": 1.0, "top_k": 50, "min_p": None, "repetition_penalty": 1.0}


class ConfigError(ValueError):
    """A configuration that can never work; reported at start-up."""


def option(default, help: str, choices: tuple | None = None, aliases: tuple[str, ...] = ()):
    """An EngineConfig field that is also a `loom serve` flag: its help (and choices, and short
    aliases such as -tp) live here, beside the default, so the CLI, `LLM(...)` and the bench
    commands describe it the same way."""
    meta = {"help": help, "choices": choices, "aliases": aliases}
    if isinstance(default, (list, dict)):
        return field(default_factory=lambda: type(default)(default), metadata=meta)
    return field(default=default, metadata=meta)


@dataclass
class EngineConfig:
    model: str
    served_model_name: str | None = option(None, "the model name clients send (default: the model directory)")
    tokenizer: str | None = option(None, "tokenizer directory or Hugging Face Hub id (default: the model's)")
    revision: str | None = option(None, "the Hub revision (branch, tag or commit) of a model given by id "
                                  "(default: main)")
    tokenizer_revision: str | None = option(None, "the Hub revision of the tokenizer (default: --revision "
                                            "when the tokenizer is the model's)")
    download_dir: str | None = option(None, "the Hub cache that model ids are downloaded to and read from "
                                      "(default: huggingface_hub's, $HF_HUB_CACHE or $HF_HOME/hub)")
    trust_remote_code: bool = option(False, "let the tokenizer and image processor run the checkpoint's own "
                                     "code (never the model's: its class comes from workers/models/)")
    dtype: str = option("auto", "weights and activations; auto: bfloat16 on GPU, float32 on CPU",
                        ("auto", "bfloat16", "float16", "float32", "half", "float"))
    device: str = option("auto", "where the workers run; auto: CUDA if available, else CPU", ("auto", "cpu", "cuda"))
    load_format: str = option("auto", "auto/safetensors: read the checkpoint; dummy: random weights from "
                              "config.json alone (benchmarks)", ("auto", "safetensors", "dummy"))
    quantization: str | None = option(None, "weight quantization (vLLM's --quantization): fp8 quantizes a float "
                                      "checkpoint online (per-channel e4m3 weights, per-token activations); "
                                      "gptq, awq, compressed-tensors and fp8 checkpoints are detected from "
                                      "config.json's quantization_config (None/auto: the checkpoint's); with "
                                      "--load-format dummy, random weights in the format's layout",
                                      ("auto", "fp8", "gptq", "awq", "compressed-tensors"), aliases=("-q",))
    model_impl: str = option("auto", "which implementation runs the model: loom (Loom's own file for the "
                             "architecture), transformers (the generic path: the transformers model with Loom's "
                             "paged attention, for any decoder-only *ForCausalLM), auto (loom where the "
                             "architecture has a file, else transformers)", ("auto", "loom", "transformers"))
    seed: int = option(0, "seed of the workers' random state (dummy weights)")
    runner: str = option("auto", "generate: a text generator; pooling: a pooling model (embeddings, "
                         "classification, scores: /v1/embeddings, /classify, /score, /rerank; prefill only); "
                         "auto: pooling for *ForSequenceClassification (and --convert embed/classify), else "
                         "generate", ("auto", "generate", "pooling"))
    convert: str = option("auto", "how a pooling runner uses the model: embed (the pooled hidden state), "
                          "classify (through its `score` head, or one made of vocabulary rows by hf_overrides' "
                          "classifier_from_token); auto: classify for *ForSequenceClassification, else embed",
                          ("auto", "none", "embed", "classify"))
    pooler_config: dict = option({}, "the pooler, as vLLM's JSON: {\"pooling_type\": \"LAST\"|\"MEAN\"|\"CLS\", "
                                 "\"normalize\": true|false} (default: LAST, normalised embeddings)")
    hf_overrides: dict = option({}, "JSON object merged over the model's config.json, e.g. Qwen3-Reranker's "
                                "'{\"architectures\": [\"Qwen3ForSequenceClassification\"], "
                                "\"classifier_from_token\": [\"no\", \"yes\"], \"is_original_qwen3_reranker\": true}'")
    max_model_len: int | None = option(None, "longest sequence (prompt + output); default: the model's")
    max_num_seqs: int = option(256, "most requests in one step")
    scheduling_policy: str = option("fcfs", "fcfs: waiting requests run in arrival order, and preemption takes "
                                    "the newest running one; priority: by each request's `priority` (lower "
                                    "first, then arrival), and preemption takes the lowest", ("fcfs", "priority"))
    max_num_batched_tokens: int | None = option(None, "token budget of one step (default: max(8192, --max-num-seqs))")
    block_size: int = option(16, "tokens per KV-cache block (a power of two)")
    num_gpu_blocks_override: int | None = option(None, "a fixed number of KV-cache blocks instead of the profiled one")
    gpu_memory_utilization: float = option(0.9, "fraction of GPU memory for weights, activations and KV cache")
    kv_cache_memory_bytes: int | None = option(None, "CPU: bytes of KV cache (default: room for --max-num-seqs "
                                               "full requests, as --sliding-window-kv-trim holds them, at most 2 GiB)")
    kv_cache_dtype: str = option("auto", "KV cache storage: auto (the model's dtype), fp8 / fp8_e4m3 (float8 e4m3 "
                                 "with a per-layer scale for keys and one for values: twice the blocks in the "
                                 "same memory)", ("auto", "fp8", "fp8_e4m3"))
    calculate_kv_scales: bool = option(False, "with --kv-cache-dtype fp8: compute each layer's k/v scales from "
                                       "the first batch (its amax over 200 / 100, as vLLM) instead of the "
                                       "checkpoint's k_scale / v_scale or 1.0")
    enable_prefix_caching: bool = option(True, "reuse the KV blocks of shared prompt prefixes")
    disable_cascade_attn: bool = option(False, "never run cascade attention (vLLM's flag): by default a step "
                                        "whose requests share a long prefix's KV blocks reads them once for the "
                                        "step when its heuristic says it pays (LOOM_CASCADE_ATTN)")
    sliding_window_kv_trim: bool = option(True, "when every attention layer of the model is local with one "
                                          "window (Mistral v0.1, Qwen2 with use_sliding_window on all layers), "
                                          "free each request's KV blocks that fall behind the window; a model "
                                          "with global layers keeps all its blocks (they need them)")
    kv_offloading_size: float | None = option(None, "GiB of host memory (over all tensor-parallel ranks) for a "
                                              "CPU tier of the KV cache: prefix-cache blocks evicted from the GPU "
                                              "are kept there and loaded back on a hit instead of recomputed")
    kv_offloading_backend: str | None = option(None, "the CPU tier's implementation (with --kv-offloading-size; "
                                               "default native)", ("native",))
    kv_events_config: dict = option({}, "publish KV-cache events (BlockStored / BlockRemoved / AllBlocksCleared) "
                                     "as vLLM does, e.g. '{\"enable_kv_cache_events\": true, \"publisher\": \"zmq\", "
                                     "\"endpoint\": \"tcp://*:5557\", \"topic\": \"kv-events\", \"replay_endpoint\": "
                                     "\"tcp://*:5558\"}' (ports + data-parallel rank); README 'KV-cache events'")
    enforce_eager: bool = option(False, "no CUDA graphs")
    cuda_graph_sizes: list[int] | None = option(None, "batch sizes of the decode CUDA graphs: one value N "
                                                "captures 1, 2, 4, 8, 16, then every 32 up to N; several, "
                                                "exactly those; a larger batch runs eagerly (default: that "
                                                "pattern up to min(--max-num-seqs, 512))")
    attention_backend: str = option("auto", "auto: Triton on GPU, torch on CPU", ("auto", "torch", "triton"))
    async_scheduling: bool = option(True, "schedule step N+1 while step N runs (same output; "
                                    "--no-async-scheduling turns it off)")
    tensor_parallel_size: int = option(1, "GPUs (worker processes, one per GPU) one model is split over; "
                                       "on CPU, processes (gloo)", aliases=("-tp",))
    distributed_executor_backend: str = option("mp", "how the workers run: mp = one local process per "
                                               "rank; ray = Ray actors on a placement group of the Ray "
                                               "cluster (RAY_ADDRESS, or a local one), across its nodes; "
                                               "needs pip install 'loom[ray]'", ("mp", "ray"))
    nnodes: int = option(1, "nodes the tensor-parallel ranks span (each runs tensor_parallel_size / "
                         "nnodes workers)")
    node_rank: int = option(0, "this node's rank: 0 runs the engine and API servers, the others run "
                            "`loom serve MODEL --headless` with their workers")
    master_addr: str = option("127.0.0.1", "address of node 0, where the ranks meet (torch.distributed "
                              "TCP rendezvous and the step broadcast); with --nnodes > 1")
    master_port: int = option(29501, "port of the rendezvous on node 0 (the step broadcast uses the "
                              "next port); with --nnodes > 1 (one node picks a free port)")
    data_parallel_size: int = option(1, "engine cores (replicas of the model, each with its own workers and "
                                     "GPUs) that share the requests; DP x TP GPUs in all", aliases=("-dp",))
    enable_expert_parallel: bool = option(False, "MoE layers place whole experts on the tensor-parallel "
                                          "ranks (contiguous blocks, uneven counts allowed) instead of a slice "
                                          "of every expert on each; attention stays tensor-parallel")
    enable_sleep_mode: bool = option(False, "allow sleep levels 1 and 2 (weights offloaded / discarded)")
    max_logprobs: int = option(20, "largest logprobs / prompt_logprobs a request may ask for (-1: no limit)")
    generation_config: str = option("auto", "request sampling defaults: auto: the model's generation_config.json; "
                                    "vllm: none (the API's own defaults); or a directory holding a "
                                    "generation_config.json")
    override_generation_config: str | None = option(
        None, "JSON object of sampling defaults (temperature, top_p, top_k, min_p, repetition_penalty), e.g. "
        "'{\"temperature\": 0.5}', merged over --generation-config's (alone with vllm)")
    reasoning_parser: str | None = option(None, "split the model's thinking (<think>...</think>) into "
                                          "reasoning_content; a grammar applies after it", ("qwen3", "deepseek_r1", "openai_gptoss"))
    enable_auto_tool_choice: bool = option(False, "tool_choice 'auto': parse the model's own tool calls "
                                           "(needs --tool-call-parser)")
    tool_call_parser: str | None = option(None, "the model's tool-call syntax, for tool_choice 'auto'",
                                          ("hermes", "llama3_json", "gpt_oss", "qwen3_coder", "mistral", "pythonic",
                                           "deepseek_v3"))
    disable_log_stats: bool = option(False, "no periodic stats log line")
    log_stats_interval: float = option(10.0, "seconds between stats log lines while busy")
    limit_mm_per_prompt: dict = option({}, "most items of each modality in one prompt, e.g. "
                                       "--limit-mm-per-prompt.image 2 or '{\"image\": 2}' (default: 999 each)")
    language_model_only: bool = option(False, "serve a vision-language model as text only: every modality "
                                       "limit 0, the vision tower not loaded")
    allowed_local_media_path: str | None = option(None, "a directory whose files requests may name as "
                                                  "file:// image URLs (default: none)")
    mm_processor_cache_gb: float = option(1.0, "size of each API server's shared-memory store of processed "
                                          "images (GiB)")
    profiler_dir: str | None = option(None, "directory of torch profiler traces (/start_profile, /stop_profile); "
                                      "default: $LOOM_TORCH_PROFILER_DIR")
    steps_in_flight: int | None = option(None, "steps the engine keeps in flight with async scheduling "
                                         "(None: $LOOM_STEPS_IN_FLIGHT, else 3 on GPU, 2 on CPU)")
    attached_output_hwm: int | None = option(None, "outputs the engine queues for an attached client that does not "
                                             "read them before it drops the client (None: "
                                             "$LOOM_ATTACHED_OUTPUT_HWM, else 10000)")
    weight_update_join_timeout_s: float | None = option(None, "seconds /init_weights_update_group waits for the "
                                                        "trainer's group to form (None: "
                                                        "$LOOM_WEIGHT_UPDATE_JOIN_TIMEOUT_S, else 120)")
    speculative_config: dict = option({}, "speculative decoding, as vLLM's JSON: {\"method\": \"ngram\" | "
                                      "\"draft_model\" | \"oracle\" (measurement only), \"num_speculative_tokens\": k, "
                                      "\"model\": draft model directory, \"prompt_lookup_min\"/\"prompt_lookup_max\", "
                                      "\"disable_by_batch_size\": N} (default: off; see README)")
    enable_lora: bool = option(False, "serve LoRA adapters (PEFT format) beside the base model: per-request "
                               "adapters in GPU slots, batched together (workers/lora/)")
    max_loras: int = option(1, "with --enable-lora: GPU slots, the most distinct adapters in one step")
    max_lora_rank: int = option(16, "with --enable-lora: the largest adapter rank served (the slots' size)")
    max_cpu_loras: int | None = option(None, "with --enable-lora: adapters kept in CPU memory, least recently "
                                       "used dropped first (default: --max-loras)")
    # filled in by resolve()
    model_max_len: int = 0
    vocab_size: int = 0
    eos_token_ids: list[int] = field(default_factory=list)
    default_sampling_params: dict = field(default_factory=dict)  # for fields a request does not set
    mm_max_item_tokens: int = 0     # placeholder tokens of the largest image the processor can produce
    mm_encoder_budget: int = 0      # encoder output tokens per step (0: no images)
    mm_modality: str = "image"      # what the model's items are: "image" or "audio" (its MultiModalInfo's)
    stepwise_prompt_tokens: int = 0  # prompts this short go a token per step beside others (MultiModalInfo's)
    # set by each engine core for its workers
    data_parallel_rank: int = 0     # this engine's rank among --data-parallel-size

    @property
    def speculative(self) -> "SpeculativeConfig | None":
        """speculative_config as its typed struct (None: speculation off)."""
        return SpeculativeConfig.parse(self.speculative_config)

    @property
    def model_name(self) -> str:
        return self.served_model_name or self.model

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "EngineConfig":
        names = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in names})

    def resolve(self, multimodal_info: Callable[[str], object | None] | None = None,
                check_architecture: Callable[["EngineConfig"], None] | None = None) -> "EngineConfig":
        """Read the model's config.json, fill defaults and fail early on impossible sizes.

        multimodal_info: model directory -> the model's MultiModalInfo (None: text-only), as
        workers.models.registry.multimodal_info answers; the entry points pass it (ipc/ cannot
        import the models). Without it the model is resolved as text-only.
        check_architecture: raises ConfigError when no implementation serves the model under
        --model-impl (workers.models.registry.check_architecture); without it the workers do."""
        self._check_option_types()
        path = os.path.join(self.model, "config.json")
        if not os.path.isfile(path):
            raise ConfigError(f"model directory {self.model!r} has no config.json")
        hf = read_json_object(path)
        text_cfg = hf.get("text_config", hf)
        if not isinstance(text_cfg, dict):
            raise ConfigError(f"{path}: text_config is not an object")
        try:
            self.model_max_len = int(text_cfg.get("max_position_embeddings") or text_cfg.get("max_target_positions") or 2048)
            self.vocab_size = int(text_cfg.get("vocab_size") or 0)
        except (TypeError, ValueError) as e:
            raise ConfigError(f"{path}: {e}") from None
        limit = f"max_position_embeddings {self.model_max_len}"
        if self.max_model_len is None:
            self.max_model_len = self.model_max_len
        if self.max_logprobs == -1:   # vLLM's "no limit": the whole vocabulary
            self.max_logprobs = self.vocab_size or 2 ** 31 - 1
        if self.max_model_len > self.model_max_len:
            raise ConfigError(f"--max-model-len {self.max_model_len} exceeds the model's {limit}")
        if self.max_num_batched_tokens is None:
            self.max_num_batched_tokens = max(8192, self.max_num_seqs)
        self.eos_token_ids = _eos_token_ids(self.model, text_cfg, self.tokenizer_dir, self.vocab_size)
        self.default_sampling_params = self._generation_defaults()
        self._resolve_multimodal(hf, multimodal_info(self.model) if multimodal_info else None)
        from ipc.pooling import resolve_pooling
        resolve_pooling(self, {**hf, **self.hf_overrides})   # --runner, --convert, --pooler-config
        if self.profiler_dir is None:
            self.profiler_dir = envs.LOOM_TORCH_PROFILER_DIR or None
        self._resolve_env_defaults()
        self.check()
        check_device(self)
        if check_architecture is not None:   # first: the generic path refuses TP > 1 before its sizes are read
            check_architecture(self)
        check_tensor_parallel(self, text_cfg)
        return self

    def _resolve_env_defaults(self) -> None:
        """The flags that default to a LOOM_* variable: read here, in the process that resolves the
        config, so that the value travels with it to the engine core and the workers (a flag wins)."""
        if self.steps_in_flight is None:
            self.steps_in_flight = envs.LOOM_STEPS_IN_FLIGHT
        if self.attached_output_hwm is None:
            self.attached_output_hwm = envs.LOOM_ATTACHED_OUTPUT_HWM
        if self.weight_update_join_timeout_s is None:
            self.weight_update_join_timeout_s = envs.LOOM_WEIGHT_UPDATE_JOIN_TIMEOUT_S

    def _generation_defaults(self) -> dict:
        """--generation-config and --override-generation-config -> the sampling defaults in use."""
        src = {"auto": self.model, "vllm": None}.get(self.generation_config, self.generation_config)
        defaults = {}
        if src is not None:
            path = os.path.join(src, "generation_config.json")
            if self.generation_config not in ("auto", "vllm") and not os.path.isfile(path):
                raise ConfigError(f"--generation-config {src!r} has no generation_config.json")
            if os.path.isfile(path):
                gen = read_json_object(path)
                defaults = {k: gen[k] for k in GENERATION_DEFAULT_FIELDS
                            if k in gen and gen[k] is not None and gen[k] != _HF_GENERATION_DEFAULTS[k]}
        override = self.override_generation_config
        if isinstance(override, str):
            try:
                override = json.loads(override)
            except json.JSONDecodeError as e:
                raise ConfigError(f"--override-generation-config is not valid JSON: {e}") from None
        if override is not None and not isinstance(override, dict):
            raise ConfigError("--override-generation-config must be a JSON object")
        defaults.update(override or {})
        unknown = set(defaults) - set(GENERATION_DEFAULT_FIELDS)
        if unknown:
            raise ConfigError(f"--override-generation-config: unsupported fields {sorted(unknown)} "
                              f"(supported: {', '.join(GENERATION_DEFAULT_FIELDS)})")
        if defaults:
            logger.info("default sampling parameters (for fields a request does not set): %s%s", defaults,
                        "; --generation-config vllm ignores the model's" if self.generation_config == "auto" else "")
        return defaults

    def _resolve_multimodal(self, hf: dict, info) -> None:
        """info: the model's MultiModalInfo, None for a text-only model."""
        limits = self.limit_mm_per_prompt
        try:
            if isinstance(limits, str):
                limits = json.loads(limits)
            if not isinstance(limits, dict) or not all(type(v) is int for v in limits.values()):
                raise ValueError("it must be a JSON object of integers, such as {\"image\": 2}")
        except ValueError as e:   # (json.JSONDecodeError is one)
            raise ConfigError(f"--limit-mm-per-prompt: {e}") from None
        self.limit_mm_per_prompt = {str(k): v for k, v in limits.items()}
        for k, v in self.limit_mm_per_prompt.items():
            if v < 0 or (k not in ("image", "audio") and v > 0):
                raise ConfigError(f"--limit-mm-per-prompt: {k}={v} (images and audio are supported, limits >= 0)")
        self.mm_modality = info.modality if info is not None else "image"
        if info is not None and not getattr(info, "prefix_caching", True):
            self.enable_prefix_caching = False   # (an encoder-decoder's: every decoder token depends on its audio)
        self.mm_max_item_tokens = info.max_item_tokens(self.model, hf) if info is not None else 0
        self.stepwise_prompt_tokens = getattr(info, "stepwise_prompt_tokens", 0) if info is not None else 0
        if self.language_model_only or self.mm_max_item_tokens == 0:
            self.mm_encoder_budget = 0
        else:
            # never underestimated: every step can encode the largest image there is
            self.mm_encoder_budget = max(self.mm_max_item_tokens, self.max_num_batched_tokens)

    def mm_limit(self, modality: str) -> int:
        """Items of a modality one prompt may carry (0: none, e.g. a text-only model)."""
        if not self.mm_encoder_budget or modality != self.mm_modality:
            return 0
        return self.limit_mm_per_prompt.get(modality, 999)

    @property
    def tokenizer_dir(self) -> str:
        """Where the tokenizer is loaded from: --tokenizer, else the model directory."""
        return self.tokenizer or self.model

    def check(self) -> None:
        if self.max_logprobs < -1:
            raise ConfigError(f"--max-logprobs must be at least -1 (no limit), got {self.max_logprobs}")
        if not -2 ** 63 <= self.seed < 2 ** 64:   # torch.manual_seed's range
            raise ConfigError(f"--seed must be in [-2**63, 2**64), got {self.seed}")
        if self.kv_offloading_size is not None and not self.kv_offloading_size > 0:
            raise ConfigError(f"--kv-offloading-size must be above 0 (GiB), got {self.kv_offloading_size}")
        if self.kv_offloading_backend is not None and self.kv_offloading_size is None:
            raise ConfigError("--kv-offloading-backend needs --kv-offloading-size")
        if self.kv_offloading_size is not None and not self.enable_prefix_caching:
            raise ConfigError("--kv-offloading-size needs prefix caching (it keeps evicted prefix-cache blocks)")
        if self.kv_cache_memory_bytes is not None and self.kv_cache_memory_bytes < 1:
            raise ConfigError(f"--kv-cache-memory-bytes must be at least 1, got {self.kv_cache_memory_bytes}")
        if self.mm_processor_cache_gb < 0:
            raise ConfigError(f"--mm-processor-cache-gb must be at least 0, got {self.mm_processor_cache_gb}")
        if self.steps_in_flight is not None and self.steps_in_flight < 1:
            raise ConfigError(f"--steps-in-flight must be at least 1, got {self.steps_in_flight}")
        if self.attached_output_hwm < 1:
            raise ConfigError(f"--attached-output-hwm must be at least 1, got {self.attached_output_hwm}")
        if not self.weight_update_join_timeout_s > 0:
            raise ConfigError(f"--weight-update-join-timeout-s must be above 0, got {self.weight_update_join_timeout_s}")
        if not self.log_stats_interval > 0:
            raise ConfigError(f"--log-stats-interval must be above 0, got {self.log_stats_interval}")
        if self.max_model_len < 1:
            raise ConfigError(f"--max-model-len must be at least 1, got {self.max_model_len}")
        spec = self.speculative   # (raises ConfigError for a bad one)
        if spec is not None and spec.model is not None and self.vocab_size:
            draft_cfg = read_json_object(os.path.join(spec.model, "config.json"))
            draft_cfg = draft_cfg.get("transformer_layer_config") or draft_cfg   # (an EAGLE head's speculators format)
            draft_vocab = int(draft_cfg.get("vocab_size") or 0)
            if draft_vocab != self.vocab_size:
                raise ConfigError(f"--speculative-config: the draft model's vocab_size {draft_vocab} differs from "
                                  f"the target's {self.vocab_size} (a draft model must share the tokenizer)")
        if self.max_num_seqs < 1:
            raise ConfigError(f"--max-num-seqs must be at least 1, got {self.max_num_seqs}")
        if self.max_num_batched_tokens < 1:
            raise ConfigError(f"--max-num-batched-tokens must be at least 1, got {self.max_num_batched_tokens}")
        if self.max_num_batched_tokens < self.max_num_seqs:
            raise ConfigError(f"--max-num-batched-tokens ({self.max_num_batched_tokens}) must be at least "
                              f"--max-num-seqs ({self.max_num_seqs}): every running request needs one token per step")
        if self.block_size < 1 or self.block_size & (self.block_size - 1):
            raise ConfigError(f"--block-size must be a power of two, got {self.block_size}")
        if self.num_gpu_blocks_override is not None and self.num_gpu_blocks_override < 1:
            raise ConfigError(f"--num-gpu-blocks-override must be at least 1, got {self.num_gpu_blocks_override}")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ConfigError(f"--gpu-memory-utilization must be in (0, 1], got {self.gpu_memory_utilization}")
        if self.load_format not in ("auto", "safetensors", "dummy"):
            raise ConfigError(f"--load-format must be auto, safetensors or dummy, got {self.load_format!r}")
        if self.enable_auto_tool_choice and not self.tool_call_parser:
            raise ConfigError("--enable-auto-tool-choice needs --tool-call-parser (hermes or llama3_json)")
        if self.max_loras < 1 or self.max_lora_rank < 1:
            raise ConfigError(f"--max-loras and --max-lora-rank must be at least 1, got {self.max_loras} and "
                              f"{self.max_lora_rank}")
        if self.max_cpu_loras is not None and self.max_cpu_loras < self.max_loras:
            raise ConfigError(f"--max-cpu-loras ({self.max_cpu_loras}) must be at least --max-loras ({self.max_loras})")
        tp, nodes = self.tensor_parallel_size, self.nnodes
        if tp < 1:
            raise ConfigError(f"--tensor-parallel-size must be at least 1, got {tp}")
        if self.distributed_executor_backend not in ("mp", "ray"):
            raise ConfigError(f"--distributed-executor-backend must be mp or ray, "
                              f"got {self.distributed_executor_backend!r}")
        if self.distributed_executor_backend == "ray" and nodes > 1:
            raise ConfigError("--distributed-executor-backend ray places the ranks on the Ray cluster's "
                              "nodes itself: drop --nnodes")
        if nodes < 1 or tp % nodes:
            raise ConfigError(f"--nnodes ({nodes}) must divide --tensor-parallel-size ({tp})")
        if not 0 <= self.node_rank < nodes:
            raise ConfigError(f"--node-rank must be in [0, {nodes}), got {self.node_rank}")
        if self.data_parallel_size < 1:
            raise ConfigError(f"--data-parallel-size must be at least 1, got {self.data_parallel_size}")
        if self.data_parallel_size > 1 and nodes > 1:
            raise ConfigError("--data-parallel-size > 1 with --nnodes > 1 is not supported: each data-parallel "
                              "rank runs its tensor-parallel workers on one node")

    def _check_option_types(self) -> None:
        """Every numeric option's type and every option's choices: `loom serve`'s parser checks
        them, LLM(...)'s keyword arguments reach here unchecked."""
        for f in fields(self):
            if "help" not in f.metadata:
                continue
            value, kind = getattr(self, f.name), str(f.type).split(" |")[0]
            if value is None and "None" in str(f.type):
                continue
            ok = {"int": type(value) is int, "float": type(value) in (int, float), "bool": type(value) is bool,
                  "list[int]": isinstance(value, list) and len(value) > 0
                  and all(type(v) is int and v > 0 for v in value)}.get(kind, True)
            choices = f.metadata.get("choices")
            if not ok or choices and value not in choices:
                want = f"one of {', '.join(map(str, choices))}" if choices else f"an {kind}" if kind == "int" else \
                    "a list of positive ints" if kind == "list[int]" else f"a {kind}"
                raise ConfigError(f"--{f.name.replace('_', '-')} must be {want}, got {value!r}")

    def check_num_blocks(self, num_blocks: int, kv_window: int | None = None) -> None:
        """A request of max_model_len tokens must fit in the KV cache, or it could never run.
        kv_window: the window its blocks are trimmed to (engine_core/kv_cache_manager.py), if any."""
        need = max_blocks_held(self.max_model_len, self.block_size, kv_window, self.max_num_batched_tokens)
        if num_blocks < need:
            raise ConfigError(
                f"the KV cache has {num_blocks} blocks of {self.block_size} tokens "
                f"({num_blocks * self.block_size} tokens), but one request of --max-model-len "
                f"{self.max_model_len} needs {need} blocks. Lower --max-model-len or give the "
                f"KV cache more memory (--gpu-memory-utilization / --num-gpu-blocks-override).")


def weight_quantization(config: EngineConfig) -> str | None:
    """The weights' quantization method as vLLM names it (--quantization, else config.json's
    quantization_config.quant_method; None: unquantized), for /v1/models."""
    if config.quantization not in (None, "auto"):
        return config.quantization
    try:
        hf = read_json_object(os.path.join(config.model, "config.json"))
    except (ConfigError, OSError):
        return None
    qc = hf.get("quantization_config") or (hf.get("text_config") or {}).get("quantization_config")
    return str(qc.get("quant_method")) if isinstance(qc, dict) and qc.get("quant_method") else None


def max_blocks_held(max_model_len: int, block_size: int, kv_window: int | None, max_chunk: int) -> int:
    """The most KV blocks one request holds at once: its whole context, or with its blocks trimmed
    to a window W, a chunk of up to max_chunk queries and the W - 1 keys before the first one
    (spanning one block more when they start inside a block)."""
    whole = -(-max_model_len // block_size)
    if kv_window is None:
        return whole
    return min(whole, -(-(kv_window - 1 + max_chunk) // block_size) + 1)


def check_device(config: EngineConfig) -> None:
    """A device or dtype that can never work fails here, in the parent, with one line, rather than
    with a traceback in every worker. torch is imported only for an explicit --device cuda."""
    choices = {f.name: f.metadata.get("choices") for f in fields(EngineConfig)}
    for name in ("dtype", "device"):
        allowed = choices[name]
        if getattr(config, name) not in allowed:
            raise ConfigError(f"--{name} must be one of {', '.join(allowed)}, got {getattr(config, name)!r}")
    if config.device != "cuda":
        return
    import torch
    if not torch.cuda.is_available():
        raise ConfigError("--device cuda, but no CUDA GPU is visible here (check the driver and "
                          "CUDA_VISIBLE_DEVICES, or use --device cpu)")


def check_tensor_parallel(config: EngineConfig, hf_cfg: dict) -> None:
    """The model must split over the ranks, and this node must have a GPU per local rank."""
    tp = config.tensor_parallel_size
    if tp == 1:
        return
    heads = int(hf_cfg.get("num_attention_heads") or 0)
    kv_heads = int(hf_cfg.get("num_key_value_heads") or heads)
    inter = int(hf_cfg.get("intermediate_size") or 0)
    if heads % tp:
        raise ConfigError(f"--tensor-parallel-size {tp} does not divide the model's {heads} attention heads")
    if kv_heads >= tp and kv_heads % tp:
        raise ConfigError(f"--tensor-parallel-size {tp} does not divide the model's {kv_heads} KV heads")
    if kv_heads < tp and tp % kv_heads:
        raise ConfigError(f"the model's {kv_heads} KV heads cannot be replicated evenly over "
                          f"--tensor-parallel-size {tp} ranks (it must be a multiple of {kv_heads})")
    # the experts' own width (Qwen-MoE's moe_intermediate_size; Mixtral's and gpt-oss's experts
    # are intermediate_size wide, and they have no dense MLP): whole experts need no split under EP
    expert_inter = int(hf_cfg.get("moe_intermediate_size") or 0)
    if hf_cfg.get("num_local_experts") and not expert_inter:
        expert_inter, inter = inter, 0
    if inter % tp:
        raise ConfigError(f"--tensor-parallel-size {tp} does not divide the model's intermediate size {inter}")
    shared = int(hf_cfg.get("shared_expert_intermediate_size") or 0)   # tensor-parallel under EP too
    if shared % tp:
        raise ConfigError(f"--tensor-parallel-size {tp} does not divide the model's shared expert intermediate "
                          f"size {shared}")
    if expert_inter % tp and not config.enable_expert_parallel:
        raise ConfigError(f"--tensor-parallel-size {tp} does not divide the model's expert intermediate size "
                          f"{expert_inter} (--enable-expert-parallel places whole experts on the ranks instead)")
    if config.device == "cpu" or config.distributed_executor_backend == "ray":
        return   # Ray: the placement group finds the GPUs across the cluster
    import torch
    have = torch.cuda.device_count() if torch.cuda.is_available() else 0
    need = tp // config.nnodes
    if config.device == "auto" and have == 0:
        return  # the CPU: one gloo process per rank
    if have < need:
        where = "this node" if config.nnodes > 1 else "this machine"
        raise ConfigError(f"--tensor-parallel-size {tp} needs {need} GPUs on {where}, but only {have} "
                          f"{'is' if have == 1 else 'are'} visible (CUDA_VISIBLE_DEVICES)")


def _eos_token_ids(model_dir: str, hf_cfg: dict, tokenizer_dir: str | None = None, vocab_size: int = 0) -> list[int]:
    """generation_config.json's, config.json's and the tokenizer's EOS ids, merged as vLLM does
    (the tokenizer's eos_token is always a stop token; the configs may add more). A tokenizer id
    outside the model's vocabulary (a stand-in tokenizer) is left out: it can never be sampled."""
    ids: list[int] = []
    gen_path = os.path.join(model_dir, "generation_config.json")
    sources = [hf_cfg]
    if os.path.isfile(gen_path):
        sources.insert(0, read_json_object(gen_path))
    for src in sources:
        eos = src.get("eos_token_id")
        if eos is None:
            continue
        for tok in eos if isinstance(eos, list) else [eos]:
            if type(tok) is not int:
                raise ConfigError(f"eos_token_id must be token ids, got {eos!r} (in {model_dir})")
            if tok not in ids:
                ids.append(tok)
    tok = tokenizer_eos_token_id(tokenizer_dir) if tokenizer_dir and os.path.isdir(tokenizer_dir) else None
    if tok is not None and tok not in ids and (not vocab_size or tok < vocab_size):
        ids.append(tok)
    return ids


def tokenizer_eos_token_id(tokenizer_dir: str) -> int | None:
    """The id of the tokenizer's eos_token, read from its JSON files (the parent resolves the
    config without importing transformers): tokenizer_config.json (or special_tokens_map.json)
    names the token, its added_tokens_decoder or tokenizer.json gives the id."""
    name = None
    for file in ("tokenizer_config.json", "special_tokens_map.json"):
        path = os.path.join(tokenizer_dir, file)
        if name is None and os.path.isfile(path):
            name = read_json_object(path).get("eos_token")
    if isinstance(name, dict):   # an AddedToken: {"content": "</s>", ...}
        name = name.get("content")
    if not isinstance(name, str):
        return None
    config_path = os.path.join(tokenizer_dir, "tokenizer_config.json")
    if os.path.isfile(config_path):
        for tok_id, tok in (read_json_object(config_path).get("added_tokens_decoder") or {}).items():
            if isinstance(tok, dict) and tok.get("content") == name and str(tok_id).isdigit():
                return int(tok_id)
    tok_path = os.path.join(tokenizer_dir, "tokenizer.json")
    if not os.path.isfile(tok_path):
        return None
    tok_json = read_json_object(tok_path)
    for tok in tok_json.get("added_tokens") or []:
        if isinstance(tok, dict) and tok.get("content") == name and type(tok.get("id")) is int:
            return tok["id"]
    vocab = (tok_json.get("model") or {}).get("vocab")
    if isinstance(vocab, dict) and type(vocab.get(name)) is int:
        return vocab[name]
    if isinstance(vocab, list):   # Unigram: [[piece, score], ...]
        for i, entry in enumerate(vocab):
            if isinstance(entry, list) and entry and entry[0] == name:
                return i
    return None


# a tokenizer directory holds at least one of these (transformers builds an empty tokenizer
# from a directory with none, which encodes every text to no tokens)
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json", "vocab.txt")


def check_tokenizer_files(path: str) -> None:
    if not os.path.isdir(path):
        raise ConfigError(f"tokenizer directory {path!r} does not exist")
    if not any(os.path.isfile(os.path.join(path, name)) for name in _TOKENIZER_FILES):
        raise ConfigError(f"{path!r} has no tokenizer (none of {', '.join(_TOKENIZER_FILES)}); "
                          "give one with --tokenizer")


def read_json_object(path: str) -> dict:
    """A model file's JSON object; ConfigError (one line, exit 2) when it is not one."""
    try:
        with open(path, encoding="utf-8") as f:
            value = json.load(f)
    except (OSError, ValueError) as e:   # (json.JSONDecodeError and UnicodeDecodeError are ValueErrors)
        raise ConfigError(f"{path} is not readable JSON: {e}") from None
    if not isinstance(value, dict):
        raise ConfigError(f"{path} must hold a JSON object, got {type(value).__name__}")
    return value


SPEC_METHODS = ("ngram", "draft_model", "eagle", "eagle3", "oracle")


@dataclass(frozen=True)
class SpeculativeConfig:
    """--speculative-config (vLLM's SpeculativeConfig fields). The proposer drafts
    num_speculative_tokens tokens per decoding request after every step; the next step verifies
    them (workers/rejection_sampler.py). `oracle` is for measurement only: it replays a recorded
    greedy output (oracle_path: a JSON list of {"prompt_token_ids", "output_token_ids"}) and
    misses each draft token with probability oracle_miss_rate."""
    method: str
    num_speculative_tokens: int
    model: str | None = None                # draft_model: its directory (same tokenizer); eagle/eagle3: the head's
    prompt_lookup_min: int | None = None    # ngram: the shortest suffix matched
    prompt_lookup_max: int | None = None    # ngram: the longest
    disable_by_batch_size: int | None = None  # no drafts while this many requests (or more) run
    oracle_path: str | None = None
    oracle_miss_rate: float = 0.0

    @classmethod
    def parse(cls, d: "dict | SpeculativeConfig | None") -> "SpeculativeConfig | None":
        """The struct of a --speculative-config JSON object; ConfigError says what is wrong."""
        if isinstance(d, SpeculativeConfig):
            return d
        if not d:
            return None
        if not isinstance(d, dict):
            raise ConfigError(f"--speculative-config must be a JSON object, got {d!r}")
        names = {f.name for f in fields(cls)}
        unknown = sorted(set(d) - names)
        if unknown:
            raise ConfigError(f"--speculative-config: unknown fields {unknown} (known: {', '.join(sorted(names))})")
        method = d.get("method")
        if method is None and d.get("model"):
            method = "draft_model"
        if method not in SPEC_METHODS:
            raise ConfigError(f"--speculative-config: method must be one of {', '.join(SPEC_METHODS)}, got {method!r}")
        k = d.get("num_speculative_tokens")
        if type(k) is not int or not 1 <= k <= 16:
            raise ConfigError(f"--speculative-config: num_speculative_tokens must be an integer in [1, 16], got {k!r}")
        for name in ("prompt_lookup_min", "prompt_lookup_max", "disable_by_batch_size"):
            v = d.get(name)
            if v is not None and (type(v) is not int or v < 1):
                raise ConfigError(f"--speculative-config: {name} must be a positive integer, got {v!r}")
        lo, hi = d.get("prompt_lookup_min"), d.get("prompt_lookup_max")
        if method == "ngram":   # vLLM's defaults: 5 and 5, or one from the other
            lo, hi = lo or hi or 5, hi or lo or 5
            if lo > hi:
                raise ConfigError(f"--speculative-config: prompt_lookup_min ({lo}) exceeds prompt_lookup_max ({hi})")
        model = d.get("model")
        if method in ("draft_model", "eagle", "eagle3"):
            if not isinstance(model, str) or not os.path.isfile(os.path.join(model, "config.json")):
                what = "a model directory" if method == "draft_model" else "an EAGLE head's directory"
                raise ConfigError(f"--speculative-config: {method} needs \"model\": {what} with a "
                                  f"config.json, got {model!r}")
        miss = d.get("oracle_miss_rate", 0.0)
        if method == "oracle":
            path = d.get("oracle_path")
            if not isinstance(path, str) or not os.path.isfile(path):
                raise ConfigError(f"--speculative-config: oracle needs \"oracle_path\": a recorded-output JSON "
                                  f"file, got {path!r}")
            if type(miss) not in (int, float) or not 0 <= miss <= 1:
                raise ConfigError(f"--speculative-config: oracle_miss_rate must be in [0, 1], got {miss!r}")
        return cls(method, k, model, lo, hi, d.get("disable_by_batch_size"), d.get("oracle_path"), float(miss))
