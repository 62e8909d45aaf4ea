"""GPU: Whisper through the whole engine on CUDA (the encoder on the device, Triton paged
self-attention, the cross pool read by the paged kernel inside the decode CUDA graphs) against
HF on the same device, fp32 on the tiny random model: token-exact for every CPU case."""
from __future__ import annotations

import pytest
import torch

from frontend import LLM, SamplingParams
from tests.test_whisper import CASES
from tests.tiny_whisper import make_tiny_whisper, whisper_prompt

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def test_whisper_on_gpu_matches_hf(tmp_path):
    from transformers import WhisperForConditionalGeneration

    from tests.tiny_vl_models import _HF
    from tests.tiny_whisper import hf_whisper_greedy
    d = make_tiny_whisper(str(tmp_path))
    prompts = [{"prompt": whisper_prompt(**kw), "multi_modal_data": {"audio": (clip, rate)}} for clip, rate, kw in CASES]
    with LLM(d, max_num_seqs=8, dtype="float32", mm_processor_cache_gb=0.02) as llm:
        outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)
        # many at once (mixed prefills and graph decodes over different pool rows), then again
        many = llm.generate(prompts * 3, SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in many] == [o.outputs[0].token_ids for o in outs] * 3
    model = WhisperForConditionalGeneration.from_pretrained(d, dtype=torch.float32).eval().cuda()
    _HF[d] = model
    import transformers.generation.utils as gen
    orig = gen.GenerationMixin.generate
    try:
        gen.GenerationMixin.generate = lambda self, **kw: orig(self, **{k: v.cuda() if torch.is_tensor(v) else v
                                                                         for k, v in kw.items()})
        for (clip, rate, kw), o in zip(CASES, outs):
            ids, ref, _ = hf_whisper_greedy(d, clip, rate, 8, **kw)
            assert o.prompt_token_ids == ids
            assert o.outputs[0].token_ids == ref, kw
    finally:
        gen.GenerationMixin.generate = orig
        del _HF[d]


def test_voxtral_on_gpu_matches_hf(tmp_path):
    """Voxtral (decoder-only, chunks kept) on CUDA against HF on the same device, fp32."""
    from transformers import VoxtralForConditionalGeneration

    from tests.test_voxtral import CASES as VOXTRAL_CASES
    from tests.tiny_vl_models import _HF
    from tests.tiny_voxtral import hf_voxtral_greedy, make_tiny_voxtral
    d = make_tiny_voxtral(str(tmp_path))
    with LLM(d, max_model_len=512, max_num_seqs=4, dtype="float32", mm_processor_cache_gb=0.02,
             limit_mm_per_prompt={"audio": 2}) as llm:
        outs = llm.generate([{"prompt": p, "multi_modal_data": {"audio": c}} if c else p for p, c in VOXTRAL_CASES],
                            SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)
    model = VoxtralForConditionalGeneration.from_pretrained(d, dtype=torch.float32).eval().cuda()
    orig = model.generate
    model.generate = lambda **kw: orig(**{k: v.cuda() if torch.is_tensor(v) else v for k, v in kw.items()})
    _HF[d] = model
    try:
        for (p, clips), o in zip(VOXTRAL_CASES, outs):
            ids, ref = hf_voxtral_greedy(d, p, clips, 8)
            assert o.prompt_token_ids == ids
            assert o.outputs[0].token_ids == ref
    finally:
        del _HF[d]
