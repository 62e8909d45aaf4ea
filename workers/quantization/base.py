"""The two interfaces every weight-quantization format implements (vLLM's names).

A `QuantizationConfig` is read once per model from config.json's `quantization_config` (or
made from `--quantization fp8` alone, online); it answers, for each linear layer, which
`LinearMethod` runs it (None: the layer stays unquantized, e.g. a name in `ignore`).

A `LinearMethod` owns the layer's weight layout:

* `create_weights(layer)`: replaces the layer's dense `weight` with the format's parameters
  (fp8 `weight` + `weight_scale`, `qweight`/`qzeros`/`scales`/`g_idx`, ...), each with a weight
  loader that keeps this rank's part (column-parallel: output rows; row-parallel: input
  columns, and the scale groups along them) and `shard_ids` for fused layers (qkv_proj,
  gate_up_proj), so workers/models/weights.py loads them as it loads dense weights;
* `process_weights_after_loading(layer)`: repacks what was loaded into the kernel's layout;
* `apply(layer, x, bias)`: y = x W^T (+ bias) for this rank, in x's dtype;
* `dense_to_checkpoint(layer, weight, shard_id)`: a dense float weight of one checkpoint tensor
  (its full, TP=1 shape) quantized into the format's checkpoint tensors: what `--load-format
  dummy` loads (so a dummy model has the format's real layout) and what tests write.
"""
from __future__ import annotations

import re

import torch
from torch import nn


class LinearMethod:
    """One linear layer's quantized weights and matmul; see the module docstring."""

    def create_weights(self, layer: nn.Module) -> None:
        raise NotImplementedError

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        pass

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        raise NotImplementedError

    def dense_to_checkpoint(self, layer: nn.Module, weight: torch.Tensor, shard_id=None) -> dict[str, torch.Tensor]:
        raise NotImplementedError

    def gemv_weight(self, layer: nn.Module, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(weight, float32 per-channel scale) that kernels/gemv.py's decode GEMV can multiply x by,
        with the norm or SiLU before it fused in (workers/models/layers.py); None: `apply` runs it."""
        return None

    @property
    def weight_dtype(self) -> str:
        """How the weights are stored, for /v1/models and the metrics ("fp8_e4m3", "int4")."""
        raise NotImplementedError


class QuantizationConfig:
    """A checkpoint's (or --quantization's) quantization format; see the module docstring."""
    name: str = ""           # vLLM's --quantization value
    ignore: tuple[str, ...] = ()   # checkpoint module names (or "re:" patterns) left unquantized

    def linear_method(self, prefix: str, layer: nn.Module) -> LinearMethod | None:
        raise NotImplementedError

    def is_ignored(self, prefix: str) -> bool:
        """Whether a checkpoint module name is excluded (compressed-tensors' `ignore`, with its
        "re:" regexes; GPTQ/AWQ's `modules_to_not_convert`, matched as substrings as vLLM does)."""
        for pattern in self.ignore:
            if pattern.startswith("re:"):
                if re.match(pattern[3:], prefix):
                    return True
            elif prefix == pattern or prefix.endswith("." + pattern) or pattern in prefix.split(".") \
                    or prefix.startswith(pattern + "."):
                return True
        return False

    @property
    def description(self) -> str:
        """One line for the logs and /v1/models: the format and its parameters."""
        return self.name


class QuantizationError(ValueError):
    """A quantization_config (or --quantization) Loom cannot serve: one line, at start-up."""
