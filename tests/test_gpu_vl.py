"""GPU: Qwen2.5-VL through the whole engine on CUDA (Triton kernels with 3-row M-RoPE
positions, CUDA graphs for the decodes) against HF on the same device. fp32 on a random tiny
model: token-exact. bf16: on the trained vision demo model, every answer token equal to HF's
bf16 (a random model's near-ties flip under any two bf16 roundings, as for the text models)."""
from __future__ import annotations

import pytest
import torch

from frontend import LLM, SamplingParams
from tests.tiny_vl_models import make_tiny_qwen2_5_vl, random_image

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
IMG = "<|vision_start|><|image_pad|><|vision_end|>"


def _hf_on_gpu(model_dir, prompt, images, max_new, dtype):
    from tests.tiny_vl_models import hf_qwen_vl_greedy, _HF
    from transformers import AutoModelForImageTextToText
    _HF[model_dir] = AutoModelForImageTextToText.from_pretrained(model_dir, dtype=dtype).eval().cuda()
    orig = _HF[model_dir].generate

    def generate(**kw):  # inputs to the model's device
        return orig(**{k: v.cuda() if torch.is_tensor(v) else v for k, v in kw.items()})
    _HF[model_dir].generate = generate
    try:
        return hf_qwen_vl_greedy(model_dir, prompt, images, max_new)
    finally:
        del _HF[model_dir]


@pytest.mark.parametrize("dtype,exact", [("float32", 12)])
def test_qwen2_5_vl_on_gpu_matches_hf(tmp_path, dtype, exact):
    d = make_tiny_qwen2_5_vl(str(tmp_path))
    cases = [(f"<|im_start|>user\n{IMG}Describe it.<|im_end|>\n<|im_start|>assistant\n", [random_image(60, 120, 90)]),
             (f"<|im_start|>user\n{IMG}and{IMG}<|im_end|>\n<|im_start|>assistant\n",
              [random_image(61, 56, 56), random_image(62, 200, 140)])]
    with LLM(d, max_model_len=512, max_num_seqs=4, dtype=dtype, mm_processor_cache_gb=0.02) as llm:
        outs = llm.generate([{"prompt": p, "multi_modal_data": {"image": i}} for p, i in cases],
                            SamplingParams(temperature=0, max_tokens=12), use_tqdm=False)
    for (p, imgs), o in zip(cases, outs):
        ids, ref = _hf_on_gpu(d, p, imgs, 12, getattr(torch, dtype))
        assert o.prompt_token_ids == ids
        assert o.outputs[0].token_ids[:exact] == ref[:exact]


def test_vision_demo_bf16_on_gpu_matches_hf(tmp_path):
    from frontend.tools.demo_vision_model import _chat, build_demo_vision_model, draw_shape
    d = str(tmp_path / "demo-vision")
    build_demo_vision_model(d, steps=150)
    cases = [(_chat(q)[0], [draw_shape(shape, colour, rng=__import__("random").Random(i))])
             for i, (shape, colour) in enumerate([("circle", "red"), ("square", "blue"), ("triangle", "green"),
                                                  ("circle", "yellow")])
             for q in (f"What colour is the {shape}?", "What is this?")]
    with LLM(d, max_model_len=256, max_num_seqs=8, dtype="bfloat16") as llm:
        outs = llm.generate([{"prompt": p, "multi_modal_data": {"image": i}} for p, i in cases],
                            SamplingParams(temperature=0, max_tokens=6, ignore_eos=True), use_tqdm=False)
    for (p, imgs), o in zip(cases, outs):
        ids, ref = _hf_on_gpu(d, p, imgs, 6, torch.bfloat16)  # HF stops at <|im_end|>, inclusive
        assert o.prompt_token_ids == ids
        assert o.outputs[0].token_ids[:len(ref)] == ref, (p, o.outputs[0].token_ids, ref)


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_vision_tower_packed_attention_and_rotary_match_the_grouped_path(dtype):
    """The tower's GPU paths: one flash-attention call over the packed windows (varlen) equals the
    per-length batched SDPA calls, on q, k, v as the tower has them (views of one qkv output);
    the Triton rotation equals HF's fp32 math rounded once."""
    from workers.models.qwen2_5_vl import Segments, _rotary, apply_rotary_ref
    torch.manual_seed(0)
    dt = getattr(torch, dtype)
    lens = [64, 32, 64, 16, 1, 64, 32, 7]
    n, h, d = sum(lens), 16, 80
    q, k, v = torch.randn(n, 3, h, d, device="cuda", dtype=dt).unbind(1)
    packed = Segments(lens, torch.device("cuda"), dt)
    grouped = Segments(lens, torch.device("cpu"), dt)
    grouped.groups = [(idx.cuda(), g, length) for idx, g, length in grouped.groups]
    a, b = packed.attention(q, k, v), grouped.attention(q, k, v)
    assert a.shape == b.shape == (n, h, d)
    torch.testing.assert_close(a.float(), b.float(), atol=2e-2, rtol=2e-2)
    cos, sin = torch.randn(n, d, device="cuda").cos(), torch.randn(n, d, device="cuda").sin()
    qr, kr = _rotary(q, k, cos, sin)
    qe, ke = apply_rotary_ref(q.float().transpose(0, 1)[None], k.float().transpose(0, 1)[None], cos[None], sin[None])
    torch.testing.assert_close(qr.float(), qe[0].transpose(0, 1).to(dt).float(), atol=1e-2, rtol=1e-2)
    torch.testing.assert_close(kr.float(), ke[0].transpose(0, 1).to(dt).float(), atol=1e-2, rtol=1e-2)
