"""Voxtral (VoxtralForConditionalGeneration): Whisper's encoder, a projector over every 4
consecutive encoder frames (linear, GELU, linear), and a Llama/Mistral language model fed
`inputs_embeds` where the [AUDIO] placeholders sit: a decoder-only speech-language model like
Qwen2-Audio.

Audio longer than the encoder's 30 s window is cut into 30 s chunks and every chunk is kept (seed
#34140), the last one padded; each chunk's log-mel features are Whisper's (Voxtral's processor,
from mistral_common, computes them with the Whisper feature extractor; Loom uses transformers'
WhisperFeatureExtractor from the checkpoint's preprocessor_config.json), and the placeholder count
comes from those processed, padded features: chunks x max_source_positions x d_model /
intermediate_size (375 per chunk for Voxtral-Mini). Weight names: the Hub's (`audio_tower.*`,
`language_model.model.*`) and transformers 5's (`model.audio_tower.*`, `model.language_model.*`)."""
from __future__ import annotations


import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from multimodal.audio import MAX_AUDIO_SECONDS, as_audio, load_audio_url
from multimodal.audio_info import AudioInfo, sampling_rate, window_seconds
from workers.models.audio_lm import AudioLanguageModel
from workers.models.layers import replicated
from workers.models.llama import LlamaForCausalLM
from workers.models.whisper import WhisperEncoder


def tokens_per_chunk(ac: dict) -> int:
    """Language-model tokens of one 30 s chunk: its encoder frames, 4 to a token (d_model /
    intermediate_size of them: the projector's input is intermediate_size wide)."""
    d_model = int(ac.get("hidden_size", ac.get("d_model", 1280)))   # (transformers 5 writes hidden_size)
    return int(ac.get("max_source_positions", 1500)) * d_model // int(ac.get("intermediate_size", 5120))


class VoxtralAudio(AudioInfo):
    """Clips up to 600 s, cut into the encoder's 30 s chunks, every chunk kept."""

    def image_token_id(self, hf: dict) -> int:   # (the placeholder token: [AUDIO])
        return int(hf.get("audio_token_id", 24))

    def transcription_prompt(self, task: str, language: str | None, prompt: str) -> str:
        """Voxtral's transcription request ([INST][BEGIN_AUDIO][AUDIO]...[/INST]lang:xx[TRANSCRIBE]),
        as mistral_common writes it; translation is asked in words."""
        lang = f"lang:{language}" if language else ""
        if task == "transcribe":
            return f"<s>[INST][BEGIN_AUDIO][AUDIO][/INST]{lang}[TRANSCRIBE]{prompt}"
        return f"<s>[INST][BEGIN_AUDIO][AUDIO]Translate this audio into English.{prompt}[/INST]"

    def max_item_tokens(self, model_dir: str, hf: dict) -> int:
        chunks = -(-int(MAX_AUDIO_SECONDS) // int(window_seconds(model_dir)))   # the longest clip accepted
        return chunks * tokens_per_chunk(hf.get("audio_config") or {})

    def prepare(self, obj, model_dir: str):
        return as_audio(obj, sampling_rate(model_dir))   # (longer than the window: chunked, not refused)

    async def load_url(self, url: str, allowed_dir: str | None, off_loop, model_dir: str):
        return await load_audio_url(url, allowed_dir, off_loop, sampling_rate(model_dir))

    def run_processor(self, processor, item, call_kwargs: dict):
        chunk = int(processor.chunk_length * item.sample_rate)   # (the extractor's window, 30 s)
        pieces = [item.samples[i:i + chunk] for i in range(0, len(item.samples), chunk)] or [item.samples]
        return processor(pieces, sampling_rate=item.sample_rate, padding="max_length", return_attention_mask=True,
                         return_tensors="np", **call_kwargs)

    def placeholder_tokens(self, hf: dict, arrays: dict[str, np.ndarray]) -> int | None:
        ac = hf.get("audio_config") or {}
        feats = arrays["input_features"]
        frames = 2 * int(ac.get("max_source_positions", 1500))
        if feats.ndim != 3 or feats.shape[1:] != (int(ac.get("num_mel_bins", 128)), frames) or not len(feats):
            return None
        return len(feats) * tokens_per_chunk(ac)


class VoxtralForConditionalGeneration(AudioLanguageModel):
    multimodal = VoxtralAudio()

    def __init__(self, config, language_model_only: bool = False):
        super().__init__()
        self.hf_config = config
        text = config.get_text_config()
        self.config = text
        self.language_model = LlamaForCausalLM(text)
        self.audio_tower = None
        if not language_model_only:
            ac = config.audio_config
            self.audio_tower = WhisperEncoder(ac)
            self.frames_per_token = ac.intermediate_size // ac.d_model
            self.multi_modal_projector = nn.Module()
            self.multi_modal_projector.linear_1 = nn.Linear(ac.intermediate_size, text.hidden_size, bias=False)
            self.multi_modal_projector.linear_2 = nn.Linear(text.hidden_size, text.hidden_size, bias=False)
            for module in (self.audio_tower, self.multi_modal_projector):
                for p in module.parameters():   # replicated on every tensor-parallel rank
                    replicated(p)

    def encode_images(self, items: list[dict[str, np.ndarray]]) -> list[torch.Tensor]:
        """Processed clips (input_features [chunks, mels, frames] each) -> embeddings [tokens, hidden]
        each, every chunk of every clip in one pass of the encoder."""
        w = self.multi_modal_projector.linear_1.weight
        feats = [torch.from_numpy(np.asarray(it["input_features"])) for it in items]
        out = self.audio_tower(torch.cat(feats).to(w.device, w.dtype))   # [chunks, positions, d]
        p = self.multi_modal_projector
        embeds = p.linear_2(F.gelu(p.linear_1(out.reshape(-1, p.linear_1.in_features))))
        return list(embeds.split([len(f) * out.shape[1] // self.frames_per_token for f in feats]))

