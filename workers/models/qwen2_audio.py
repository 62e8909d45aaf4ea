"""Qwen2-Audio: a Whisper-style audio encoder (two convolutions, sinusoidal positions stored as
weights, pre-norm transformer layers, a 2x average pool, a final norm), a linear projector, and
a Qwen2 language model fed `inputs_embeds` where the <|AUDIO|> placeholders sit.

Each clip's log-mel features are padded to the encoder's 30 s window (3000 frames at 16 kHz);
the padded frames are masked out of the encoder's attention as keys, and only the first
`placeholder_tokens` outputs (from the processed mask, multimodal/audio_info.py) are kept.
Weight names: the Hub's (`audio_tower.*`, `language_model.model.*`) and transformers 5's
(`model.audio_tower.*`, `model.language_model.*`, `lm_head.*`)."""
from __future__ import annotations


import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from multimodal.audio_info import AudioInfo
from workers.host_to_device import to_device
from workers.models.audio_lm import AudioLanguageModel
from workers.models.layers import replicated
from workers.models.qwen2 import Qwen2ForCausalLM


def conv_output_lengths(mel_frames: int) -> tuple[int, int]:
    """(after the stride-2 convolution, after the 2x pool) of a clip of `mel_frames` frames."""
    after_conv = (mel_frames - 1) // 2 + 1
    return after_conv, (after_conv - 2) // 2 + 1


class Qwen2AudioClips(AudioInfo):
    def image_token_id(self, hf: dict) -> int:   # (the placeholder token: <|AUDIO|>)
        return int(hf.get("audio_token_index", hf.get("audio_token_id", 151646)))

    def transcription_prompt(self, task: str, language: str | None, prompt: str) -> str:
        """Qwen2-Audio's speech-recognition prompt (its model card's), or translation into English."""
        ask = "Detect the language and recognize the speech:" if task == "transcribe" else \
            "Translate the speech into English:"
        lang = f" <|{language}|>" if language else ""
        return f"<|audio_bos|><|AUDIO|><|audio_eos|>{prompt}{ask}{lang}"

    def max_item_tokens(self, model_dir: str, hf: dict) -> int:
        return conv_output_lengths(2 * int((hf.get("audio_config") or {}).get("max_source_positions", 1500)))[1]

    def placeholder_tokens(self, hf: dict, arrays: dict[str, np.ndarray]) -> int | None:
        ac = hf.get("audio_config") or {}
        frames = 2 * int(ac.get("max_source_positions", 1500))
        feats, mask = arrays["input_features"], arrays["feature_attention_mask"]
        if feats.shape != (1, int(ac.get("num_mel_bins", 128)), frames) or mask.shape != (1, frames):
            return None
        n = int(mask.sum())
        return conv_output_lengths(n)[1] if n > 0 else None


class AudioEncoderLayer(nn.Module):
    def __init__(self, dim: int, heads: int, ffn: int):
        super().__init__()
        self.heads = heads
        self.self_attn_layer_norm = nn.LayerNorm(dim)
        self.final_layer_norm = nn.LayerNorm(dim)
        self.self_attn = nn.Module()
        self.self_attn.q_proj = nn.Linear(dim, dim)
        self.self_attn.k_proj = nn.Linear(dim, dim, bias=False)   # (Whisper's: no key bias)
        self.self_attn.v_proj = nn.Linear(dim, dim)
        self.self_attn.out_proj = nn.Linear(dim, dim)
        self.fc1, self.fc2 = nn.Linear(dim, ffn), nn.Linear(ffn, dim)

    def forward(self, x: torch.Tensor, key_mask: torch.Tensor) -> torch.Tensor:
        b, n, d = x.shape
        a = self.self_attn
        h = self.self_attn_layer_norm(x)
        q, k, v = (p(h).view(b, n, self.heads, -1).transpose(1, 2) for p in (a.q_proj, a.k_proj, a.v_proj))
        attn = F.scaled_dot_product_attention(q, k, v, attn_mask=key_mask)   # bidirectional over real frames
        x = x + a.out_proj(attn.transpose(1, 2).reshape(b, n, d))
        return x + self.fc2(F.gelu(self.fc1(self.final_layer_norm(x))))


class AudioEncoder(nn.Module):
    def __init__(self, ac):
        super().__init__()
        d = ac.d_model
        self.conv1 = nn.Conv1d(ac.num_mel_bins, d, kernel_size=3, padding=1)
        self.conv2 = nn.Conv1d(d, d, kernel_size=3, stride=2, padding=1)
        self.embed_positions = nn.Embedding(ac.max_source_positions, d)
        self.layers = nn.ModuleList(AudioEncoderLayer(d, ac.encoder_attention_heads, ac.encoder_ffn_dim)
                                    for _ in range(ac.encoder_layers))
        self.layer_norm = nn.LayerNorm(d)
        self.embed_scale = d ** 0.5 if getattr(ac, "scale_embedding", False) else 1.0

    def forward(self, feats: torch.Tensor, mel_frames: torch.Tensor) -> torch.Tensor:
        """Padded features [clips, mels, 2 * positions], real frames [clips] -> [clips, positions / 2, d]."""
        x = F.gelu(self.conv1(feats))
        x = F.gelu(self.conv2(x)).transpose(1, 2) * self.embed_scale
        x = x + self.embed_positions.weight[None, :x.shape[1]]
        valid = torch.arange(x.shape[1], device=x.device)[None, :] < ((mel_frames - 1) // 2 + 1)[:, None]
        key_mask = valid[:, None, None, :]   # padded frames are never attended to (HF's bidirectional mask)
        for layer in self.layers:
            x = layer(x, key_mask)
        x = F.avg_pool1d(x.transpose(1, 2), 2, 2).transpose(1, 2)
        return self.layer_norm(x)


class Qwen2AudioForConditionalGeneration(AudioLanguageModel):
    multimodal = Qwen2AudioClips()

    def __init__(self, config, language_model_only: bool = False):
        super().__init__()
        self.hf_config = config
        text = config.get_text_config()
        self.config = text
        self.language_model = Qwen2ForCausalLM(text)
        self.audio_tower = None
        if not language_model_only:
            ac = config.audio_config
            self.audio_tower = AudioEncoder(ac)
            self.multi_modal_projector = nn.Module()
            self.multi_modal_projector.linear = nn.Linear(ac.d_model, text.hidden_size)
            for module in (self.audio_tower, self.multi_modal_projector):
                for p in module.parameters():   # replicated on every tensor-parallel rank
                    replicated(p)

    def encode_images(self, items: list[dict[str, np.ndarray]]) -> list[torch.Tensor]:
        """Processed clips (the multimodal contract's name; input_features [1, mels, frames] and
        feature_attention_mask [1, frames] each) -> embeddings [tokens, hidden] each, in one pass."""
        w = self.multi_modal_projector.linear.weight
        clips = [torch.from_numpy(np.asarray(it["input_features"])) for it in items]
        feats = to_device(clips, w.device, w.dtype)
        frames = [int(np.asarray(it["feature_attention_mask"]).sum()) for it in items]
        lengths = to_device(torch.tensor(frames), w.device)
        out = self.multi_modal_projector.linear(self.audio_tower(feats, lengths))
        return [o[:conv_output_lengths(n)[1]] for o, n in zip(out, frames)]


