"""A tiny random Voxtral checkpoint (VoxtralForConditionalGeneration: Whisper encoder over 16 mel
bins, 240 positions, a 4-frame projector, a 2-layer Llama) and HF's greedy continuation, the
oracle. mistral_common (Voxtral's own processor) is not installed here: the features are
transformers' WhisperFeatureExtractor's, as Voxtral's processor computes them, each clip cut
into 30 s chunks (every chunk kept, the last padded), and the prompt's [AUDIO] is expanded to
chunks x 60 tokens, which HF's model checks against its features."""
from __future__ import annotations

import os

import numpy as np
import torch

from tests.tiny_models import make_tokenizer
from tests.tiny_vl_models import _cached_hf

SPECIAL = ["<s>", "[INST]", "[/INST]", "[BEGIN_AUDIO]", "[AUDIO]", "[TRANSCRIBE]"]
# 16 mel bins, 62.5 ms hops: the 30 s window is 480 frames, 240 encoder positions, 60 tokens a chunk
FEATURES = dict(feature_size=16, sampling_rate=16000, hop_length=1000, chunk_length=30, n_fft=400)


def make_tiny_voxtral(out_dir: str, seed: int = 0) -> str:
    from transformers import VoxtralConfig, VoxtralForConditionalGeneration, WhisperFeatureExtractor
    os.makedirs(out_dir, exist_ok=True)
    tok = make_tokenizer(out_dir)
    tok.add_special_tokens({"additional_special_tokens": SPECIAL})
    text = dict(model_type="llama", vocab_size=len(tok) + 8, hidden_size=64, intermediate_size=128,
                num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                max_position_embeddings=1024, eos_token_id=tok.convert_tokens_to_ids("<|im_end|>"),
                bos_token_id=None, pad_token_id=tok.convert_tokens_to_ids("<|endoftext|>"))
    audio = dict(num_mel_bins=16, d_model=32, encoder_layers=2, encoder_attention_heads=2, intermediate_size=128,
                 max_source_positions=240)
    config = VoxtralConfig(audio_config=audio, text_config=text, audio_token_id=tok.convert_tokens_to_ids("[AUDIO]"))
    config.architectures = ["VoxtralForConditionalGeneration"]
    torch.manual_seed(seed)
    model = VoxtralForConditionalGeneration(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() >= 2:
                p.normal_(0, 1.0 if "embed_tokens" in name else 0.2)
    model.save_pretrained(out_dir, safe_serialization=True)
    WhisperFeatureExtractor(**FEATURES).save_pretrained(out_dir)
    tok.save_pretrained(out_dir)
    return out_dir


def hf_voxtral_greedy(model_dir: str, prompt: str, clips: list[tuple[np.ndarray, int]], max_new_tokens: int
                      ) -> tuple[list[int], list[int]]:
    """(prompt ids with each [AUDIO] expanded, HF's greedy continuation)."""
    import soxr
    from transformers import AutoFeatureExtractor, AutoTokenizer, VoxtralForConditionalGeneration
    fe = AutoFeatureExtractor.from_pretrained(model_dir)
    tok = AutoTokenizer.from_pretrained(model_dir)
    audio_id = tok.convert_tokens_to_ids("[AUDIO]")
    chunk = fe.chunk_length * fe.sampling_rate
    feats, counts = [], []
    for samples, rate in clips:
        mono = (samples.mean(axis=1) if samples.ndim == 2 else samples).astype(np.float32)
        if rate != fe.sampling_rate:
            mono = soxr.resample(mono, rate, fe.sampling_rate).astype(np.float32)
        pieces = [mono[i:i + chunk] for i in range(0, len(mono), chunk)]
        f = fe(pieces, sampling_rate=fe.sampling_rate, padding="max_length", return_tensors="pt")["input_features"]
        feats.append(f)
        counts.append(len(pieces) * 60)
    ids = []
    it = iter(counts)
    for t in tok(prompt, add_special_tokens=False)["input_ids"]:
        ids += [audio_id] * next(it) if t == audio_id else [t]
    model = _cached_hf(model_dir, VoxtralForConditionalGeneration)
    x = torch.tensor([ids])
    kwargs = {"input_features": torch.cat(feats)} if feats else {}
    with torch.no_grad():
        g = model.generate(input_ids=x, attention_mask=torch.ones_like(x), max_new_tokens=max_new_tokens,
                           do_sample=False, eos_token_id=tok.convert_tokens_to_ids("<|im_end|>"), pad_token_id=0,
                           **kwargs)
    return ids, g[0, len(ids):].tolist()
