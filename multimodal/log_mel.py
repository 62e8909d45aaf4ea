"""Whisper's log-mel features of one clip, as WhisperFeatureExtractor computes them (its torch
path: the clip zero-padded to the 30 s window, a centred STFT with a periodic Hann window,
power spectrum through the Slaney mel filters, log10 floored at 1e-10 and at the maximum
minus 8, then (x + 4) / 4), for a fraction of its host time (bench/whisper_host.py).

What differs is only where the work is: the extractor computes the STFT of all 30 s, most of it
padding, and its call pads, masks and converts arrays on the way. Here the STFT runs over the
frames whose window holds a sample of the clip (a 20 s clip: two thirds of them), over a
prefix of the padded signal long enough that none of those frames reaches its end (so the
STFT's reflection there never enters them); the other frames' power is exactly zero, as the
extractor's is for an all-zero window, so their features are one value (the floor's log, under
the same maximum), written once rather than computed per frame. The power spectrum is
re^2 + im^2 rather than |z|^2 (no square root), and the mel filters are a sparse matrix (each
a triangle over a few FFT bins: the product adds only the terms that are not zero, in another
order): equal to a rounding. A clip within n_fft of the window's end goes whole.

A 20 s clip at large-v3's 128 mels, on one core of the CPU box: 3.3 ms, from 4.8 ms with the
dense filters and the floors computed over every frame.

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
    stft = torch.stft(signal, n_fft, hop, window=_window(n_fft), return_complex=True)[:, :touched]
    re, im = stft.real, stft.imag
    power = (re * re + im * im).contiguous()   # ([bins, frames] row-major: the sparse product's fast layout)
    log_spec = torch.sparse.mm(_mel_filters(extractor), power).clamp_(min=1e-10).log10_()
    top = log_spec.max()
    if touched < frames:   # the other frames' power is zero: their log is the floor's, 1e-10's
        top = torch.maximum(top, _zero_log())
    floor = top - 8.0
    features = np.empty((1, extractor.feature_size, frames), dtype=np.float32)
    features[0, :, :touched] = torch.maximum(log_spec, floor, out=log_spec).add_(4.0).div_(4.0).numpy()
    features[0, :, touched:] = float((torch.maximum(_zero_log(), floor) + 4.0) / 4.0)
    mask = (np.arange(frames) * hop < length).astype(np.int32)[None]
    return {"input_features": features, "attention_mask": mask}


_CACHE: dict = {}   # (what, settings) -> a constant of the computation, built once per process


def _window(n_fft: int):
    import torch
    key = ("window", n_fft)
    if key not in _CACHE:
        _CACHE[key] = torch.hann_window(n_fft)
    return _CACHE[key]


def _zero_log():
    """log10 of the floor 1e-10 (float32): the log of a frame whose power is zero."""
    import torch
    if "zero_log" not in _CACHE:
        _CACHE["zero_log"] = torch.full((64,), 1e-10, dtype=torch.float32).log10()[0]   # (the vectorised log10)
    return _CACHE["zero_log"]


def _mel_filters(extractor):
    """The extractor's Slaney mel filters [mels, bins], float32, as a sparse matrix: a filter is a
    triangle over a few FFT bins (large-v3's 128: 394 of 25,728 weights are not zero), so the
    product with the power spectrum is a tenth of the dense one's time. The filters follow from
    these three settings (WhisperFeatureExtractor.__init__)."""
    import torch
    key = ("mel", extractor.feature_size, extractor.sampling_rate, extractor.n_fft)
    if key not in _CACHE:
        _CACHE[key] = torch.from_numpy(extractor.mel_filters).to(torch.float32).T.to_sparse().coalesce()
    return _CACHE[key]
