"""split_audio (seed #34628): the clips are contiguous (concatenated, they are the input, no
sample lost or repeated), none is longer than max_audio_clip_s, and each cut is at the start of
the lowest-RMS window of its search region (a property test over random signals), plus the
audio loading helpers' refusals and decode_audio's floats (libsndfile's own, for every subtype)."""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from multimodal.audio import as_audio, decode_audio, to_mono
from multimodal.audio_split import split_audio
from multimodal.media import MediaError


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 2 ** 31), rate=st.sampled_from([100, 160, 400]), seconds=st.floats(0.01, 12.0),
       clip_s=st.floats(1.0, 4.0), overlap_frac=st.floats(0.0, 0.9), window=st.integers(1, 40),
       stereo=st.booleans())
def test_split_audio_loses_nothing_and_cuts_at_the_quietest_window(seed, rate, seconds, clip_s, overlap_frac,
                                                                   window, stereo):
    rng = np.random.default_rng(seed)
    n = max(1, int(seconds * rate))
    x = rng.standard_normal((2, n) if stereo else n).astype(np.float32) * rng.uniform(0, 1, n).astype(np.float32)
    overlap_s = clip_s * overlap_frac
    clips = split_audio(x, rate, max_audio_clip_s=clip_s, overlap_chunk_second=overlap_s,
                        min_energy_split_window_size=window)
    assert np.array_equal(np.concatenate(clips, axis=-1), x)       # every sample, once, in order
    clip, overlap = int(rate * clip_s), int(rate * overlap_s)
    start = 0
    for c in clips[:-1]:
        length = c.shape[-1]
        assert 0 < length <= clip
        lo, hi = start + clip - overlap, start + clip
        cut = start + length
        k = (hi - lo) // window
        if k == 0:
            assert cut == hi
        else:
            power = (x.astype(np.float64) ** 2)
            power = power.mean(axis=0) if stereo else power
            energies = [power[lo + j * window: lo + (j + 1) * window].mean() for j in range(k)]
            assert (cut - lo) % window == 0 and lo <= cut < hi
            assert energies[(cut - lo) // window] == min(energies)
        start = cut
    assert 0 < clips[-1].shape[-1] <= clip


def test_split_audio_95_seconds_in_4_pieces():
    rate = 16000
    x = np.random.default_rng(0).standard_normal(95 * rate).astype(np.float32)
    x[29 * rate + 8000: 29 * rate + 9600] = 0   # a pause in the first clip's search second
    clips = split_audio(x, rate, max_audio_clip_s=30, overlap_chunk_second=1, min_energy_split_window_size=1600)
    assert len(clips) == 4 and sum(len(c) for c in clips) == len(x)
    assert len(clips[0]) == 29 * rate + 8000   # the pause


def test_audio_helpers_refuse_bad_input():
    with pytest.raises(MediaError, match="not an audio file"):
        decode_audio(b"RIFF" + b"\0" * 100, 16000)
    with pytest.raises(MediaError, match="at most 2 s"):
        as_audio((np.zeros(3 * 8000, np.float32), 8000), 16000, max_seconds=2)
    with pytest.raises(MediaError, match="sample rate"):
        as_audio((np.zeros(10, np.float32), 0), 16000)
    with pytest.raises(MediaError, match="NaN"):
        to_mono(np.array([0.0, np.nan], np.float32))
    with pytest.raises(MediaError, match="empty"):
        as_audio((np.zeros(0, np.float32), 16000), 16000)
    a = as_audio((np.ones((2, 44100), np.float32) * [[1.0], [0.0]], 44100), 16000)   # channels first
    assert a.sample_rate == 16000 and abs(len(a.samples) - 16000) <= 1 and np.allclose(a.samples[100:-100], 0.5,
                                                                                       atol=1e-2)


@pytest.mark.parametrize("fmt,subtype", [("WAV", "PCM_16"), ("FLAC", "PCM_16"), ("WAV", "PCM_24"), ("WAV", "FLOAT")])
@pytest.mark.parametrize("channels", [1, 2])
def test_decode_audio_equals_soundfiles_float_decoding(fmt, subtype, channels):
    """16-bit PCM is read as integers and scaled by decode_audio itself: the floats libsndfile's own
    float32 decoding gives, every sample (full scale both ways included); other subtypes are
    libsndfile's floats. Channels are averaged."""
    import io

    import soundfile as sf
    rng = np.random.default_rng(channels)
    x = rng.uniform(-1, 1, (4000, channels)).astype(np.float32)
    x[:2] = [[-1.0] * channels, [1.0] * channels]
    buf = io.BytesIO()
    sf.write(buf, x, 16000, format=fmt, subtype=subtype)
    data = buf.getvalue()
    ref = sf.read(io.BytesIO(data), dtype="float32", always_2d=True)[0].mean(axis=1)
    got = decode_audio(data, 16000)
    assert got.samples.dtype == np.float32 and got.sample_rate == 16000
    np.testing.assert_array_equal(got.samples, ref)
