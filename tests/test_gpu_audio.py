"""GPU: Qwen2-Audio through the whole engine on CUDA (the audio encoder on the device, Triton
attention and CUDA graphs for the decodes) against HF on the same device, fp32 on the tiny
random model: token-exact for one clip, two clips, a stereo clip and a 44.1 kHz clip."""
from __future__ import annotations

import pytest
import torch

from frontend import LLM, SamplingParams
from tests.test_audio_parity import CASES
from tests.tiny_audio_models import make_tiny_qwen2_audio

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def test_qwen2_audio_on_gpu_matches_hf(tmp_path):
    from transformers import Qwen2AudioForConditionalGeneration

    from tests.tiny_audio_models import hf_qwen2_audio_greedy
    from tests.tiny_vl_models import _HF
    d = make_tiny_qwen2_audio(str(tmp_path))
    with LLM(d, max_model_len=512, max_num_seqs=4, dtype="float32", mm_processor_cache_gb=0.02) as llm:
        outs = llm.generate([{"prompt": p, "multi_modal_data": {"audio": c}} if c else p for p, c in CASES],
                            SamplingParams(temperature=0, max_tokens=12), use_tqdm=False)
    model = Qwen2AudioForConditionalGeneration.from_pretrained(d, dtype=torch.float32).eval().cuda()
    orig = model.generate
    model.generate = lambda **kw: orig(**{k: v.cuda() if torch.is_tensor(v) else v for k, v in kw.items()})
    _HF[d] = model
    try:
        for (p, clips), o in zip(CASES, outs):
            ids, ref = hf_qwen2_audio_greedy(d, p, clips, 12)
            assert o.prompt_token_ids == ids
            assert o.outputs[0].token_ids == ref
    finally:
        del _HF[d]
