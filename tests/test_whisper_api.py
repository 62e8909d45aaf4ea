"""Whisper over HTTP: a real `loom serve` of a tiny Whisper and the official openai client.
/v1/audio/transcriptions and /translations (json, text, verbose_json, streamed) give HF's greedy
transcription; a 95 s file goes through 4 pieces; bad inputs are 400s and the server keeps
serving; nothing is left in /dev/shm. One server for the module."""
from __future__ import annotations

import os

import openai
import pytest

from tests.conftest import own_run_id
from tests.test_audio_api import wav_bytes
from tests.tiny_audio_models import speech_like
from tests.tiny_whisper import hf_whisper_greedy, make_tiny_whisper

RUN_ID = own_run_id()
RATE = 16000
MAX_NEW = 8


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny_whisper(str(tmp_path_factory.mktemp("whisper_api")))


@pytest.fixture(scope="module")
def client(model_dir):
    from tests.conftest import Server
    s = Server(model_dir, "--max-num-seqs", "4", "--mm-processor-cache-gb", "0.01", env={"LOOM_RUN_ID": RUN_ID})
    try:
        yield openai.OpenAI(base_url=s.wait_healthy().url + "/v1", api_key="x", max_retries=0)
    finally:
        s.stop()
        assert not [n for n in os.listdir("/dev/shm") if RUN_ID in n], "segments left after SIGTERM"


def decoded(data: bytes):
    """The samples the server decodes from a file (16-bit PCM: not the float clip written)."""
    import io

    import soundfile as sf
    return sf.read(io.BytesIO(data), dtype="float32")[0]


def oracle(model_dir, clip, rate=RATE, **kw) -> str:
    """HF's greedy tokens, as the server's incremental detokenizer writes them (a random model's
    byte-level tokens are not whole characters: a full decode places its U+FFFDs differently)."""
    from transformers import AutoTokenizer

    from frontend.detokenizer import IncrementalDetokenizer
    from ipc.sampling_params import SamplingParams
    ids, ref, _ = hf_whisper_greedy(model_dir, clip, rate, MAX_NEW, **kw)
    detok = IncrementalDetokenizer(AutoTokenizer.from_pretrained(model_dir), ids, SamplingParams())
    for t in ref:
        detok.add(t)
    detok.flush()
    return detok.text


def test_transcriptions_plain_streamed_and_translated(client, model_dir):
    model = client.models.list().data[0].id
    file = ("a.wav", wav_bytes(speech_like(40, 4.0, RATE), RATE), "audio/wav")
    clip = decoded(file[1])
    extra = {"max_completion_tokens": MAX_NEW}
    r = client.audio.transcriptions.create(model=model, file=file, language="en", temperature=0, extra_body=extra)
    assert r.text == oracle(model_dir, clip)
    events = list(client.audio.transcriptions.create(model=model, file=file, language="en", stream=True,
                                                     extra_body=extra))
    deltas = "".join(e.delta for e in events if e.type == "transcript.text.delta")
    assert deltas == r.text and events[-1].type == "transcript.text.done" and events[-1].text == r.text
    assert client.audio.transcriptions.create(model=model, file=file, response_format="text",
                                              extra_body=extra) == r.text   # (English by default)
    p = client.audio.transcriptions.create(model=model, file=file, prompt=" hello", extra_body=extra)
    assert p.text == oracle(model_dir, clip, prompt=" hello")
    t = client.audio.translations.create(model=model, file=file, extra_body=extra)
    assert t.text == oracle(model_dir, clip, task="translate")
    stereo = wav_bytes(speech_like(41, 3.0, 44100, channels=2), 44100, "FLAC")
    s = client.audio.transcriptions.create(model=model, file=("s.flac", stereo), language="fr", extra_body=extra)
    assert s.text == oracle(model_dir, decoded(stereo), 44100, language="fr")


def test_95_seconds_transcribe_through_4_pieces(client):
    rate = 8000
    model = client.models.list().data[0].id
    r = client.audio.transcriptions.create(model=model, file=("long.flac", wav_bytes(speech_like(42, 95.0, rate),
                                                                                      rate, "FLAC")),
                                           response_format="verbose_json", extra_body={"max_completion_tokens": 3})
    assert len(r.segments) == 4 and abs(r.duration - 95.0) < 0.01
    assert r.segments[-1].end == pytest.approx(95.0, abs=0.01) and all(s.end - s.start <= 30 for s in r.segments)


@pytest.mark.parametrize("kw,needle", [
    ({"file": ("x.wav", b"definitely not audio" * 10)}, "not an audio file"),
    ({"file": ("x.wav", b"RIFF"), "response_format": "srt"}, "response_format must be one of"),
    ({"file": ("x.wav", wav_bytes(speech_like(43, 1.0, RATE), RATE)), "language": "xx"}, "not one of Whisper's"),
])
def test_bad_transcriptions_are_400(client, kw, needle):
    model = client.models.list().data[0].id
    with pytest.raises(openai.BadRequestError) as e:
        client.audio.transcriptions.create(model=model, **kw)
    assert needle in str(e.value)
    assert client.models.list().data   # still serving
