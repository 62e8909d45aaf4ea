"""A tiny random Whisper checkpoint (WhisperForConditionalGeneration, d_model 64, 2 + 2 layers)
over the tests' tiny BPE tokenizer plus Whisper's special tokens, with a small Whisper feature
extractor (16 mel bins, 0.1 s hops: the 30 s window is 300 frames, 150 encoder positions);
and HF's greedy transcription of a clip, the oracle. Nothing is downloaded."""
from __future__ import annotations

import os

import numpy as np
import torch

from tests.tiny_audio_models import FEATURES
from tests.tiny_models import make_tokenizer
from tests.tiny_vl_models import _cached_hf

SPECIAL = ["<|startoftranscript|>", *(f"<|{code}|>" for code in ("en", "fr", "de", "es", "zh")), "<|translate|>",
           "<|transcribe|>", "<|startoflm|>", "<|startofprev|>", "<|nospeech|>", "<|notimestamps|>"]


def make_tiny_whisper(out_dir: str, seed: int = 0) -> str:
    from transformers import WhisperConfig, WhisperFeatureExtractor, WhisperForConditionalGeneration
    os.makedirs(out_dir, exist_ok=True)
    tok = make_tokenizer(out_dir)
    tok.add_special_tokens({"additional_special_tokens": SPECIAL})
    tok.eos_token = "<|endoftext|>"
    eos, sot = tok.convert_tokens_to_ids("<|endoftext|>"), tok.convert_tokens_to_ids("<|startoftranscript|>")
    frames = FEATURES["sampling_rate"] * FEATURES["chunk_length"] // FEATURES["hop_length"]
    config = WhisperConfig(vocab_size=len(tok) + 8, num_mel_bins=FEATURES["feature_size"], d_model=64,
                           encoder_layers=2, decoder_layers=2, encoder_attention_heads=4, decoder_attention_heads=4,
                           encoder_ffn_dim=128, decoder_ffn_dim=128, max_source_positions=frames // 2,
                           max_target_positions=96, decoder_start_token_id=sot, eos_token_id=eos, pad_token_id=eos,
                           bos_token_id=eos, begin_suppress_tokens=None, suppress_tokens=None)
    config.architectures = ["WhisperForConditionalGeneration"]
    torch.manual_seed(seed)
    model = WhisperForConditionalGeneration(config).eval()
    with torch.no_grad():   # larger than the random init, so that the output follows the audio
        for name, p in model.named_parameters():
            if p.dim() >= 2:
                p.normal_(0, 1.0 if "embed_tokens" in name else 0.5)
    model.save_pretrained(out_dir, safe_serialization=True)
    WhisperFeatureExtractor(**FEATURES).save_pretrained(out_dir)
    tok.save_pretrained(out_dir)
    return out_dir


def whisper_prompt(task: str = "transcribe", language: str = "en", prompt: str = "") -> str:
    prev = f"<|startofprev|>{prompt}" if prompt else ""
    return f"{prev}<|startoftranscript|><|{language}|><|{task}|><|notimestamps|>"


def hf_whisper_greedy(model_dir: str, samples: np.ndarray, rate: int, max_new_tokens: int,
                      task: str = "transcribe", language: str = "en", prompt: str = ""
                      ) -> tuple[list[int], list[int], np.ndarray]:
    """(decoder prompt ids, HF's greedy continuation, the input features): HF's
    WhisperFeatureExtractor on the mono clip at its rate (stereo averaged, other rates resampled
    with soxr here, as the server must do), then GenerationMixin.generate of
    WhisperForConditionalGeneration with the forced tokens as decoder_input_ids (Whisper's own
    generate adds its language detection and timestamp logic, which are off here)."""
    import soxr
    from transformers import AutoFeatureExtractor, AutoTokenizer, WhisperForConditionalGeneration
    from transformers.generation.utils import GenerationMixin
    fe = AutoFeatureExtractor.from_pretrained(model_dir)
    tok = AutoTokenizer.from_pretrained(model_dir)
    mono = (samples.mean(axis=1) if samples.ndim == 2 else samples).astype(np.float32)
    if rate != fe.sampling_rate:
        mono = soxr.resample(mono, rate, fe.sampling_rate).astype(np.float32)
    feats = fe([mono], sampling_rate=fe.sampling_rate, return_tensors="pt")["input_features"]
    ids = tok(whisper_prompt(task, language, prompt), add_special_tokens=False)["input_ids"]
    model = _cached_hf(model_dir, WhisperForConditionalGeneration)
    with torch.no_grad():
        out = GenerationMixin.generate(model, input_features=feats, decoder_input_ids=torch.tensor([ids]),
                                       max_new_tokens=max_new_tokens, do_sample=False,
                                       eos_token_id=tok.eos_token_id, pad_token_id=tok.eos_token_id)
    return ids, out[0, len(ids):].tolist(), feats.numpy()
