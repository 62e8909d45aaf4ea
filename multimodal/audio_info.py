"""AudioInfo: the MultiModalInfo of a speech-language model whose audio goes through a Whisper
feature extractor (Qwen2-Audio; Voxtral and Ultravox alike): clips decoded and resampled to the
extractor's rate (multimodal/audio.py), log-mel features padded to the encoder's 30 s window
with their attention mask, and the placeholder count taken from that processed, padded mask
(seed #34140: never from the raw sample count). The arrays travel through the shared-memory
store exactly as images do; an item's hash is its resampled samples and rate."""
from __future__ import annotations

import functools

import numpy as np

from multimodal.audio import Audio, as_audio, load_audio_url
from multimodal.info import MultiModalInfo, preprocessor_config


@functools.lru_cache(maxsize=16)
def sampling_rate(model_dir: str) -> int:
    """The feature extractor's rate (Whisper's 16 kHz when the checkpoint does not say)."""
    return int(preprocessor_config(model_dir).get("sampling_rate", 16000))


@functools.lru_cache(maxsize=16)
def window_seconds(model_dir: str) -> float:
    """The longest clip the extractor keeps (chunk_length, 30 s for Whisper): a longer one
    would be cut silently by the processor, so it is refused (the transcription endpoint splits)."""
    return float(preprocessor_config(model_dir).get("chunk_length", 30))


class AudioInfo(MultiModalInfo):
    modality = "audio"

    def prepare(self, obj, model_dir: str) -> Audio:
        return as_audio(obj, sampling_rate(model_dir), window_seconds(model_dir))

    async def load_url(self, url: str, allowed_dir: str | None, off_loop, model_dir: str) -> Audio:
        audio = await load_audio_url(url, allowed_dir, off_loop, sampling_rate(model_dir))
        limit = window_seconds(model_dir)
        if audio.seconds > limit:
            from multimodal.media import MediaError
            raise MediaError(f"the audio is {audio.seconds:.1f} s long; this model takes at most {limit:g} s per clip")
        return audio

    def content_bytes(self, item: Audio) -> tuple[str, bytes]:
        return f"audio:{item.sample_rate}:{len(item.samples)}", item.samples.tobytes()

    def load_processor(self, model_dir: str, trust_remote_code: bool):
        from transformers import AutoFeatureExtractor
        return AutoFeatureExtractor.from_pretrained(model_dir, trust_remote_code=trust_remote_code)

    def run_processor(self, processor, item: Audio, call_kwargs: dict):
        # the extractor's call: padded to the 30 s window, with the attention mask; a plain
        # WhisperFeatureExtractor's arrays come from multimodal/log_mel.py (equal to a rounding,
        # for half the host time)
        from multimodal.log_mel import supports, whisper_log_mel
        if not call_kwargs and supports(processor) and item.sample_rate == processor.sampling_rate:
            return whisper_log_mel(processor, item.samples)
        return processor([item.samples], sampling_rate=item.sample_rate, padding="max_length",
                         return_attention_mask=True, return_tensors="np", **call_kwargs)

    def arrays(self, out) -> dict[str, np.ndarray]:
        return {"input_features": np.ascontiguousarray(out["input_features"], dtype=np.float32),
                "feature_attention_mask": np.ascontiguousarray(out["attention_mask"], dtype=np.int32)}
