"""Architecture name (config.json's `architectures[0]`) -> the model file that implements it.

One line per architecture. The module is imported on first use only, so importing the registry
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
}


def model_class(arch: str) -> type[nn.Module]:
    """The class of an architecture name; ValueError for one we do not implement."""
    entry = MODELS.get(arch)
    if entry is None:
        raise ValueError(f"unsupported architecture {arch!r} (supported: {', '.join(sorted(MODELS))})")
    return getattr(importlib.import_module(f"workers.models.{entry.module}"), arch)


def get_model_class(config) -> type[nn.Module]:
    """The class for a transformers config (its `architectures[0]`)."""
    archs = getattr(config, "architectures", None) or []
    if not archs:
        raise ValueError("config has no `architectures` entry; cannot pick a model class "
                         f"(supported: {', '.join(sorted(MODELS))})")
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
