"""Host cost per clip of Whisper's serving path before the GPU, stage by stage, on this machine's
CPU: a speech-like clip (20 s by default) at Whisper-large-v3's feature settings (128 mel bins,
the 30 s window), as an API server handles a transcription (frontend/openai/serving_transcription.py):
the multipart form read, the WAV decoded (soundfile) and split (split_audio), the clip hashed,
its log-mel features computed (AudioInfo.run_processor: multimodal/log_mel.py;
transformers' WhisperFeatureExtractor call beside it, which it replaced) and the arrays put in
the shared-memory store; then the same log-mel work on `--pool` threads at once, as an API
server's media threads run it.

  python3 -m bench.whisper_host [--seconds 20] [--iters 20] [--threads 1] [--pool 8] [--busy 0]

--threads: torch's intra-op threads (API servers run one since 264a6e0; 0: torch's default, one
per core). --busy N: N processes spin meanwhile, as a server's other processes (the engine
core, the worker, other API servers) keep cores busy. Each row is wall ms and CPU ms (this
process) per clip."""
from __future__ import annotations

import argparse
import asyncio
import hashlib
import multiprocessing
import os
import time


def _timed(fn, iters: int) -> tuple[float, float]:
    fn()   # warm
    c0, t0 = time.process_time(), time.perf_counter()
    for _ in range(iters):
        fn()
    return 1e3 * (time.perf_counter() - t0) / iters, 1e3 * (time.process_time() - c0) / iters


def _form_reader(body: bytes, content_type: str):
    """read_form of the endpoint over a request whose body is `body`: aiohttp's MultipartReader
    over a stream fed the bytes (what web.Request.multipart() returns)."""
    from aiohttp import MultipartReader, hdrs, streams
    from aiohttp.base_protocol import BaseProtocol

    from frontend.openai.serving_transcription import read_form

    class Request:   # the two things read_form asks of a web.Request
        def __init__(self, stream):
            self.content_type, self._stream = content_type.split(";")[0], stream

        async def multipart(self):
            return MultipartReader({hdrs.CONTENT_TYPE: content_type}, self._stream)

    async def run():
        loop = asyncio.get_running_loop()
        stream = streams.StreamReader(BaseProtocol(loop), len(body), loop=loop)   # (fed whole: no pause)
        stream.feed_data(body)
        stream.feed_eof()
        return await read_form(Request(stream))

    loop = asyncio.new_event_loop()
    return lambda: loop.run_until_complete(run())


def _spin(stop) -> None:
    while not stop.is_set():
        pass


def _multipart(wav: bytes) -> tuple[bytes, str]:
    from aiohttp import FormData
    form = FormData()
    form.add_field("file", wav, filename="a.wav", content_type="audio/wav")
    for k, v in (("model", "whisper"), ("language", "en"), ("temperature", "0"), ("max_completion_tokens", "64")):
        form.add_field(k, v)
    body = form()

    class Sink:
        def __init__(self):
            self.parts = []

        async def write(self, data):
            self.parts.append(bytes(data))

    sink = Sink()
    asyncio.run(body.write(sink))
    return b"".join(sink.parts), body.content_type


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seconds", type=float, default=20.0)
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--threads", type=int, default=1, help="torch intra-op threads (0: torch's default)")
    p.add_argument("--pool", type=int, default=8, help="threads computing log-mels at once (the media pool)")
    p.add_argument("--busy", type=int, default=0, help="processes that spin meanwhile (a server's others)")
    args = p.parse_args(argv)
    stop = multiprocessing.Event()
    spinners = [multiprocessing.Process(target=_spin, args=(stop,), daemon=True) for _ in range(args.busy)]
    for s in spinners:
        s.start()
    try:
        _measure(args)
    finally:
        stop.set()
        for s in spinners:
            s.join()


def _measure(args) -> None:
    if args.threads:
        os.environ["OMP_NUM_THREADS"] = str(args.threads)   # (before torch is imported, as an API server does)
    import numpy as np
    import torch
    from transformers import WhisperFeatureExtractor

    from bench.asr import RATE, _wav, speech_like
    from bench.whisper_asr import FEATURES
    from multimodal.audio import Audio, decode_audio
    from multimodal.audio_split import split_audio
    from shm.object_store import ObjectStoreWriter
    from workers.models.whisper import WhisperAudio

    fe = WhisperFeatureExtractor(**{k: v for k, v in FEATURES.items() if k != "feature_extractor_type"})
    info = WhisperAudio()
    samples = speech_like(np.random.default_rng(0), args.seconds)
    wav = _wav(samples, RATE)
    body, content_type = _multipart(wav)
    audio = decode_audio(wav, RATE)
    clip = Audio(split_audio(audio.samples, RATE, 30.0, 1.0, RATE // 10)[0], RATE)
    arrays = info.arrays(info.run_processor(fe, clip, {}))
    store = ObjectStoreWriter(f"loom_bench_whisper_host_{os.getpid()}", 64 << 20, 1)
    keys = iter(range(1 << 30))

    def put():
        addr = store.put(f"k{next(keys)}", arrays)
        store.unref(addr)

    stages = [
        ("multipart form read (aiohttp, read_form)", _form_reader(body, content_type)),
        ("decode_audio (soundfile, 16-bit WAV)", lambda: decode_audio(wav, RATE)),
        ("split_audio", lambda: split_audio(audio.samples, RATE, 30.0, 1.0, RATE // 10)),
        ("sha256 of the samples (item hash)", lambda: hashlib.sha256(clip.samples.tobytes()).hexdigest()),
        ("log-mel (transformers' extractor call)", lambda: info.arrays(
            fe([clip.samples], sampling_rate=RATE, padding="max_length", return_attention_mask=True,
               return_tensors="np"))),
        ("log-mel (AudioInfo.run_processor)", lambda: info.arrays(info.run_processor(fe, clip, {}))),
        ("store put (1.5 MB of features)", put),
    ]
    print(f"Whisper-large-v3 features, one {args.seconds:g} s clip; torch intra-op threads: {torch.get_num_threads()}; "
          f"{os.cpu_count()} CPUs, {args.busy} busy processes")
    print(f"{'stage':<46} {'wall ms':>9} {'CPU ms':>9}")
    total = [0.0, 0.0]
    try:
        for name, fn in stages:
            wall, cpu = _timed(fn, args.iters)
            if "transformers'" not in name:   # (the path replaced: not in the total)
                total[0] += wall
                total[1] += cpu
            print(f"{name:<46} {wall:>9.2f} {cpu:>9.2f}")
    finally:
        store.close()
    label = "total (Loom's path), one clip at a time"
    print(f"{label:<46} {total[0]:>9.2f} {total[1]:>9.2f}")
    from concurrent.futures import ThreadPoolExecutor
    with ThreadPoolExecutor(args.pool) as pool:
        batch = [clip] * (4 * args.pool)
        one = lambda c: info.arrays(info.run_processor(fe, c, {}))  # noqa: E731
        wall, cpu = _timed(lambda: list(pool.map(one, batch)), max(1, args.iters // 4))
    print(f"{f'log-mel on {args.pool} threads at once, per clip':<46} {wall / len(batch):>9.2f} {cpu / len(batch):>9.2f}")


if __name__ == "__main__":
    main()
