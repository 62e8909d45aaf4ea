"""Architecture name (config.json's `architectures[0]`) -> the model file that implements it.

One line per architecture. Any other decoder-only `*ForCausalLM` that transformers implements
is served by the generic path (workers/models/transformers.py); `--model-impl` chooses:
auto (the native file where there is one, else the generic path), loom (native only) or
transformers (always the generic path). The module is imported on first use only, so importing the registry
stays cheap (no torch): the launcher asks it whether a checkpoint takes images, and imports a
model file (and torch) only for one that does."""
from __future__ import annotations

import importlib
import json
import os
from typing import TYPE_CHECKING, NamedTuple

if TYPE_CHECKING:
    from torch import nn

    from multimodal.info import MultiModalInfo


class ModelEntry(NamedTuple):
    module: str                # in workers/models/; the class is the module's attribute of the architecture's name
    multimodal: bool = False   # the class declares `multimodal` (a MultiModalInfo); tests check they agree


MODELS: dict[str, ModelEntry] = {
    "CohereForCausalLM": ModelEntry("cohere"),
    "Cohere2ForCausalLM": ModelEntry("cohere2"),
    "GemmaForCausalLM": ModelEntry("gemma"),
    "Gemma2ForCausalLM": ModelEntry("gemma2"),
    "Gemma3ForCausalLM": ModelEntry("gemma3"),
    "LlamaForCausalLM": ModelEntry("llama"),
    "MistralForCausalLM": ModelEntry("llama"),
    "Olmo2ForCausalLM": ModelEntry("olmo2"),
    "Phi3ForCausalLM": ModelEntry("phi3"),
    "Qwen2ForCausalLM": ModelEntry("qwen2"),
    "StableLmForCausalLM": ModelEntry("stablelm"),
    "Qwen3ForCausalLM": ModelEntry("qwen3"),
    "Qwen2_5_VLForConditionalGeneration": ModelEntry("qwen2_5_vl", multimodal=True),
    "LlavaForConditionalGeneration": ModelEntry("llava", multimodal=True),
    "Qwen2AudioForConditionalGeneration": ModelEntry("qwen2_audio", multimodal=True),
    "WhisperForConditionalGeneration": ModelEntry("whisper", multimodal=True),
    "VoxtralForConditionalGeneration": ModelEntry("voxtral", multimodal=True),
    "GraniteForCausalLM": ModelEntry("granite"),
    "GlmForCausalLM": ModelEntry("glm"),
    "Glm4ForCausalLM": ModelEntry("glm4"),
    "InternLM2ForCausalLM": ModelEntry("internlm2"),
    "SmolLM3ForCausalLM": ModelEntry("smollm3"),
    "MinistralForCausalLM": ModelEntry("ministral"),
    "SeedOssForCausalLM": ModelEntry("seed_oss"),
    "HeliumForCausalLM": ModelEntry("helium"),
    "Olmo3ForCausalLM": ModelEntry("olmo3"),
    "Ernie4_5ForCausalLM": ModelEntry("ernie4_5"),
    "ArceeForCausalLM": ModelEntry("arcee"),
    "Exaone4ForCausalLM": ModelEntry("exaone4"),
    "HyperCLOVAXForCausalLM": ModelEntry("hyperclovax"),
    "CwmForCausalLM": ModelEntry("cwm"),
    "Ministral3ForCausalLM": ModelEntry("ministral3"),
    "MixtralForCausalLM": ModelEntry("mixtral"),
    "Qwen2MoeForCausalLM": ModelEntry("qwen2_moe"),
    "Qwen3MoeForCausalLM": ModelEntry("qwen3_moe"),
    "GptOssForCausalLM": ModelEntry("gpt_oss"),
}


MODEL_IMPLS = ("auto", "loom", "transformers")
# model types whose state is not all attention (recurrent, hybrid), in case a class claims the
# attention interface anyway
_STATEFUL_MODEL_TYPES = frozenset({"mamba", "mamba2", "rwkv", "jamba", "falcon_h1", "falcon_mamba", "zamba",
                                   "zamba2", "bamba", "lfm2", "lfm2_moe", "nemotron_h", "granitemoehybrid",
                                   "qwen3_next", "recurrent_gemma", "xlstm", "minimax", "plamo2"})


def base_architecture(arch: str) -> str:
    """A classifier's or a bare decoder's architecture (Qwen3ForSequenceClassification, Qwen3Model)
    as the causal LM whose decoder it runs (Qwen3ForCausalLM), where we implement that one; the pooling adapter adds its head
    (workers/models/adapters.py). Any other name as it is."""
    for suffix in ("ForSequenceClassification", "ForEmbedding", "Model"):   # (Qwen3Model: a bare decoder)
        if arch and arch.endswith(suffix) and not arch.endswith("ForCausalLM"):
            causal = arch[:-len(suffix)] + "ForCausalLM"
            if causal in MODELS:
                return causal
    return arch


def model_class(arch: str) -> type[nn.Module]:
    """The native class of an architecture name; ValueError for one we do not implement."""
    arch = base_architecture(arch)
    entry = MODELS.get(arch)
    if entry is None:
        raise ValueError(f"unsupported architecture {arch!r} (supported: {', '.join(sorted(MODELS))})")
    return getattr(importlib.import_module(f"workers.models.{entry.module}"), arch)


def uses_generic_path(arch: str, impl: str = "auto") -> bool:
    """Whether `--model-impl impl` serves `arch` through the generic transformers path; ValueError
    for an impl we do not know, or `loom` for an architecture without a native file."""
    if impl not in MODEL_IMPLS:
        raise ValueError(f"--model-impl must be one of {', '.join(MODEL_IMPLS)}, got {impl!r}")
    arch = base_architecture(arch)
    if impl == "loom" and arch not in MODELS:
        raise ValueError(f"architecture {arch!r} has no native implementation (native: {', '.join(sorted(MODELS))}); "
                         "--model-impl transformers (or auto) serves it through transformers")
    return impl == "transformers" or arch not in MODELS


def generic_path_refusal(hf_config: dict) -> str | None:
    """Why the generic path cannot serve a checkpoint (its config.json, as a dict), or None.
    Imports transformers' model mapping (and the model's class, for its attention support)."""
    arch = (hf_config.get("architectures") or [None])[0]
    if arch is None:
        return "config.json names no architecture"
    entry = MODELS.get(arch)
    if (entry is not None and entry.multimodal) or "text_config" in hf_config or "vision_config" in hf_config:
        return f"{arch} is multimodal (the generic path serves text-only decoders)"
    if hf_config.get("is_encoder_decoder"):
        return f"{arch} is an encoder-decoder (the generic path serves decoder-only models)"
    if hf_config.get("model_type") in _STATEFUL_MODEL_TYPES:
        return f"{arch} keeps recurrent state (Loom's KV cache holds attention keys and values only)"
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES
    if arch not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.values():
        return f"transformers knows no causal LM {arch!r}"
    import transformers
    cls = getattr(transformers, arch, None)
    if cls is None or not getattr(cls, "_supports_attention_backend", False):
        return (f"{arch}'s attention does not go through transformers' attention interface "
                "(_supports_attention_backend is False)")
    return None


def check_architecture(config) -> None:
    """Start-up check of an EngineConfig (before any worker starts): the architecture is served
    by the chosen --model-impl. ConfigError (one line) otherwise; TP > 1 on the generic path too."""
    from ipc.config import ConfigError, read_json_object
    hf = {**read_json_object(os.path.join(config.model, "config.json")), **(getattr(config, "hf_overrides", None) or {})}
    arch = (hf.get("architectures") or [None])[0]
    if arch is None:
        raise ConfigError(f"{config.model}/config.json names no architecture (`architectures`)")
    quantization = getattr(config, "quantization", None)
    text = hf.get("text_config") if isinstance(hf.get("text_config"), dict) else {}
    quantized = False
    # unquantized (the usual case): no import of workers.quantization, which imports torch (1.5-3 s
    # in `loom serve` before any child process starts)
    if quantization not in (None, "auto") or "quantization_config" in hf or "quantization_config" in text:
        from workers.quantization import QuantizationError, get_quantization_config
        try:   # a format Loom does not serve fails here, in one line
            quantized = get_quantization_config(hf, quantization, getattr(config, "load_format", "auto")) is not None
        except QuantizationError as e:
            raise ConfigError(str(e)) from None
    try:
        generic = uses_generic_path(arch, config.model_impl)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    if not generic:
        return
    if quantized:
        raise ConfigError(f"quantized weights on the generic transformers path ({arch}) are not supported"
                          + (" (--model-impl auto or loom serves it natively)" if arch in MODELS else ""))
    if getattr(config, "runner", "generate") == "pooling":
        raise ConfigError(f"--runner pooling serves natively implemented decoders only ({arch} is not one; "
                          f"natively served: {', '.join(sorted(MODELS))})")
    why = generic_path_refusal(hf)
    if why is not None:
        native = f"; natively served: {', '.join(sorted(MODELS))}" if arch not in MODELS else ""
        raise ConfigError(f"unsupported architecture: {why}{native}")
    if config.tensor_parallel_size > 1:
        raise ConfigError(f"--tensor-parallel-size {config.tensor_parallel_size}: the generic transformers path "
                          f"serving {arch} runs on one GPU only"
                          + (" (--model-impl auto or loom splits it natively)" if arch in MODELS else ""))


def get_model_class(config, impl: str = "auto") -> type[nn.Module]:
    """The class for a transformers config (its `architectures[0]`) under `--model-impl impl`."""
    archs = getattr(config, "architectures", None) or []
    if not archs:
        raise ValueError("config has no `architectures` entry; cannot pick a model class "
                         f"(supported: {', '.join(sorted(MODELS))})")
    if uses_generic_path(archs[0], impl):
        from workers.models.transformers import TransformersForCausalLM
        return TransformersForCausalLM
    return model_class(archs[0])


def multimodal_info(model_dir: str) -> MultiModalInfo | None:
    """The multimodal declaration of the checkpoint's model class; None for a text-only model
    (whose file is not imported) or an architecture we do not implement (the workers report it)."""
    with open(os.path.join(model_dir, "config.json")) as f:
        archs = json.load(f).get("architectures") or []
    entry = MODELS.get(archs[0]) if archs else None
    if entry is None or not entry.multimodal:
        return None
    return model_class(archs[0]).multimodal
