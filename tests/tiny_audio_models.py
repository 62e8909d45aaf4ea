"""Tiny random speech-language checkpoints (Qwen2-Audio) that the HF model classes and
AutoFeatureExtractor load, for parity tests; the processor is built here (a Whisper feature
extractor + the tests' tiny tokenizer), nothing is downloaded."""
from __future__ import annotations

import os

import numpy as np
import torch

from tests.tiny_models import make_tokenizer
from tests.tiny_vl_models import _cached_hf, _scale_weights

AUDIO_CHAT_TEMPLATE = (
    "{% set audio_count = namespace(value=0) %}"
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
    "{% if m['content'] is string %}{{ m['content'] }}{% else %}{% for part in m['content'] %}"
    "{% if part['type'] == 'audio' or 'audio_url' in part %}{% set audio_count.value = audio_count.value + 1 %}"
    "Audio {{ audio_count.value }}: <|audio_bos|><|AUDIO|><|audio_eos|>\n"
    "{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}{% endfor %}{% endif %}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")

AUDIO_SPECIAL = ["<|audio_bos|>", "<|AUDIO|>", "<|audio_eos|>"]
# a small mel front end: 16 mel bins, 0.1 s hops at 16 kHz, so that the 30 s window is 300 frames
FEATURES = dict(feature_size=16, sampling_rate=16000, hop_length=1600, chunk_length=30, n_fft=400)


def make_tiny_qwen2_audio(out_dir: str, seed: int = 0) -> str:
    """Qwen2-Audio: a 2-layer Whisper-style encoder over 16 mel bins (150 positions), the
    linear projector, and a 2-layer Qwen2 language model."""
    from transformers import Qwen2AudioConfig, Qwen2AudioForConditionalGeneration, WhisperFeatureExtractor
    os.makedirs(out_dir, exist_ok=True)
    tok = make_tokenizer(out_dir)
    tok.add_special_tokens({"additional_special_tokens": AUDIO_SPECIAL})
    tok.chat_template = AUDIO_CHAT_TEMPLATE
    text = dict(model_type="qwen2", vocab_size=len(tok) + 16, hidden_size=64, intermediate_size=128,
                num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                rms_norm_eps=1e-6, eos_token_id=tok.convert_tokens_to_ids("<|im_end|>"),
                pad_token_id=tok.convert_tokens_to_ids("<|endoftext|>"), bos_token_id=None)
    frames = FEATURES["sampling_rate"] * FEATURES["chunk_length"] // FEATURES["hop_length"]
    audio = dict(num_mel_bins=FEATURES["feature_size"], encoder_layers=2, encoder_attention_heads=2,
                 encoder_ffn_dim=64, d_model=32, max_source_positions=frames // 2)
    config = Qwen2AudioConfig(text_config=text, audio_config=audio,
                              audio_token_index=tok.convert_tokens_to_ids("<|AUDIO|>"))
    config.architectures = ["Qwen2AudioForConditionalGeneration"]
    torch.manual_seed(seed)
    model = Qwen2AudioForConditionalGeneration(config).eval()
    _scale_weights(model, seed)
    model.save_pretrained(out_dir, safe_serialization=True)
    WhisperFeatureExtractor(**FEATURES).save_pretrained(out_dir)
    tok.save_pretrained(out_dir)
    return out_dir


def speech_like(seed: int, seconds: float, rate: int, channels: int = 1) -> np.ndarray:
    """Noise bursts ("words") separated by near-silence, float32 [frames] or [frames, channels]."""
    rng = np.random.default_rng(seed)
    n = int(seconds * rate)
    t = np.arange(n) / rate
    envelope = (np.sin(2 * np.pi * 1.3 * t + rng.uniform(0, 6)) > -0.2).astype(np.float32) * 0.5 + 0.01
    x = (rng.standard_normal((n, channels)) * envelope[:, None]).astype(np.float32)
    return x[:, 0] if channels == 1 else x


def hf_qwen2_audio_greedy(model_dir: str, prompt: str, clips: list[tuple[np.ndarray, int]],
                          max_new_tokens: int) -> tuple[list[int], list[int]]:
    """(prompt ids with the audio tokens expanded, HF's greedy continuation): HF's
    Qwen2AudioProcessor (its feature extractor and tokenizer from the checkpoint), then
    Qwen2AudioForConditionalGeneration.generate. Stereo clips are averaged to mono and clips at
    another rate resampled with soxr here, as the server must do before the processor."""
    import soxr
    from transformers import AutoFeatureExtractor, AutoTokenizer, Qwen2AudioForConditionalGeneration, \
        Qwen2AudioProcessor
    fe = AutoFeatureExtractor.from_pretrained(model_dir)
    tok = AutoTokenizer.from_pretrained(model_dir)
    proc = Qwen2AudioProcessor(feature_extractor=fe, tokenizer=tok, chat_template=AUDIO_CHAT_TEMPLATE)
    audios = []
    for samples, rate in clips:
        mono = samples.mean(axis=1) if samples.ndim == 2 else samples
        audios.append(soxr.resample(mono.astype(np.float32), rate, fe.sampling_rate) if rate != fe.sampling_rate
                      else mono.astype(np.float32))
    kwargs = {}
    if audios:
        inputs = proc(text=prompt, audio=audios, sampling_rate=fe.sampling_rate, return_tensors="pt")
        kwargs = dict(input_features=inputs["input_features"], feature_attention_mask=inputs["feature_attention_mask"])
    else:
        inputs = proc(text=prompt, return_tensors="pt")
    ids = inputs["input_ids"]
    model = _cached_hf(model_dir, Qwen2AudioForConditionalGeneration)
    with torch.no_grad():
        g = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                           do_sample=False, eos_token_id=tok.convert_tokens_to_ids("<|im_end|>"), pad_token_id=0,
                           **kwargs)
    return ids[0].tolist(), g[0, ids.shape[1]:].tolist()
