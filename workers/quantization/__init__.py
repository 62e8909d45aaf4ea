"""Weight quantization (vLLM's `--quantization` and `quantization_config`): which format a model
runs in, and installing its LinearMethod on every linear layer (workers/quantization/base.py
says what a method owns).

    qcfg = get_quantization_config(raw_config_json, "fp8")   # None: unquantized
    with dense_weights_on_meta(qcfg): model = build(...)     # the dense weights take no memory
    install_linear_methods(model, qcfg, device)              # each linear's format parameters
    ... load the checkpoint (or dummy weights) through the weight loaders ...
    process_weights_after_loading(model)                     # repack for the kernels

Embeddings, the lm_head, norms, MoE experts and vision towers stay unquantized: only
Column/RowParallelLinear layers take methods, and names the config excludes keep theirs.
"""
from __future__ import annotations

import contextlib

import torch
from torch import nn

from workers.models import layers
from workers.quantization.base import LinearMethod, QuantizationConfig, QuantizationError

# vLLM's --quantization values that Loom serves
QUANTIZATION_METHODS = ("fp8", "gptq", "awq", "compressed-tensors")
# formats whose model dequantizes them at load itself (gpt-oss's MXFP4 experts: workers/models/gpt_oss.py)
DEQUANTIZED_BY_THE_MODEL = ("mxfp4",)


def checkpoint_quant_config(hf: dict) -> dict | None:
    """config.json's quantization_config (a vision-language model's may sit in text_config)."""
    cfg = hf.get("quantization_config")
    if cfg is None and isinstance(hf.get("text_config"), dict):
        cfg = hf["text_config"].get("quantization_config")
    return cfg


def get_quantization_config(hf: dict, quantization: str | None, load_format: str = "auto"
                            ) -> QuantizationConfig | None:
    """The format a model runs in, from its config.json (a dict) and --quantization (None/"auto":
    the checkpoint's). QuantizationError (one line, naming the format) where Loom cannot serve it."""
    ckpt = checkpoint_quant_config(hf)
    if quantization == "auto":
        quantization = None
    if ckpt is not None and not isinstance(ckpt, dict):
        raise QuantizationError("config.json's quantization_config is not an object")
    method = (ckpt or {}).get("quant_method")
    if ckpt is not None:
        method = str(method).lower() if method else None
        if method in DEQUANTIZED_BY_THE_MODEL and quantization is None:
            return None
        if method not in QUANTIZATION_METHODS:
            raise QuantizationError(f"unsupported quantization_config: quant_method {method!r} "
                                    f"(Loom serves {', '.join(QUANTIZATION_METHODS)})")
        text = hf.get("text_config") if isinstance(hf.get("text_config"), dict) else hf
        if any(text.get(key) for key in ("num_experts", "num_local_experts", "n_routed_experts")):
            raise QuantizationError(f"unsupported quantization_config: quant_method {method!r} on a mixture of "
                                    f"experts (quantized experts are not served yet; --quantization fp8 on the "
                                    f"bf16 checkpoint quantizes its other linears)")
        if quantization is not None and quantization != method:
            raise QuantizationError(f"--quantization {quantization} does not match the checkpoint's "
                                    f"quantization_config (quant_method {method!r})")
    elif quantization is None:
        return None
    elif quantization not in QUANTIZATION_METHODS:
        raise QuantizationError(f"unsupported --quantization {quantization!r} "
                                f"(Loom serves {', '.join(QUANTIZATION_METHODS)})")
    elif quantization != "fp8" and load_format != "dummy":
        raise QuantizationError(f"--quantization {quantization} needs a checkpoint with a quantization_config "
                                f"(only fp8 quantizes a float checkpoint online)")
    method = method or quantization
    if method == "fp8":
        from workers.quantization.fp8 import Fp8Config
        return Fp8Config.from_config(ckpt)
    if method == "gptq":
        from workers.quantization.w4a16 import GPTQConfig
        return GPTQConfig.from_config(ckpt or {})
    if method == "awq":
        from workers.quantization.w4a16 import AWQConfig
        return AWQConfig.from_config(ckpt or {})
    from workers.quantization.compressed_tensors import CompressedTensorsConfig
    return CompressedTensorsConfig.from_config(ckpt or {})


@contextlib.contextmanager
def dense_weights_on_meta(qcfg: QuantizationConfig | None):
    """While a quantized model is built, its linears' dense weights go to the meta device."""
    if qcfg is None:
        yield
        return
    old = layers.linear_weight_device
    layers.linear_weight_device = "meta"
    try:
        yield
    finally:
        layers.linear_weight_device = old


def checkpoint_names(model: nn.Module, name: str) -> list[str]:
    """The checkpoint module names of one of our linears: a fused one's parts (qkv_proj ->
    q_proj, k_proj, v_proj), else its own name."""
    parts = [name.replace(fused.strip("."), part.strip("."))
             for fused, part, _ in getattr(model, "stacked_params", ()) if fused in name + "."]
    return parts or [name]


def install_linear_methods(model: nn.Module, qcfg: QuantizationConfig | None, device: torch.device | str) -> int:
    """Give every Column/RowParallelLinear its method's parameters (the ignored ones, and vision
    towers', their dense weight back on the device). Returns the number of quantized linears."""
    if qcfg is None:
        return 0
    n = 0
    for name, module in model.named_modules():
        if not isinstance(module, (layers.ColumnParallelLinear, layers.RowParallelLinear)):
            continue
        names = checkpoint_names(model, name)
        vision = any(v in name.split(".") for v in ("visual", "vision_tower", "vision_model", "multi_modal_projector"))
        methods = [None if vision else qcfg.linear_method(n_, module) for n_ in names]
        if any(m is None for m in methods) and not all(m is None for m in methods):
            raise QuantizationError(f"{name}: the config quantizes some of {names} and not the others")
        module.quant_device, module.quant_dtype = torch.device(device), module.weight.dtype
        if methods[0] is None:
            _materialize_dense(module, device)
            continue
        del module.weight
        methods[0].create_weights(module)
        module.quant_method = methods[0]
        n += 1
    return n


def _materialize_dense(module: nn.Module, device) -> None:
    old = module.weight
    if old.device.type != "meta":
        return
    new = nn.Parameter(torch.empty(old.shape, dtype=old.dtype, device=device), requires_grad=False)
    new.weight_loader, new.full_shape, new.shard_ids = old.weight_loader, old.full_shape, old.shard_ids
    module.weight = new


def quantized_linears(model: nn.Module):
    for module in model.modules():
        if getattr(module, "quant_method", None) is not None:
            yield module


def process_weights_after_loading(model: nn.Module) -> None:
    for module in quantized_linears(model):
        module.quant_method.process_weights_after_loading(module)


@torch.no_grad()
def init_dummy_quantized(model: nn.Module, generator_for, low: float, high: float) -> set[int]:
    """Dummy weights in each quantized linear's real layout: a dense weight per checkpoint tensor
    (its TP=1 shape) drawn uniform(low, high) and quantized by the method into the format's
    checkpoint tensors, each given to its parameter's loader (so the rank keeps its share).
    Returns the ids of the parameters filled (init_dummy_weights skips them)."""
    done: set[int] = set()
    for module in quantized_linears(model):
        method: LinearMethod = module.quant_method
        in_full = module.in_features * getattr(module, "tp", 1)
        parts = [(sid, s.full) for sid, s in module.shards.items()] if hasattr(module, "shards") \
            else [(None, module.out_features)]
        device = module.quant_device
        dtype = torch.get_default_dtype() if device.type == "cpu" else torch.bfloat16
        for sid, rows in parts:
            dense = torch.empty((rows, in_full), dtype=torch.float32, device=device).uniform_(
                low, high, generator=generator_for(device)).to(dtype)
            for suffix, tensor in method.dense_to_checkpoint(module, dense, sid).items():
                param = getattr(module, suffix)
                param.weight_loader(param, tensor, sid)
        done.update(id(p) for p in module.parameters(recurse=False) if p is not module.bias)
    return done


__all__ = ["QUANTIZATION_METHODS", "LinearMethod", "QuantizationConfig", "QuantizationError",
           "checkpoint_quant_config", "dense_weights_on_meta", "get_quantization_config", "install_linear_methods",
           "init_dummy_quantized", "process_weights_after_loading", "quantized_linears"]
