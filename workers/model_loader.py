"""Build one of our model classes from a HF model directory and fill its weights.

    model = load_model(model_dir, torch.bfloat16, "cuda")
    num_layers, num_kv_heads, head_dim = kv_cache_shape(model)

The model is constructed directly on the target device in the target dtype
(parameters are created empty, then filled), so nothing goes through the CPU.
"""
from __future__ import annotations

import contextlib
import glob
import json
import logging
import os
import re
from typing import Iterator

import torch
from torch import nn

from workers.distributed import tp_rank, tp_size
from workers.hf_config import load_config
from workers.models.interfaces import supports_multimodal
from workers.models.layers import LayerNorm, PerHeadLayerNorm, RMSNorm, get_head_dim, get_num_kv_heads, heads_of_rank
from workers.models.registry import get_model_class
from workers.quantization import (dense_weights_on_meta, get_quantization_config, init_dummy_quantized,
                                  install_linear_methods, process_weights_after_loading)

logger = logging.getLogger(__name__)
LOAD_FORMATS = ("auto", "safetensors", "dummy")
DUMMY_SEED = 0
DUMMY_RANGE = 1e-3


def model_kv_shape(config) -> tuple[int, int, int]:
    """(num_layers, num_kv_heads, head_dim): what this rank's KV cache is allocated for (its
    share of the KV heads under tensor parallelism)."""
    config = config.get_text_config() if hasattr(config, "get_text_config") else config
    _, kv_heads, _ = heads_of_rank(config.num_attention_heads, get_num_kv_heads(config), tp_rank(), tp_size())
    return config.num_hidden_layers, kv_heads, get_head_dim(config)


def kv_cache_shape(model: nn.Module) -> tuple[int, int, int]:
    """(num_layers, num_kv_heads, head_dim) of this rank's KV cache: what the model declares
    (`model.kv_cache_shape`: the generic path, which learns it from its attention modules),
    else model_kv_shape of its config."""
    return getattr(model, "kv_cache_shape", None) or model_kv_shape(model.config)


def apply_hf_overrides(config, overrides: dict, tokenizer_dir: str) -> None:
    """vLLM's --hf-overrides: set on the transformers config; classifier_from_token's tokens are
    looked up in the tokenizer (as vLLM does) for the pooling adapter."""
    for key, value in (overrides or {}).items():
        setattr(config, key, value)
    tokens = getattr(config, "classifier_from_token", None)
    if tokens:
        from transformers import AutoTokenizer
        tok = AutoTokenizer.from_pretrained(tokenizer_dir)
        config.classifier_from_token_ids = [tok.convert_tokens_to_ids(t) for t in tokens]


@contextlib.contextmanager
def _default_dtype(dtype: torch.dtype):
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(old)


def build_model(config, dtype: torch.dtype, device: torch.device | str,
                language_model_only: bool = False, model_impl: str = "auto", convert: str = "none") -> nn.Module:
    """Our model for `config`, parameters uninitialized, on device in dtype
    (the rotary cos/sin cache stays float32). language_model_only: a vision-language
    model without its vision tower. model_impl: --model-impl (workers/models/registry.py).
    convert: embed or classify serve it for pooling (workers/models/adapters.py)."""
    cls = get_model_class(config, model_impl)
    if convert in ("embed", "classify"):
        from workers.models.adapters import as_pooling_model
        cls = as_pooling_model(cls, convert)
    kwargs = {"language_model_only": True} if language_model_only and supports_multimodal(cls) else {}
    with torch.device(device), _default_dtype(dtype):
        model = cls(config, **kwargs)
    return model.eval().requires_grad_(False)


def natural_key(path: str) -> list:
    """model-2-of-10 before model-10-of-10: digits compare as numbers."""
    return [int(t) if t.isdigit() else t for t in re.split(r"(\d+)", path)]


def safetensors_files(model_dir: str) -> list[str]:
    """The checkpoint files, natural-sorted (every rank reads them in the same order, whatever
    the filesystem's): the shards in model.safetensors.index.json,
    else model.safetensors, else every *.safetensors (Mistral's
    consolidated*.safetensors skipped when others exist)."""
    index = os.path.join(model_dir, "model.safetensors.index.json")
    if os.path.exists(index):
        with open(index) as f:
            weight_map = json.load(f)["weight_map"]
        return sorted((os.path.join(model_dir, name) for name in set(weight_map.values())), key=natural_key)
    single = os.path.join(model_dir, "model.safetensors")
    if os.path.exists(single):
        return [single]
    files = sorted(glob.glob(os.path.join(model_dir, "*.safetensors")), key=natural_key)
    others = [f for f in files if not os.path.basename(f).startswith("consolidated")]
    files = others or files
    if not files:
        raise FileNotFoundError(f"no *.safetensors checkpoint in {model_dir!r} "
                                "(only safetensors is supported; use load_format='dummy' for random weights)")
    return files


def pytorch_bin_files(model_dir: str) -> list[str]:
    """The PyTorch checkpoint files (read only when there are no safetensors), natural-sorted:
    the shards in pytorch_model.bin.index.json, else every pytorch_model*.bin."""
    index = os.path.join(model_dir, "pytorch_model.bin.index.json")
    if os.path.exists(index):
        with open(index) as f:
            weight_map = json.load(f)["weight_map"]
        return sorted((os.path.join(model_dir, name) for name in set(weight_map.values())), key=natural_key)
    return sorted(glob.glob(os.path.join(model_dir, "pytorch_model*.bin")), key=natural_key)


def iterate_checkpoint(model_dir: str, device: torch.device | str) -> Iterator[tuple[str, object]]:
    """(name, tensor or lazy slice) of every checkpoint tensor: the safetensors files, else
    (vLLM's order) the PyTorch .bin files."""
    try:
        return iterate_safetensors(safetensors_files(model_dir), device)
    except FileNotFoundError:
        files = pytorch_bin_files(model_dir)
        if not files:
            raise FileNotFoundError(f"no *.safetensors or pytorch_model*.bin checkpoint in {model_dir!r} "
                                    "(use load_format='dummy' for random weights)") from None
        return iterate_pytorch_bin(files)


def iterate_pytorch_bin(files: list[str]) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) of every tensor of .bin files, memory-mapped; weights_only=True: a pickle
    may hold tensors and plain containers only, never code to run."""
    for path in files:
        state = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
        yield from state.items()
        del state


def iterate_safetensors(files: list[str], device: torch.device | str) -> Iterator[tuple[str, object]]:
    """(name, lazy slice) of every tensor: the parameter's weight loader reads only its rank's
    rows or columns from the memory-mapped file."""
    from safetensors import safe_open
    device = str(torch.device(device))
    for path in files:
        with safe_open(path, framework="pt", device=device) as f:
            for name in f.keys():
                yield name, f.get_slice(name)


def checkpoint_metadata(files: list[str]) -> dict[str, tuple[tuple[int, ...], str]]:
    """Name -> (shape, safetensors dtype such as "BF16") of every tensor, from the file headers
    alone (nothing is read into memory)."""
    from safetensors import SafetensorError, safe_open
    out = {}
    for path in files:
        try:
            with safe_open(path, framework="pt", device="cpu") as f:
                for name in f.keys():
                    sl = f.get_slice(name)
                    out[name] = (tuple(sl.get_shape()), sl.get_dtype())
        except SafetensorError as e:   # truncated or not safetensors at all: the caller's file
            raise ValueError(f"{path} is not a readable safetensors file: {e}") from None
    return out


@torch.no_grad()
def init_dummy_weights(model: nn.Module, seed: int = DUMMY_SEED, low: float = -DUMMY_RANGE,
                       high: float = DUMMY_RANGE) -> None:
    """Deterministic random weights in place on the parameters' device:
    uniform(low, high) everywhere, norm weights (RMSNorm, LayerNorm) set to 1. Each tensor is drawn whole (its
    TP=1 shape, in the same order) and handed to its weight loader, so a TP=N dummy model is
    the TP=1 dummy model sharded; drawn on the device, so nothing goes through the CPU. A
    parameter may name its own constant (`param.dummy_value`: the generic path's norms)."""
    norm_params = {id(m.weight) for m in model.modules() if isinstance(m, (RMSNorm, LayerNorm, PerHeadLayerNorm))}
    generators: dict[torch.device, torch.Generator] = {}

    def generator_for(device: torch.device) -> torch.Generator:
        if device not in generators:
            generators[device] = torch.Generator(device=device).manual_seed(seed)
        return generators[device]

    # quantized linears: dense weights drawn and quantized into the format's layout
    quantized = init_dummy_quantized(model, generator_for, low, high)
    for _, p in model.named_parameters():
        if id(p) in quantized:
            continue
        if id(p) in norm_params or getattr(p, "dummy_value", None) is not None:
            p.fill_(getattr(p, "dummy_value", 1.0))
            continue
        g = generator_for(p.device)
        if p.full_shape == tuple(p.shape):
            p.uniform_(low, high, generator=g)
            continue
        full = torch.empty(p.full_shape, dtype=p.dtype, device=p.device).uniform_(low, high, generator=g)
        p.weight_loader(p, full)
        del full


def load_model(model_dir: str, dtype: torch.dtype, device: torch.device | str,
               load_format: str = "auto", language_model_only: bool = False, model_impl: str = "auto",
               quantization: str | None = None, engine_config=None, startup=None) -> nn.Module:
    """Our model for the HF checkpoint in model_dir, on device in dtype, in eval
    mode with requires_grad off.

    load_format: "auto"/"safetensors" read the safetensors files (tensors go
    straight to the device), or the .bin files of a checkpoint without any; "dummy" needs only config.json and fills
    deterministic random weights (in the quantized format's layout, for a quantized model).
    quantization: --quantization (None: the checkpoint's quantization_config, if any;
    workers/quantization/); the model's format is then `model.quant_config`.
    startup: the worker's ipc/startup.py StartupTimes, which then times the config (transformers'
    import), the model's construction and the weights' fill as phases of their own."""
    if load_format not in LOAD_FORMATS:
        raise ValueError(f"unknown load_format {load_format!r} (expected one of {LOAD_FORMATS})")
    phase = startup.phase if startup is not None else lambda name: contextlib.nullcontext()
    with phase("config"):
        config = load_config(model_dir)
        convert = "none"
        if engine_config is not None:   # --hf-overrides, and a pooling runner's --convert
            apply_hf_overrides(config, engine_config.hf_overrides, engine_config.tokenizer_dir)
            convert = engine_config.convert
        qcfg = get_quantization_config(_raw_config(model_dir), quantization, load_format)
    with phase("model built"), dense_weights_on_meta(qcfg):
        model = build_model(config, dtype, device, language_model_only, model_impl, convert)
    with phase("weights filled"):
        quantized = install_linear_methods(model, qcfg, device)
        if qcfg is not None:
            logger.info("weights: %s on %d linear layers", qcfg.description, quantized)
        if load_format == "dummy":
            init_dummy_weights(model)
        else:
            model.load_weights(iterate_checkpoint(model_dir, device))
        process_weights_after_loading(model)
        if startup is not None and torch.device(device).type == "cuda":
            torch.cuda.synchronize(device)   # (the phase is the device's work, not only its launches)
    model.quant_config = qcfg
    return model


def _raw_config(model_dir: str) -> dict:
    try:
        with open(os.path.join(model_dir, "config.json")) as f:
            return json.load(f)
    except (OSError, ValueError):
        return {}
