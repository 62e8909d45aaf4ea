"""compressed-tensors checkpoints (llm-compressor's output): `quantization_config` with
`config_groups` ({targets, weights, input_activations}), `format` and `ignore`. Loom serves:

* FP8 (`float-quantized`/`naive-quantized`, 8-bit float weights): per-tensor or per-channel
  static weight scales (`weight_scale`), per-token dynamic activations (FP8_DYNAMIC) or a static
  per-tensor `input_scale` (FP8), on workers/quantization/fp8.py's methods; block-wise weights
  (strategy "block") on its block method;
* W4A16 (`pack-quantized`, 4-bit int weights, no activation quantization): group sizes 32/64/128
  (any that divides the layers), symmetric or with zero points, actorder "group" (g_idx), on
  workers/quantization/w4a16.py's method.

Anything else (int8 activations, 2:4 sparsity, NVFP4, ...) is refused at start-up in one line.
"""
from __future__ import annotations

import re

from torch import nn

from workers.quantization.base import LinearMethod, QuantizationConfig, QuantizationError
from workers.quantization.fp8 import Fp8BlockLinearMethod, Fp8LinearMethod
from workers.quantization.w4a16 import W4A16LinearMethod


def _unsupported(what: str) -> QuantizationError:
    return QuantizationError(f"unsupported quantization_config: compressed-tensors {what}")


class CompressedTensorsConfig(QuantizationConfig):
    name = "compressed-tensors"

    def __init__(self, groups: list[tuple[list[str], LinearMethod, str]], ignore, fmt: str):
        self.groups, self.ignore, self.format = groups, tuple(ignore or ()), fmt

    @classmethod
    def from_config(cls, cfg: dict) -> "CompressedTensorsConfig":
        fmt = cfg.get("format", "dense")
        groups = []
        for name, group in (cfg.get("config_groups") or {}).items():
            scheme_fmt = group.get("format") or fmt
            groups.append((list(group.get("targets") or ["Linear"]), _method(group, scheme_fmt), _describe(group)))
        if not groups:
            raise _unsupported("without config_groups")
        if cfg.get("sparsity_config"):
            raise _unsupported("sparsity (sparsity_config)")
        return cls(groups, cfg.get("ignore"), fmt)

    def linear_method(self, prefix: str, layer: nn.Module) -> LinearMethod | None:
        if self.is_ignored(prefix):
            return None
        for targets, method, _ in self.groups:
            if any(t == "Linear" or t.startswith("re:") and re.match(t[3:], prefix) or prefix.endswith(t)
                   for t in targets):
                return method
        return None

    @property
    def description(self) -> str:
        return "compressed-tensors (" + "; ".join(d for _, _, d in self.groups) + ")"


def _describe(group: dict) -> str:
    w = group.get("weights") or {}
    a = group.get("input_activations")
    act = "A16" if not a else f"A{a.get('num_bits')}-{'dynamic' if a.get('dynamic') else 'static'}"
    return f"W{w.get('num_bits')}{act} {w.get('type')} {w.get('strategy')}" + (
        f" group {w.get('group_size')}" if w.get("group_size") else "")


def _method(group: dict, fmt: str) -> LinearMethod:
    w, a = group.get("weights") or {}, group.get("input_activations")
    bits, wtype, strategy = w.get("num_bits"), w.get("type", "int"), w.get("strategy")
    if bits == 8 and wtype == "float":
        if a is not None and not (a.get("num_bits") == 8 and a.get("type", "float") == "float"):
            raise _unsupported(f"FP8 weights with {a.get('num_bits')}-bit {a.get('type')} activations")
        static_input = a is not None and not a.get("dynamic", True)
        if static_input and a.get("strategy", "tensor") != "tensor":
            raise _unsupported(f"static {a.get('strategy')} input scales")
        if strategy in ("tensor", "channel"):
            return Fp8LinearMethod(online=False, static_input=static_input)
        if strategy == "block":
            return Fp8BlockLinearMethod(tuple(w.get("block_structure") or (128, 128)), scale_name="weight_scale")
        raise _unsupported(f"FP8 weight strategy {strategy!r}")
    if bits == 4 and wtype == "int" and fmt == "pack-quantized":
        if a is not None:
            raise _unsupported(f"W4 with {a.get('num_bits')}-bit activations (only W4A16)")
        if strategy not in ("group", "channel"):
            raise _unsupported(f"W4A16 strategy {strategy!r}")
        actorder = w.get("actorder")
        if actorder not in (None, False, "group", "static", "weight"):
            raise _unsupported(f"actorder {actorder!r}")
        group_size = int(w.get("group_size") or -1) if strategy == "group" else -1
        return W4A16LinearMethod("ct", group_size, bool(w.get("symmetric", True)), act_order=actorder == "group")
    raise _unsupported(f"{bits}-bit {wtype} weights in format {fmt!r}")
