"""split_audio: long audio cut into clips a speech model's window takes, at low-energy points
(vLLM's split_audio, seed #34628), for the transcription endpoints and for offline use:

    from multimodal.audio_split import split_audio
    clips = split_audio(samples, 16000, max_audio_clip_s=30, overlap_chunk_second=1,
                        min_energy_split_window_size=1600)

Each cut is searched in the last `overlap_chunk_second` seconds before the clip would reach
`max_audio_clip_s`: that region is scanned in windows of `min_energy_split_window_size`
samples, and the clip ends where the window of least RMS energy begins (a pause between
words, rather than mid-word). The clips are contiguous: concatenated, they are the input,
sample for sample (none dropped, none repeated)."""
from __future__ import annotations

import numpy as np


def find_split_point(samples: np.ndarray, start: int, end: int, window: int) -> int:
    """The first sample of the lowest-RMS window of `window` samples in samples[start:end]
    (windows start at start, start + window, ...; the first of equal ones wins); `end` when no
    whole window fits."""
    n = (end - start) // window
    if n < 1:
        return end
    seg = np.asarray(samples[..., start:start + n * window], dtype=np.float64)
    if seg.ndim > 1:   # channels: the energy of all of them
        seg = (seg ** 2).mean(axis=tuple(range(seg.ndim - 1)))
    else:
        seg = seg ** 2
    energy = seg.reshape(n, window).mean(axis=1)
    return start + int(np.argmin(energy)) * window


def split_audio(samples: np.ndarray, sample_rate: int, max_audio_clip_s: float = 30.0,
                overlap_chunk_second: float = 1.0, min_energy_split_window_size: int = 1600
                ) -> list[np.ndarray]:
    """Clips (views of `samples`, time on the last axis) of at most max_audio_clip_s seconds
    each, cut at the quietest window of the last overlap_chunk_second seconds of each."""
    if sample_rate <= 0 or max_audio_clip_s <= 0:
        raise ValueError("sample_rate and max_audio_clip_s must be positive")
    if not 0 <= overlap_chunk_second < max_audio_clip_s:
        raise ValueError("overlap_chunk_second must be in [0, max_audio_clip_s)")
    if min_energy_split_window_size < 1:
        raise ValueError("min_energy_split_window_size must be at least 1")
    total = samples.shape[-1]
    clip = max(1, int(sample_rate * max_audio_clip_s))
    overlap = int(sample_rate * overlap_chunk_second)
    clips, i = [], 0
    while i < total:
        if i + clip >= total:
            clips.append(samples[..., i:])
            break
        cut = find_split_point(samples, i + clip - overlap, i + clip, min_energy_split_window_size)
        clips.append(samples[..., i:cut])
        i = cut
    return clips
