"""Reading a LoRA adapter in PEFT's format: adapter_config.json beside adapter_model.safetensors
(or adapter_model.bin), as `peft`'s save_pretrained writes it.

The tensors are named `base_model.model.<module>.lora_A.weight` [r, in] and `...lora_B.weight`
[out, r], for the base model's modules by their checkpoint names (model.layers.0.self_attn.q_proj).
The scale is lora_alpha / r, or lora_alpha / sqrt(r) with use_rslora; rank_pattern and
alpha_pattern give single modules their own r and alpha (by the module name's suffix, as PEFT
matches them). What the adapter asks that this reader cannot serve (DoRA, biases, trained
embeddings or lm_head, fan_in_fan_out) is a LoRAAdapterError, before anything is loaded.
"""
from __future__ import annotations

import json
import math
import os
import re
from dataclasses import dataclass

import torch


class LoRAAdapterError(ValueError):
    """An adapter that cannot be served: unreadable, or not fitting the model or the slots."""


@dataclass(frozen=True)
class LoRAModuleWeights:
    """One module's pair, as the checkpoint holds it: a [r, in], b [out, r]; `scale` multiplies
    b @ a (folded into B when the adapter is put in a slot)."""
    a: torch.Tensor
    b: torch.Tensor
    scale: float

    @property
    def rank(self) -> int:
        return self.a.shape[0]


@dataclass(frozen=True)
class PeftAdapter:
    """An adapter read from disk, on the CPU: its modules by checkpoint name (no `.weight`)."""
    path: str
    rank: int                     # the largest module rank
    modules: dict[str, LoRAModuleWeights]

    def nbytes(self) -> int:
        return sum(m.a.nbytes + m.b.nbytes for m in self.modules.values())


_PREFIX = "base_model.model."
_KEY = re.compile(r"^(?P<module>.+)\.lora_(?P<ab>[AB])(?:\.[A-Za-z0-9_]+)?\.weight$")


def read_config(path: str) -> dict:
    cfg_path = os.path.join(path, "adapter_config.json")
    if not os.path.isfile(cfg_path):
        raise LoRAAdapterError(f"no adapter_config.json in {path!r}")
    try:
        with open(cfg_path) as f:
            cfg = json.load(f)
    except (OSError, ValueError) as e:
        raise LoRAAdapterError(f"{cfg_path}: {e}") from None
    if not isinstance(cfg, dict):
        raise LoRAAdapterError(f"{cfg_path}: not a JSON object")
    return cfg


def _check_config(cfg: dict, path: str) -> None:
    if cfg.get("peft_type", "LORA") != "LORA":
        raise LoRAAdapterError(f"{path}: peft_type {cfg.get('peft_type')!r} is not LORA")
    if cfg.get("use_dora"):
        raise LoRAAdapterError(f"{path}: DoRA adapters (use_dora) are not supported")
    if cfg.get("fan_in_fan_out"):
        raise LoRAAdapterError(f"{path}: fan_in_fan_out adapters (Conv1D layers) are not supported")
    if cfg.get("bias", "none") != "none":
        raise LoRAAdapterError(f"{path}: adapters with trained biases (bias={cfg.get('bias')!r}) are not supported")
    if cfg.get("modules_to_save"):
        raise LoRAAdapterError(f"{path}: modules_to_save {cfg['modules_to_save']} (fully trained modules) "
                               "are not supported")
    r = cfg.get("r")
    if not isinstance(r, int) or r < 1:
        raise LoRAAdapterError(f"{path}: adapter_config.json needs an integer r >= 1, got {r!r}")


def _load_tensors(path: str) -> dict[str, torch.Tensor]:
    st = os.path.join(path, "adapter_model.safetensors")
    if os.path.isfile(st):
        from safetensors.torch import load_file
        try:
            return load_file(st)
        except Exception as e:   # a truncated or foreign file: the caller's 400
            raise LoRAAdapterError(f"{st}: {e}") from None
    binary = os.path.join(path, "adapter_model.bin")
    if os.path.isfile(binary):
        return torch.load(binary, map_location="cpu", weights_only=True)
    raise LoRAAdapterError(f"no adapter_model.safetensors (or adapter_model.bin) in {path!r}")


def _pattern_value(patterns: dict, module: str, default):
    """PEFT's rank_pattern / alpha_pattern: the value of the first key that matches the module's
    name (a key matches the whole name or a dotted suffix of it, or as a regex)."""
    for key, value in (patterns or {}).items():
        if module == key or module.endswith("." + key) or re.fullmatch(key, module):
            return value
    return default


def read_peft_adapter(path: str) -> PeftAdapter:
    """The adapter in directory `path`, checked for what Loom serves; LoRAAdapterError otherwise."""
    if not os.path.isdir(path):
        raise LoRAAdapterError(f"LoRA adapter directory {path!r} does not exist")
    cfg = read_config(path)
    _check_config(cfg, path)
    tensors = _load_tensors(path)
    pairs: dict[str, dict[str, torch.Tensor]] = {}
    for key, t in tensors.items():
        name = key[len(_PREFIX):] if key.startswith(_PREFIX) else key
        m = _KEY.match(name)
        if m is None:
            raise LoRAAdapterError(f"{path}: unsupported tensor {key!r} (only lora_A / lora_B weights are served)")
        pairs.setdefault(m["module"], {})[m["ab"]] = t
    modules = {}
    for module, ab in pairs.items():
        if set(ab) != {"A", "B"}:
            raise LoRAAdapterError(f"{path}: {module} has lora_{''.join(ab)} but not both lora_A and lora_B")
        a, b = ab["A"], ab["B"]
        if a.dim() != 2 or b.dim() != 2 or a.shape[0] != b.shape[1]:
            raise LoRAAdapterError(f"{path}: {module}: lora_A {tuple(a.shape)} and lora_B {tuple(b.shape)} "
                                   "are not a rank-r pair ([r, in] and [out, r])")
        r = a.shape[0]
        alpha = _pattern_value(cfg.get("alpha_pattern"), module, cfg.get("lora_alpha", cfg["r"]))
        scale = alpha / math.sqrt(r) if cfg.get("use_rslora") else alpha / r
        modules[module] = LoRAModuleWeights(a, b, float(scale))
    if not modules:
        raise LoRAAdapterError(f"{path}: the adapter holds no LoRA weights")
    return PeftAdapter(path, max(m.rank for m in modules.values()), modules)
