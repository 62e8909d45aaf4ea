"""Architecture name (config.architectures[0]) -> our model class."""
from __future__ import annotations

from torch import nn

from workers.models.llama import LlamaForCausalLM, MistralForCausalLM
from workers.models.llava import LlavaForConditionalGeneration
from workers.models.qwen2 import Qwen2ForCausalLM
from workers.models.qwen2_5_vl import Qwen2_5_VLForConditionalGeneration
from workers.models.qwen3 import Qwen3ForCausalLM

MODEL_REGISTRY: dict[str, type[nn.Module]] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": MistralForCausalLM,
    "Qwen2ForCausalLM": Qwen2ForCausalLM,
    "Qwen3ForCausalLM": Qwen3ForCausalLM,
    "Qwen2_5_VLForConditionalGeneration": Qwen2_5_VLForConditionalGeneration,
    "LlavaForConditionalGeneration": LlavaForConditionalGeneration,
}


def get_model_class(config) -> type[nn.Module]:
    archs = getattr(config, "architectures", None) or []
    if not archs:
        raise ValueError("config has no `architectures` entry; cannot pick a model class "
                         f"(supported: {', '.join(sorted(MODEL_REGISTRY))})")
    cls = MODEL_REGISTRY.get(archs[0])
    if cls is None:
        raise ValueError(f"unsupported architecture {archs[0]!r} "
                         f"(supported: {', '.join(sorted(MODEL_REGISTRY))})")
    return cls
