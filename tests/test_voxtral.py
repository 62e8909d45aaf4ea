"""Voxtral through the whole engine matches HF transformers (greedy, fp32, CPU): one clip, two
clips, a stereo clip (made mono), a clip at 44.1 kHz (resampled), a 45 s clip (two 30 s chunks,
both kept), and text only; the prompt's [AUDIO] count (chunks x 60 here) is the one HF's model
accepts for its features. Features: WhisperFeatureExtractor (mistral_common is not installed;
Voxtral's processor computes the same Whisper features)."""
from __future__ import annotations

import pytest

from frontend import LLM, SamplingParams
from tests.tiny_audio_models import speech_like
from tests.tiny_voxtral import hf_voxtral_greedy, make_tiny_voxtral

ENGINE_IN_PROCESS = True

MAX_NEW = 8
RATE = 16000


def inst(text: str, clips: int) -> str:
    return "<s>[INST]" + "[BEGIN_AUDIO][AUDIO]" * clips + f"{text}[/INST]"


CASES = [(inst("What is it?", 1), [(speech_like(1, 3.0, RATE), RATE)]),
         (inst("Compare them.", 2), [(speech_like(2, 1.5, RATE), RATE), (speech_like(3, 12.0, RATE), RATE)]),
         (inst("And this one?", 1), [(speech_like(4, 2.0, RATE, channels=2), RATE)]),
         (inst("At 44.1 kHz.", 1), [(speech_like(5, 2.5, 44100), 44100)]),
         (inst("A long one.", 1), [(speech_like(6, 45.0, RATE), RATE)]),
         (inst("Hello there, how are you?", 0), [])]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny_voxtral(str(tmp_path_factory.mktemp("voxtral")))


def test_voxtral_matches_hf(model_dir):
    with LLM(model_dir, max_model_len=512, max_num_seqs=4, block_size=8, mm_processor_cache_gb=0.02,
             limit_mm_per_prompt={"audio": 2}) as llm:
        prompts = [{"prompt": p, "multi_modal_data": {"audio": clips}} if clips else p for p, clips in CASES]
        outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=MAX_NEW), use_tqdm=False)
        assert len({tuple(o.outputs[0].token_ids) for o in outs}) >= len(outs) - 1   # the audio matters
        for (p, clips), o in zip(CASES, outs):
            ids, ref = hf_voxtral_greedy(model_dir, p, clips, MAX_NEW)
            assert o.prompt_token_ids == ids
            assert o.outputs[0].token_ids == ref, p
        assert outs[4].prompt_token_ids.count(outs[4].prompt_token_ids[3]) >= 120   # 45 s: two chunks of 60
