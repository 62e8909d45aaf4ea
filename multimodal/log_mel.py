"""Whisper's log-mel features of one clip, as WhisperFeatureExtractor computes them (its torch
path: the clip zero-padded to the 30 s window, a centred STFT with a periodic Hann window,
power spectrum through the Slaney mel filters, log10 floored at 1e-10 and at the maximum
minus 8, then (x + 4) / 4), for half its host time.

What differs is only where the work is: the extractor computes the STFT of all 30 s, most of it
padding, and its call pads, masks and converts arrays on the way. Here the STFT runs over the
frames whose window holds a sample of the clip (a 20 s clip: two thirds of them), over a
prefix of the padded signal long enough that none of those frames reaches its end (so the
STFT's reflection there never enters them); the other frames' power is exactly zero, as the
extractor's is for an all-zero window, and the floors and the maximum are taken over all of
them as the extractor takes them. The power spectrum is re^2 + im^2 rather than |z|^2 (no
square root): equal to a rounding. A clip within n_fft of the window's end goes whole.

The attention mask is the extractor's: frame k is the clip's where sample k * hop is."""
from __future__ import annotations

import numpy as np


def supports(extractor) -> bool:
    """Whether `extractor` is one whose call this file reproduces: a WhisperFeatureExtractor (not
    a subclass with its own rules) without dithering, padding with zeros."""
    from transformers import WhisperFeatureExtractor
    return (type(extractor) is WhisperFeatureExtractor and not getattr(extractor, "dither", 0.0)
            and extractor.padding_value == 0.0)


def whisper_log_mel(extractor, samples: np.ndarray) -> dict[str, np.ndarray]:
    """{"input_features": [1, mels, frames] float32, "attention_mask": [1, frames] int32} of a mono
    float32 clip, as extractor([samples], padding="max_length", return_attention_mask=True)
    gives them (a clip longer than the window is cut to it, as the extractor's truncation does)."""
    import torch
    n, hop, n_fft = extractor.n_samples, extractor.hop_length, extractor.n_fft
    x = torch.from_numpy(np.ascontiguousarray(samples[:n], dtype=np.float32))
    length, frames = x.shape[0], n // hop
    touched = min(frames, -(-(length + n_fft // 2) // hop))   # frames whose window holds a sample
    prefix = (touched - 1) * hop + n_fft // 2 + 1             # their windows end before it
    if length + n_fft >= n or prefix >= n:   # (near the end, the STFT's own reflection reaches the clip)
        prefix, touched = n, frames
    prefix = max(prefix, n_fft)   # (the reflection at the start needs more than n_fft // 2 samples)
    signal = torch.zeros(prefix, dtype=torch.float32)
    signal[:min(length, prefix)] = x[:prefix]
    window = torch.hann_window(n_fft)
    stft = torch.stft(signal, n_fft, hop, window=window, return_complex=True)[:, :touched]
    re, im = stft.real, stft.imag
    power = re * re + im * im
    mel = torch.zeros(extractor.feature_size, frames, dtype=torch.float32)
    mel[:, :touched] = torch.from_numpy(extractor.mel_filters).to(torch.float32).T @ power
    log_spec = torch.clamp(mel, min=1e-10).log10()
    log_spec = torch.maximum(log_spec, log_spec.max() - 8.0)
    features = ((log_spec + 4.0) / 4.0).numpy()[None]
    mask = (np.arange(frames) * hop < length).astype(np.int32)[None]
    return {"input_features": features, "attention_mask": mask}
