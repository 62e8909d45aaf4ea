"""vLLM's `asr` dataset for `loom bench serve` (seed #32300): streamed requests to
/v1/audio/transcriptions, one audio file each, from --asr-dataset-path (a directory of wav,
flac, ogg or mp3 files, taken in name order, cycled) or, without it, generated speech-like audio
(noise "words" between pauses, 16 kHz). Clips outside [--asr-min-audio-len-sec,
--asr-max-audio-len-sec] are skipped. The report adds RTFx: seconds of audio transcribed per
second of wall time (the Open ASR leaderboard's measure)."""
from __future__ import annotations

import io
import os

import numpy as np

RATE = 16000
EXTENSIONS = (".wav", ".flac", ".ogg", ".mp3")


def add_args(p) -> None:
    p.add_argument("--asr-dataset-path", default=None,
                   help="asr: a directory of audio files (default: generated speech-like audio)")
    p.add_argument("--asr-min-audio-len-sec", type=float, default=0.0, help="asr: skip shorter clips")
    p.add_argument("--asr-max-audio-len-sec", type=float, default=30.0, help="asr: skip longer clips")


def _wav(samples: np.ndarray, rate: int) -> bytes:
    import soundfile as sf
    buf = io.BytesIO()
    sf.write(buf, samples, rate, format="WAV", subtype="PCM_16")
    return buf.getvalue()


def speech_like(rng: np.random.Generator, seconds: float) -> np.ndarray:
    n = int(seconds * RATE)
    t = np.arange(n) / RATE
    words = (np.sin(2 * np.pi * rng.uniform(1.0, 2.5) * t + rng.uniform(0, 6)) > -0.3).astype(np.float32)
    return (rng.standard_normal(n).astype(np.float32) * (0.3 * words + 0.003)).clip(-1, 1)


def clips(args, num: int) -> list[tuple[str, bytes, float]]:
    """(file name, bytes, seconds) of each request, made before the clock starts."""
    lo, hi = args.asr_min_audio_len_sec, args.asr_max_audio_len_sec
    if lo > hi:
        raise SystemExit("--asr-min-audio-len-sec is above --asr-max-audio-len-sec")
    if args.asr_dataset_path is None:
        rng = np.random.default_rng(args.seed)
        out = []
        for i in range(num):
            seconds = float(rng.uniform(max(lo, 0.5), max(hi, 0.5)))
            out.append((f"gen{i}.wav", _wav(speech_like(rng, seconds), RATE), seconds))
        return out
    import soundfile as sf
    files = sorted(f for f in os.listdir(args.asr_dataset_path) if f.lower().endswith(EXTENSIONS))
    usable = []
    for name in files:
        path = os.path.join(args.asr_dataset_path, name)
        try:
            info = sf.info(path)
        except Exception:   # noqa: BLE001  (not audio soundfile reads: skipped)
            continue
        seconds = info.frames / info.samplerate
        if lo <= seconds <= hi:
            with open(path, "rb") as f:
                usable.append((name, f.read(), seconds))
    if not usable:
        raise SystemExit(f"--asr-dataset-path {args.asr_dataset_path}: no audio file of {lo}-{hi} s")
    return [usable[i % len(usable)] for i in range(num)]


def payload(model: str, clip: tuple[str, bytes, float], temperature: float, max_tokens: int) -> dict:
    """A transcription request as bench/serve.py's send_request posts it (multipart: the `form` key)."""
    name, data, seconds = clip
    return {"form": {"model": model, "response_format": "json", "temperature": str(temperature),
                     "stream": "true", "max_completion_tokens": str(max_tokens)},
            "file": (name, data), "audio_seconds": seconds}
