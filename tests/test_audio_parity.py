"""Qwen2-Audio through the whole engine matches HF transformers (greedy, fp32, CPU): one clip,
two clips, a stereo clip (made mono), a clip at 44.1 kHz (resampled with soxr), and text only;
the prompt's token count (placeholders expanded) equals HF's Qwen2AudioProcessor's. Chat
content parts (input_audio, audio_url) give the same prompt as multi_modal_data."""
from __future__ import annotations

import base64
import io

import numpy as np
import pytest

from frontend import LLM, SamplingParams
from tests.tiny_audio_models import hf_qwen2_audio_greedy, make_tiny_qwen2_audio, speech_like

ENGINE_IN_PROCESS = True   # outputs only: the engine in the test process (tests/conftest.py engine_in_process)

MAX_NEW = 8
RATE = 16000   # the tiny feature extractor's


def chat(text: str, clips: int) -> str:
    audio = "".join(f"Audio {i + 1}: <|audio_bos|><|AUDIO|><|audio_eos|>\n" for i in range(clips))
    return f"<|im_start|>user\n{audio}{text}<|im_end|>\n<|im_start|>assistant\n"


CASES = [(chat("What is it?", 1), [(speech_like(1, 3.0, RATE), RATE)]),
         (chat("Compare them.", 2), [(speech_like(2, 1.5, RATE), RATE), (speech_like(3, 12.0, RATE), RATE)]),
         (chat("And this one?", 1), [(speech_like(4, 2.0, RATE, channels=2), RATE)]),
         (chat("At 44.1 kHz.", 1), [(speech_like(5, 2.5, 44100), 44100)]),
         (chat("Hello there, how are you?", 0), [])]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny_qwen2_audio(str(tmp_path_factory.mktemp("qwen2_audio")))


def test_qwen2_audio_matches_hf(model_dir):
    with LLM(model_dir, max_model_len=256, max_num_seqs=4, block_size=8, mm_processor_cache_gb=0.02) as llm:
        prompts = [{"prompt": p, "multi_modal_data": {"audio": clips}} if clips else p for p, clips in CASES]
        outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=MAX_NEW), use_tqdm=False)
        assert len({tuple(o.outputs[0].token_ids) for o in outs}) == len(outs)   # the audio matters
        for (p, clips), o in zip(CASES, outs):
            ids, ref = hf_qwen2_audio_greedy(model_dir, p, clips, MAX_NEW)
            assert o.prompt_token_ids == ids
            assert o.outputs[0].token_ids == ref
        # the same clip again is a processor-cache (and prefix-cache) hit with the same output
        again = llm.generate([prompts[0]], SamplingParams(temperature=0, max_tokens=MAX_NEW), use_tqdm=False)[0]
        assert again.outputs[0].token_ids == outs[0].outputs[0].token_ids
        assert llm.mm.stats.cache_hits >= 1


def _wav(samples: np.ndarray, rate: int, fmt: str = "WAV") -> bytes:
    import soundfile as sf
    buf = io.BytesIO()
    sf.write(buf, samples, rate, format=fmt)
    return buf.getvalue()


def test_chat_audio_parts_and_bad_input(model_dir, tmp_path):
    """input_audio (wav) and audio_url (a flac file:// under --allowed-local-media-path) in LLM.chat
    give HF's prompt and output; a file that is not audio, a clip over the 30 s window and an
    unknown format are refused with a clear error."""
    clip = speech_like(6, 2.0, RATE)
    stereo = speech_like(7, 1.0, 8000, channels=2)
    flac = tmp_path / "b.flac"
    flac.write_bytes(_wav(stereo, 8000, "FLAC"))
    messages = [{"role": "user", "content": [
        {"type": "input_audio", "input_audio": {"data": base64.b64encode(_wav(clip, RATE)).decode(), "format": "wav"}},
        {"type": "audio_url", "audio_url": {"url": f"file://{flac}"}},
        {"type": "text", "text": "Both?"}]}]
    with LLM(model_dir, max_model_len=256, max_num_seqs=2, block_size=8, mm_processor_cache_gb=0.02,
             allowed_local_media_path=str(tmp_path), limit_mm_per_prompt={"audio": 2}) as llm:
        out = llm.chat(messages, SamplingParams(temperature=0, max_tokens=MAX_NEW), use_tqdm=False)[0]
        import soundfile as sf
        decoded = [(sf.read(io.BytesIO(_wav(clip, RATE)), dtype="float32")[0], RATE),
                   (sf.read(str(flac), dtype="float32")[0], 8000)]
        ids, ref = hf_qwen2_audio_greedy(model_dir, chat("Both?", 2), decoded, MAX_NEW)
        assert out.prompt_token_ids == ids and out.outputs[0].token_ids == ref
        params = SamplingParams(max_tokens=2)
        bad = [({"type": "input_audio", "input_audio": {"data": base64.b64encode(b"not audio" * 50).decode(),
                                                        "format": "wav"}}, "not an audio file"),
               ({"type": "input_audio", "input_audio": {"data": base64.b64encode(_wav(speech_like(8, 31.0, RATE),
                                                                                       RATE)).decode(),
                                                        "format": "wav"}}, "at most 30 s"),
               ({"type": "input_audio", "input_audio": {"data": "AAAA", "format": "aiff"}}, "format must be one of")]
        for part, why in bad:
            with pytest.raises(ValueError, match=why):
                llm.chat([{"role": "user", "content": [part, {"type": "text", "text": "x"}]}], params, use_tqdm=False)
        with pytest.raises(ValueError, match="At most 2 audio"):
            llm.generate([{"prompt": chat("x", 3), "multi_modal_data": {"audio": [(clip, RATE)] * 3}}], params,
                         use_tqdm=False)
        with pytest.raises(ValueError, match="does not take images"):
            llm.generate([{"prompt": chat("x", 0), "multi_modal_data": {"image": [object()]}}], params, use_tqdm=False)
