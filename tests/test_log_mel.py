"""multimodal/log_mel.py: Whisper's log-mel features of a clip equal WhisperFeatureExtractor's call
(padded to the window, with the attention mask) to a rounding, at every clip length that changes
how much of the STFT it computes: short clips, hop multiples, the lengths within n_fft of the
window's end (where the STFT's reflection reaches the clip), the whole window and a longer clip
(cut); at large-v3's settings, the default 80 mels and the tests' 0.1 s hops."""
import numpy as np
import pytest

from multimodal.log_mel import supports, whisper_log_mel


@pytest.mark.parametrize("settings", [dict(feature_size=128), dict(feature_size=80),
                                      dict(feature_size=16, hop_length=1600)])
def test_log_mel_equals_the_extractors_call(settings):
    from transformers import WhisperFeatureExtractor
    fe = WhisperFeatureExtractor(**settings)
    assert supports(fe) and not supports(WhisperFeatureExtractor(dither=1e-4, **settings))
    n, rng = fe.n_samples, np.random.default_rng(0)
    lengths = [1, 399, 400, 401, 1600, 16000, 160000, 160001, n - 401, n - 400, n - 399, n - 200, n - 1, n, n + 5000]
    for length in lengths + [int(x) for x in rng.integers(1000, n, 6)]:
        clip = (rng.standard_normal(length) * 0.1 * (np.arange(length) % 4000 < 2500)).astype(np.float32)
        ref = fe([clip], sampling_rate=16000, padding="max_length", return_attention_mask=True, return_tensors="np")
        got = whisper_log_mel(fe, clip)
        assert got["input_features"].dtype == np.float32 and got["attention_mask"].dtype == np.int32
        assert got["input_features"].shape == ref["input_features"].shape, length
        np.testing.assert_allclose(got["input_features"], ref["input_features"], rtol=0, atol=1e-6, err_msg=str(length))
        np.testing.assert_array_equal(got["attention_mask"], ref["attention_mask"], err_msg=str(length))
