"""LLaVA: a CLIP or SigLIP vision tower, an MLP projector, and a decoder-only language model
(Llama, Mistral, Qwen2) fed `inputs_embeds` where the <image> placeholders sit.

The features are the hidden states of `vision_feature_layer` (an index, or a list whose
layers are concatenated); `vision_feature_select_strategy` "default" drops the first token
(CLIP's class token), "full" keeps every one. Weight names: the Hub's
(`vision_tower.vision_model.*`, `language_model.model.*`) and transformers 5's
(`vision_tower.embeddings.*`, `model.language_model.*`, `lm_head.*`)."""
from __future__ import annotations


import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from multimodal.info import MultiModalInfo
from workers.models.layers import replicated
from workers.models.llama import LlamaForCausalLM, MistralForCausalLM
from workers.models.qwen2 import Qwen2ForCausalLM
from workers.models.wrapped_lm import WrappedLanguageModel



class LlavaImages(MultiModalInfo):
    """A fixed-size tower: every image is resized to the tower's image_size and makes the same
    number of placeholder tokens; no mm_processor_kwargs."""

    def image_token_id(self, hf: dict) -> int:
        return int(hf.get("image_token_index", hf.get("image_token_id", 32000)))

    def max_item_tokens(self, model_dir: str, hf: dict) -> int:
        return self.image_tokens(hf)

    @staticmethod
    def image_tokens(hf: dict) -> int:
        """The tower's tokens (CLIP: a class token + the patches; SigLIP: the patches), less the
        first under the "default" select strategy (as HF's LLaVA crops it)."""
        vc = hf.get("vision_config") or {}
        n = (int(vc.get("image_size", 336)) // int(vc.get("patch_size", 14))) ** 2
        if vc.get("model_type", "clip_vision_model") != "siglip_vision_model":
            n += 1
        if hf.get("vision_feature_select_strategy", "default") == "default":
            n -= 1
        return n

    def placeholder_tokens(self, hf: dict, arrays: dict[str, np.ndarray]) -> int | None:
        vc = hf.get("vision_config") or {}
        pixels = arrays["pixel_values"]
        side = int(vc.get("image_size", pixels.shape[-1]))
        ok = pixels.shape == (1, int(vc.get("num_channels", 3)), side, side)
        return self.image_tokens(hf) if ok else None


_TEXT_MODELS = {"llama": LlamaForCausalLM, "mistral": MistralForCausalLM, "qwen2": Qwen2ForCausalLM}
_ACTS = {"quick_gelu": lambda x: x * torch.sigmoid(1.702 * x), "gelu": F.gelu, "relu": F.relu,
         "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"), "silu": F.silu}


class VisionEncoderLayer(nn.Module):
    def __init__(self, dim: int, heads: int, hidden: int, eps: float, act):
        super().__init__()
        self.heads, self.act = heads, act
        self.layer_norm1 = nn.LayerNorm(dim, eps=eps)
        self.layer_norm2 = nn.LayerNorm(dim, eps=eps)
        self.self_attn = nn.Module()
        for name in ("q_proj", "k_proj", "v_proj", "out_proj"):
            setattr(self.self_attn, name, nn.Linear(dim, dim))
        self.mlp = nn.Module()
        self.mlp.fc1, self.mlp.fc2 = nn.Linear(dim, hidden), nn.Linear(hidden, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, n, d = x.shape
        h = self.layer_norm1(x)
        a = self.self_attn
        q, k, v = (p(h).view(b, n, self.heads, -1).transpose(1, 2) for p in (a.q_proj, a.k_proj, a.v_proj))
        attn = F.scaled_dot_product_attention(q, k, v)   # bidirectional, fused
        x = x + a.out_proj(attn.transpose(1, 2).reshape(b, n, d))
        return x + self.mlp.fc2(self.act(self.mlp.fc1(self.layer_norm2(x))))


class VisionTower(nn.Module):
    """CLIP (class token, pre-norm) or SigLIP (patch bias, neither) up to the last layer the
    features need; the post-norm and SigLIP's pooling head are never used by LLaVA."""

    def __init__(self, vc, num_layers: int):
        super().__init__()
        self.is_clip = vc.model_type != "siglip_vision_model"
        d = vc.hidden_size
        self.embeddings = nn.Module()
        self.embeddings.patch_embedding = nn.Conv2d(vc.num_channels, d, vc.patch_size, vc.patch_size,
                                                    bias=not self.is_clip)
        num_pos = (vc.image_size // vc.patch_size) ** 2 + (1 if self.is_clip else 0)
        self.embeddings.position_embedding = nn.Embedding(num_pos, d)
        if self.is_clip:
            self.embeddings.class_embedding = nn.Parameter(torch.empty(d))
            self.pre_layrnorm = nn.LayerNorm(d, eps=vc.layer_norm_eps)   # sic: CLIP's name
        self.encoder = nn.Module()
        act = _ACTS[vc.hidden_act]
        self.encoder.layers = nn.ModuleList(
            VisionEncoderLayer(d, vc.num_attention_heads, vc.intermediate_size, vc.layer_norm_eps, act)
            for _ in range(num_layers))

    def forward(self, pixels: torch.Tensor, layers: list[int]) -> list[torch.Tensor]:
        """The hidden states at `layers` (0: the embeddings, i: after encoder layer i)."""
        e = self.embeddings
        x = e.patch_embedding(pixels.to(e.patch_embedding.weight.dtype)).flatten(2).transpose(1, 2)
        if self.is_clip:
            x = torch.cat([e.class_embedding.expand(x.shape[0], 1, -1), x], dim=1)
        x = x + e.position_embedding.weight[None, :x.shape[1]]
        if self.is_clip:
            x = self.pre_layrnorm(x)
        states = [x]
        for layer in self.encoder.layers[:max(layers)]:
            states.append(layer(states[-1]))
        return [states[i] for i in layers]


class LlavaForConditionalGeneration(WrappedLanguageModel):
    tower = "vision_tower"
    multimodal = LlavaImages()

    def __init__(self, config, language_model_only: bool = False):
        super().__init__()
        self.hf_config = config
        text = config.get_text_config()
        self.config = text
        vc = config.vision_config
        layer = config.vision_feature_layer
        total = vc.num_hidden_layers
        self.feature_layers = [(i if i >= 0 else total + 1 + i) for i in (layer if isinstance(layer, list) else [layer])]
        self.drop_first = config.vision_feature_select_strategy == "default"
        self.language_model = _TEXT_MODELS[text.model_type](text)
        self.vision_tower = None
        if not language_model_only:
            self.vision_tower = VisionTower(vc, max(self.feature_layers))
            bias = getattr(config, "multimodal_projector_bias", True)
            self.multi_modal_projector = nn.Module()
            self.multi_modal_projector.linear_1 = nn.Linear(vc.hidden_size * len(self.feature_layers),
                                                            text.hidden_size, bias=bias)
            self.multi_modal_projector.linear_2 = nn.Linear(text.hidden_size, text.hidden_size, bias=bias)
            self.projector_act = _ACTS[config.projector_hidden_act]
            for module in (self.vision_tower, self.multi_modal_projector):
                for p in module.parameters():  # replicated on every tensor-parallel rank
                    replicated(p)

    def encode_images(self, items: list[dict[str, np.ndarray]]) -> list[torch.Tensor]:
        """Processed images (pixel_values [1, C, H, W] each) -> embeddings [tokens, hidden] each."""
        w = self.multi_modal_projector.linear_1.weight
        pixels = torch.cat([torch.from_numpy(np.asarray(it["pixel_values"])) for it in items]).to(w.device, w.dtype)
        feats = self.vision_tower(pixels, self.feature_layers)
        if self.drop_first:
            feats = [f[:, 1:] for f in feats]
        p = self.multi_modal_projector
        out = p.linear_2(self.projector_act(p.linear_1(torch.cat(feats, dim=-1))))
        return list(out)

    def dummy_image(self, num_tokens: int) -> dict[str, np.ndarray]:
        """Processed arrays of one image (memory profiling): the tower's input size is fixed."""
        vc = self.hf_config.vision_config
        return {"pixel_values": np.zeros((1, vc.num_channels, vc.image_size, vc.image_size), np.float32)}

    def hf_to_loom(self, name: str) -> str:
        """The Hub's names and transformers 5's alike: the first matching prefix of _RENAMES."""
        for old, new in _RENAMES:
            if name.startswith(old):
                return new + name[len(old):]
        return name

    def unused_weight(self, name: str) -> bool:
        return _unused_vision_weight(name)


_RENAMES = [("vision_tower.vision_model.", "vision_tower."), ("model.vision_tower.", "vision_tower."),
            ("model.multi_modal_projector.", "multi_modal_projector."),
            ("model.language_model.", "language_model.model."), ("lm_head.", "language_model.lm_head.")]


def _unused_vision_weight(name: str) -> bool:
    # the post-norm, SigLIP's pooling head, and layers past the deepest feature layer
    return name.startswith(("vision_tower.post_layernorm.", "vision_tower.head.", "vision_tower.encoder.layers."))
