"""EngineConfig: every option of `loom serve` and `LLM(...)` that the engine
core and workers need. Resolved once (model config read, defaults filled,
limits checked) before any process starts."""
from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field, fields


class ConfigError(ValueError):
    """A configuration that can never work; reported at start-up."""


@dataclass
class EngineConfig:
    model: str
    served_model_name: str | None = None
    tokenizer: str | None = None
    dtype: str = "auto"                 # auto: bf16 on GPU, fp32 on CPU
    device: str = "auto"                # auto | cpu | cuda
    load_format: str = "auto"           # auto | safetensors | dummy
    seed: int = 0
    max_model_len: int | None = None
    max_num_seqs: int = 256
    max_num_batched_tokens: int | None = None
    block_size: int = 16
    num_gpu_blocks_override: int | None = None
    gpu_memory_utilization: float = 0.9
    kv_cache_memory_bytes: int | None = None   # CPU: KV budget (default: room for max_num_seqs full requests, capped at 2 GiB)
    enable_prefix_caching: bool = True
    enforce_eager: bool = False
    attention_backend: str = "auto"     # auto | torch | triton
    async_scheduling: bool = True       # schedule step N+1 while step N runs (--no-async-scheduling: off)
    tensor_parallel_size: int = 1
    enable_sleep_mode: bool = False
    max_logprobs: int = 20
    disable_log_stats: bool = False
    log_stats_interval: float = 10.0
    # filled in by resolve()
    model_max_len: int = 0
    vocab_size: int = 0
    eos_token_ids: list[int] = field(default_factory=list)

    @property
    def model_name(self) -> str:
        return self.served_model_name or self.model

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "EngineConfig":
        names = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in names})

    def resolve(self) -> "EngineConfig":
        """Read the model's config.json, fill defaults and fail early on impossible sizes."""
        path = os.path.join(self.model, "config.json")
        if not os.path.isfile(path):
            raise ConfigError(f"model directory {self.model!r} has no config.json")
        with open(path) as f:
            hf = json.load(f)
        text_cfg = hf.get("text_config", hf)
        self.model_max_len = int(text_cfg.get("max_position_embeddings") or 2048)
        limit = f"max_position_embeddings {self.model_max_len}"
        window = attention_window(text_cfg)
        if window is not None and window < self.model_max_len:
            # Sliding-window attention is not implemented; within the window it equals full attention.
            self.model_max_len, limit = window, f"sliding_window {window} (sliding-window attention is not supported)"
        self.vocab_size = int(text_cfg.get("vocab_size") or 0)
        if self.max_model_len is None:
            self.max_model_len = self.model_max_len
        if self.max_model_len > self.model_max_len:
            raise ConfigError(f"--max-model-len {self.max_model_len} exceeds the model's {limit}")
        if self.max_num_batched_tokens is None:
            self.max_num_batched_tokens = max(8192, self.max_num_seqs)
        self.eos_token_ids = _eos_token_ids(self.model, text_cfg)
        self.check()
        return self

    def check(self) -> None:
        if self.max_model_len < 1:
            raise ConfigError(f"--max-model-len must be at least 1, got {self.max_model_len}")
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
        if self.tensor_parallel_size != 1:
            raise ConfigError("--tensor-parallel-size > 1 is not supported yet")

    def check_num_blocks(self, num_blocks: int) -> None:
        """A request of max_model_len tokens must fit in the KV cache, or it could never run."""
        need = -(-self.max_model_len // self.block_size)
        if num_blocks < need:
            raise ConfigError(
                f"the KV cache has {num_blocks} blocks of {self.block_size} tokens "
                f"({num_blocks * self.block_size} tokens), but one request of --max-model-len "
                f"{self.max_model_len} needs {need} blocks. Lower --max-model-len or give the "
                f"KV cache more memory (--gpu-memory-utilization / --num-gpu-blocks-override).")


def attention_window(hf_cfg: dict) -> int | None:
    """The sliding window some layers of this model attend within, or None (full attention).
    Mistral sets `sliding_window` for every layer; Qwen2 only with `use_sliding_window`, from
    layer `max_window_layers` on; newer configs list `layer_types`."""
    window = hf_cfg.get("sliding_window")
    if not window:
        return None
    layer_types = hf_cfg.get("layer_types")
    if layer_types:
        return int(window) if "sliding_attention" in layer_types else None
    if "use_sliding_window" in hf_cfg:
        if not hf_cfg["use_sliding_window"]:
            return None
        if hf_cfg.get("max_window_layers", 0) >= hf_cfg.get("num_hidden_layers", 0):
            return None
    return int(window)


def _eos_token_ids(model_dir: str, hf_cfg: dict) -> list[int]:
    ids: list[int] = []
    gen_path = os.path.join(model_dir, "generation_config.json")
    sources = [hf_cfg]
    if os.path.isfile(gen_path):
        with open(gen_path) as f:
            sources.insert(0, json.load(f))
    for src in sources:
        eos = src.get("eos_token_id")
        if eos is None:
            continue
        for tok in eos if isinstance(eos, list) else [eos]:
            if tok not in ids:
                ids.append(int(tok))
    return ids
