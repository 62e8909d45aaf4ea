"""Audio over HTTP: a real `loom serve` of a tiny Qwen2-Audio and the official openai client.
input_audio (base64 wav), audio_url (http(s) fetched, file:// under --allowed-local-media-path)
give HF's output; every bad input is OpenAI's 400 and the server keeps serving; nothing is left
in /dev/shm."""
from __future__ import annotations

import base64
import http.server
import io
import os
import threading

import numpy as np
import openai
import pytest

from tests.conftest import own_run_id
from tests.tiny_audio_models import hf_qwen2_audio_greedy, make_tiny_qwen2_audio, speech_like

RUN_ID = own_run_id()
RATE = 16000   # the tiny feature extractor's


def wav_bytes(samples, rate: int, fmt: str = "WAV") -> bytes:
    import soundfile as sf
    buf = io.BytesIO()
    sf.write(buf, samples, rate, format=fmt)
    return buf.getvalue()


def input_audio(data: bytes, fmt: str = "wav") -> dict:
    return {"type": "input_audio", "input_audio": {"data": base64.b64encode(data).decode(), "format": fmt}}


def user(*parts, text: str = "What is it?") -> list[dict]:
    return [{"role": "user", "content": [*parts, {"type": "text", "text": text}]}]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny_qwen2_audio(str(tmp_path_factory.mktemp("qwen2_audio_api")))


@pytest.fixture(scope="module")
def media_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("audio_media")
    (d / "ok.ogg").write_bytes(wav_bytes(speech_like(20, 2.0, 8000), 8000, "OGG"))
    return d


@pytest.fixture(scope="module")
def server(model_dir, media_dir):
    from tests.conftest import Server
    s = Server(model_dir, "--max-model-len", "512", "--max-num-seqs", "4", "--limit-mm-per-prompt.audio", "1",
               "--allowed-local-media-path", str(media_dir / ""), "--mm-processor-cache-gb", "0.01",
               env={"LOOM_RUN_ID": RUN_ID})
    try:
        yield s.wait_healthy()
    finally:
        s.stop()
        assert not [n for n in os.listdir("/dev/shm") if RUN_ID in n], "segments left after SIGTERM"


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0)


def chat(client, messages, **kw):
    return client.chat.completions.create(model=client.models.list().data[0].id, messages=messages,
                                          temperature=0, max_tokens=8, **kw)


def _check_hf(out, model_dir, clip):
    from transformers import AutoTokenizer
    prompt = "<|im_start|>user\nAudio 1: <|audio_bos|><|AUDIO|><|audio_eos|>\nWhat is it?<|im_end|>\n" \
             "<|im_start|>assistant\n"
    ids, ref = hf_qwen2_audio_greedy(model_dir, prompt, [clip], 8)
    assert out.usage.prompt_tokens == len(ids)
    assert out.choices[0].message.content == AutoTokenizer.from_pretrained(model_dir).decode(
        ref, skip_special_tokens=True)


def test_input_audio_matches_hf_and_streams(client, model_dir):
    clip = speech_like(21, 3.0, RATE)
    messages = user(input_audio(wav_bytes(clip, RATE)))
    full = chat(client, messages)
    _check_hf(full, model_dir, (clip, RATE))
    text = "".join(c.choices[0].delta.content or "" for c in chat(client, messages, stream=True) if c.choices)
    assert text == full.choices[0].message.content


def test_audio_url_http_and_file(client, model_dir, media_dir):
    import soundfile as sf
    clip = speech_like(22, 2.0, 22050, channels=2)   # stereo at 22.05 kHz: mono, resampled
    body = wav_bytes(clip, 22050, "FLAC")

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *a):
            pass
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    try:
        url = f"http://127.0.0.1:{httpd.server_address[1]}/a.flac"
        out = chat(client, user({"type": "audio_url", "audio_url": {"url": url}}))
    finally:
        httpd.shutdown()
    _check_hf(out, model_dir, (sf.read(io.BytesIO(body), dtype="float32")[0], 22050))
    ogg = media_dir / "ok.ogg"
    out = chat(client, user({"type": "audio_url", "audio_url": {"url": f"file://{ogg}"}}))
    _check_hf(out, model_dir, (sf.read(str(ogg), dtype="float32")[0], 8000))


@pytest.mark.parametrize("parts,needle", [
    ([input_audio(b"this is not audio at all" * 20)], "not an audio file"),
    ([input_audio(wav_bytes(speech_like(23, 31.0, RATE), RATE))], "at most 30 s"),
    ([input_audio(b"\0\0\0\0", "aiff")], "format must be one of"),
    ([{"type": "input_audio", "input_audio": {"data": "@@not base64@@", "format": "wav"}}], "not valid base64"),
    ([{"type": "audio_url", "audio_url": {"url": "file:///etc/passwd"}}], "outside --allowed-local-media-path"),
    ([{"type": "audio_url", "audio_url": {"url": "ftp://x/a.wav"}}], "unsupported audio URL scheme"),
    ([input_audio(wav_bytes(speech_like(24, 1.0, RATE), RATE))] * 2, "At most 1 audio"),
    ([{"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}], "does not take images"),
])
def test_bad_audio_is_400_and_the_server_keeps_serving(client, parts, needle):
    with pytest.raises(openai.BadRequestError) as e:
        chat(client, user(*parts))
    assert needle in str(e.value)
    assert chat(client, [{"role": "user", "content": "Hello"}]).choices[0].message.content is not None


# ------------------------------------------------------------------ /v1/audio/transcriptions

def _transcribe_oracle(model_dir, clip, task="transcribe", language=None, prompt="", max_new=8) -> str:
    from transformers import AutoTokenizer

    from workers.models.qwen2_audio import Qwen2AudioClips
    text = Qwen2AudioClips().transcription_prompt(task, language, prompt)
    _, ref = hf_qwen2_audio_greedy(model_dir, text, [clip], max_new)
    return AutoTokenizer.from_pretrained(model_dir).decode(ref, skip_special_tokens=True)


def test_transcription_sdk_plain_and_streamed(client, model_dir):
    clip = speech_like(30, 4.0, RATE)
    model = client.models.list().data[0].id
    file = ("a.wav", wav_bytes(clip, RATE), "audio/wav")
    extra = {"max_completion_tokens": 8}
    r = client.audio.transcriptions.create(model=model, file=file, language="en", temperature=0, extra_body=extra)
    assert r.text == _transcribe_oracle(model_dir, (clip, RATE), language="en")
    events = list(client.audio.transcriptions.create(model=model, file=file, language="en", stream=True,
                                                     extra_body=extra))
    deltas = "".join(e.delta for e in events if e.type == "transcript.text.delta")
    assert deltas == r.text and events[-1].type == "transcript.text.done" and events[-1].text == r.text
    text = client.audio.transcriptions.create(model=model, file=file, language="en", response_format="text",
                                              extra_body=extra)
    assert text == r.text
    t = client.audio.translations.create(model=model, file=file, extra_body=extra)
    assert t.text == _transcribe_oracle(model_dir, (clip, RATE), task="translate")


def test_95_seconds_transcribe_through_4_pieces(client, model_dir):
    rate = 8000   # resampled to the model's 16 kHz, then split at 30 s
    clip = speech_like(31, 95.0, rate)
    model = client.models.list().data[0].id
    r = client.audio.transcriptions.create(model=model, file=("long.flac", wav_bytes(clip, rate, "FLAC")),
                                           response_format="verbose_json", extra_body={"max_completion_tokens": 3})
    assert len(r.segments) == 4 and abs(r.duration - 95.0) < 0.01
    assert r.segments[-1].end == pytest.approx(95.0, abs=0.01) and all(s.end - s.start <= 30 for s in r.segments)
    assert r.text == " ".join(s.text for s in r.segments if s.text)


@pytest.mark.parametrize("kw,needle", [
    ({"file": ("x.wav", b"definitely not audio" * 10)}, "not an audio file"),
    ({"file": ("x.wav", wav_bytes(np.zeros(601 * 1000, np.int16), 1000, "WAV"))}, "at most 600 s"),
    ({"file": ("x.wav", b"RIFF"), "response_format": "srt"}, "response_format must be one of"),
    ({"file": ("x.wav", b"RIFF"), "language": "english!"}, "language must be"),
])
def test_bad_transcriptions_are_400(client, kw, needle):
    model = client.models.list().data[0].id
    with pytest.raises(openai.BadRequestError) as e:
        client.audio.transcriptions.create(model=model, **kw)
    assert needle in str(e.value)


def test_bench_serve_asr_reports_rtfx(server, tmp_path):
    """`loom bench serve --dataset-name asr` (generated speech-like clips in the length bounds)
    transcribes every clip through the streamed endpoint and reports RTFx."""
    import json
    import subprocess
    import sys
    out = tmp_path / "asr.json"
    subprocess.run([sys.executable, "-m", "frontend.entrypoints.cli", "bench", "serve", "--base-url", server.url,
                    "--dataset-name", "asr", "--num-prompts", "4", "--max-concurrency", "2",
                    "--asr-min-audio-len-sec", "1", "--asr-max-audio-len-sec", "3", "--random-output-len", "4",
                    "--disable-tqdm", "--result-file", str(out)], check=True, timeout=120, capture_output=True)
    m = json.loads(out.read_text())
    assert m["completed"] == 4 and m["failed"] == 0 and m["endpoint"] == "/v1/audio/transcriptions"
    assert 4 <= m["total_audio_seconds"] <= 12 and m["rtfx"] > 0
