"""LLaVA through the whole engine matches HF transformers (greedy, fp32, CPU): a CLIP tower
with the penultimate layer ("default": class token dropped), and a SigLIP tower with a list
of feature layers ("full"); the checkpoints are in transformers 5's layout, and the Hub's
layout (vision_tower.vision_model.*) loads too."""
from __future__ import annotations

import pytest

from frontend import LLM, SamplingParams
from tests.tiny_vl_models import hf_llava_greedy, make_tiny_llava, random_image

ENGINE_IN_PROCESS = True   # outputs only: the engine in the test process (tests/conftest.py engine_in_process)

MAX_NEW = 10


def chat(text: str) -> str:
    return f"<|im_start|>user\n{text}<|im_end|>\n<|im_start|>assistant\n"


def _check(model_dir: str, cases, **options):
    with LLM(model_dir, max_model_len=256, max_num_seqs=4, block_size=8, mm_processor_cache_gb=0.02,
             **options) as llm:
        prompts = [{"prompt": p, "multi_modal_data": {"image": imgs}} if imgs else p for p, imgs in cases]
        outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=MAX_NEW), use_tqdm=False)
        for (p, imgs), o in zip(cases, outs):
            ids, ref = hf_llava_greedy(model_dir, p, imgs, MAX_NEW)
            assert o.prompt_token_ids == ids
            assert o.outputs[0].token_ids == ref


CASES = [(chat("<image>\nDescribe it."), [random_image(50, 80, 60)]),
         (chat("<image> and <image>, compare."), [random_image(51, 56, 56), random_image(52, 100, 70)]),
         (chat("Hello world! How are you today?"), [])]


def test_llava_clip_matches_hf(tmp_path):
    _check(make_tiny_llava(str(tmp_path), tower="clip", vision_feature_layer=-2, select_strategy="default"), CASES)


def test_llava_siglip_feature_layer_list_hub_layout_tp2(tmp_path):
    """The SigLIP tower, in the Hub's layout, at TP=2 (two gloo ranks; the tower on each)."""
    d = make_tiny_llava(str(tmp_path), tower="siglip", vision_feature_layer=[-2, 1], select_strategy="full")
    # rewrite the checkpoint in the Hub's layout: vision_tower.vision_model.*
    from safetensors.torch import load_file, save_file
    w = load_file(f"{d}/model.safetensors")
    save_file({k.replace("vision_tower.", "vision_tower.vision_model.", 1): v for k, v in w.items()},
              f"{d}/model.safetensors", metadata={"format": "pt"})
    _check(d, CASES[:1] + CASES[2:], tensor_parallel_size=2, multiprocess=True)   # (two ranks: processes)


def test_language_model_only(tmp_path):
    """--language-model-only: the vision tower is not loaded (fewer weight bytes), text still
    matches HF, and an image is refused."""
    d = make_tiny_llava(str(tmp_path), tower="clip")
    with LLM(d, max_model_len=128, language_model_only=True) as llm:
        weights = llm.collective_rpc("memory_info")[0]["weights"]
        from safetensors import safe_open
        with safe_open(f"{d}/model.safetensors", "pt") as f:
            lm_bytes = sum(f.get_tensor(k).nbytes for k in f.keys() if k.startswith("language_model."))
        assert weights == lm_bytes
        text = chat("Tell me a story about a cat.")
        out = llm.generate(text, SamplingParams(temperature=0, max_tokens=MAX_NEW), use_tqdm=False)[0]
        assert out.outputs[0].token_ids == hf_llava_greedy(d, text, [], MAX_NEW)[1]
        with pytest.raises(ValueError, match="does not take images"):
            llm.generate({"prompt": chat("<image>"), "multi_modal_data": {"image": random_image(53, 56, 56)}},
                         use_tqdm=False)
