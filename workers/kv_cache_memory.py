"""KVCacheMemory: the worker's device memory. How many KV cache blocks fit (profiling the
largest step on CUDA), the KV cache itself, sleep and wake-up (weights and cache released and
restored), and what memory is held."""
from __future__ import annotations

import gc
import logging
from typing import NamedTuple

import torch

from ipc.config import EngineConfig, max_blocks_held
from workers.attention import AttentionMetadata, model_sliding_window
from workers.compile_ahead import run_compiled_ahead

logger = logging.getLogger(__name__)


class KVCacheSpec(NamedTuple):
    """The shape of one layer's KV cache block, on this rank. dtype: the cache's (the model's, or
    float8_e4m3fn with --kv-cache-dtype fp8: half the bytes, twice the blocks)."""
    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    dtype: torch.dtype

    def block_bytes(self) -> int:
        """A block's keys and values, over all layers."""
        elem = torch.tensor([], dtype=self.dtype).element_size()
        return 2 * self.num_layers * self.block_size * self.num_kv_heads * self.head_dim * elem


class KVCacheMemory:
    """Owns the KV cache (one (keys, values) pair per layer) and the weights' storage while
    they sleep. The model belongs to the runner; sleep and wake-up swap its tensors' data."""

    def __init__(self, model, config: EngineConfig, device: torch.device, spec: KVCacheSpec, backend: str,
                 model_dtype: torch.dtype | None = None):
        self.model, self.config, self.device, self.spec, self.backend = model, config, device, spec, backend
        self.model_dtype = model_dtype or spec.dtype   # the weights' (sleep level 2 reloads them in it), not the cache's
        self.max_blocks_per_req = -(-config.max_model_len // spec.block_size)
        self.kv_caches: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.num_blocks = 0
        self.weights_dir = config.model   # where sleep level 2 reloads from (update_weights_from_disk moves it)
        self.weights_asleep = False
        self._weights_backup: dict[str, torch.Tensor] | None = None  # level-1 sleep

    # ------------------------------------------------------------ sizing

    def determine_num_blocks(self) -> int:
        cfg = self.config
        if cfg.num_gpu_blocks_override is not None:
            return cfg.num_gpu_blocks_override
        if self.device.type == "cuda":   # (its Triton kernels compiled in parallel first)
            return run_compiled_ahead(self._profile_num_blocks, self.device, "profiling run")
        budget = cfg.kv_cache_memory_bytes
        if budget is None:   # room for max_num_seqs requests as long as they can be (held trimmed)
            window = model_sliding_window(self.model) if cfg.sliding_window_kv_trim else None
            per_req = max_blocks_held(cfg.max_model_len, self.spec.block_size, window, cfg.max_num_batched_tokens)
            budget = min(cfg.max_num_seqs * per_req * self.spec.block_bytes(), 2 << 30)
        return max(budget // self.spec.block_bytes(), 1)

    @torch.inference_mode()
    def _profile_num_blocks(self) -> int:
        """Run the largest step once, then give the KV cache what the memory budget leaves."""
        spec, device = self.spec, self.device
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        if self.config.mm_encoder_budget and hasattr(self.model, "dummy_image"):
            # the encoder's peak too: the largest image the processor can make, once
            self.model.encode_images([self.model.dummy_image(self.config.mm_max_item_tokens)])
        n = min(self.config.max_num_batched_tokens, self.config.max_model_len)
        ids = torch.zeros(n, dtype=torch.long, device=device)
        meta = AttentionMetadata(
            torch.tensor([0, n], dtype=torch.int32, device=device),
            torch.tensor([n], dtype=torch.int32, device=device),
            torch.zeros((1, self.max_blocks_per_req), dtype=torch.int32, device=device),
            torch.full((n,), -1, dtype=torch.long, device=device), n, n, self.backend)
        dummy = [(torch.empty(1, spec.block_size, spec.num_kv_heads, spec.head_dim, dtype=spec.dtype,
                              device=device),) * 2 for _ in range(spec.num_layers)]
        hidden = self.model(ids, torch.arange(n, device=device), dummy, meta)
        speculative = self.config.speculative   # a verify step has a logits row per token: k + 1 per request
        rows = self.config.max_num_seqs * (1 + (speculative.num_speculative_tokens if speculative else 0))
        self.model.compute_logits(hidden[-rows:]).float()  # as logprobs/penalties need
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated()
        free, total = torch.cuda.mem_get_info()
        used_by_others = total - free - torch.cuda.memory_reserved()
        budget = total * self.config.gpu_memory_utilization - peak - max(used_by_others, 0)
        del hidden, dummy
        torch.cuda.empty_cache()
        return max(int(budget // self.spec.block_bytes()), 0)

    def allocate(self, num_blocks: int) -> None:
        spec = self.spec
        self.num_blocks = num_blocks
        shape = (num_blocks, spec.block_size, spec.num_kv_heads, spec.head_dim)
        self.kv_caches = [(torch.zeros(shape, dtype=spec.dtype, device=self.device),
                           torch.zeros(shape, dtype=spec.dtype, device=self.device))
                          for _ in range(spec.num_layers)]
        logger.info("KV cache: %d blocks of %d tokens, %s (%s), %.2f GiB", num_blocks, spec.block_size,
                    str(spec.dtype).removeprefix("torch."), self.config.kv_cache_dtype,
                    num_blocks * spec.block_bytes() / 2 ** 30)

    # ------------------------------------------------------------ sleep / wake

    def sleep(self, level: int) -> None:
        """Level 1: weights to CPU memory, KV cache freed. Level 2: both discarded. The runner
        drops what points at this memory (its CUDA graphs) first."""
        if self.weights_asleep:  # asleep already: a deeper level only drops the CPU copy
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
        self.weights_asleep = True
        self.kv_caches = []
        self._release()

    def wake_weights(self, weights_dir: str | None = None, load_format: str | None = None) -> int:
        """The weights back: from the level-1 copy, else (level 2) loaded from `weights_dir`
        (default: the checkpoint last loaded), which then becomes the one to reload. The tensors
        loaded."""
        loaded = 0
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
            fresh = load_model(weights_dir, self.model_dtype, self.device, load_format or self.config.load_format,
                               self.config.language_model_only, self.config.model_impl, self.config.quantization,
                               self.config)
            for (n, t), (_, src) in zip(self.model.state_dict(keep_vars=True).items(),
                                        fresh.state_dict(keep_vars=True).items()):
                t.data = src.data
                loaded += 1
            del fresh
            self.weights_dir = weights_dir
        self.weights_asleep = False
        return loaded

    def _release(self) -> None:
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
