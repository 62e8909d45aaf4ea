"""The embedded demo model: a tiny Qwen3 checkpoint that recites the Zen of Python."""

import hashlib
import json
import os

import pytest

from frontend.tools.demo_model import build_demo_model

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def demo_dir(demo_model_dir):
    # Built once per session by conftest's ``demo_model_dir`` (default steps).
    return demo_model_dir


def test_files(demo_dir):
    for name in (
        "config.json",
        "model.safetensors",
        "generation_config.json",
        "tokenizer.json",
        "tokenizer_config.json",
    ):
        assert os.path.isfile(os.path.join(demo_dir, name)), name

    with open(os.path.join(demo_dir, "config.json")) as f:
        cfg = json.load(f)
    assert cfg["architectures"] == ["Qwen3ForCausalLM"]
    assert cfg["model_type"] == "qwen3"
    assert cfg["torch_dtype"] == "float32"

    with open(os.path.join(demo_dir, "tokenizer_config.json")) as f:
        tcfg = json.load(f)
    assert "<|im_start|>" in tcfg["chat_template"]

    tok = transformers.AutoTokenizer.from_pretrained(demo_dir)
    with open(os.path.join(demo_dir, "generation_config.json")) as f:
        gen = json.load(f)
    eos = gen["eos_token_id"]
    assert tok.convert_tokens_to_ids("<|im_end|>") in eos
    assert tok.convert_tokens_to_ids("<|endoftext|>") in eos


def test_special_tokens_atomic(demo_dir):
    tok = transformers.AutoTokenizer.from_pretrained(demo_dir)
    for sp in ("<|endoftext|>", "<|im_start|>", "<|im_end|>"):
        ids = tok(sp, add_special_tokens=False).input_ids
        assert len(ids) == 1 and ids[0] == tok.convert_tokens_to_ids(sp)
    assert tok.eos_token == "<|im_end|>"
    text = "Beautiful is better than ugly.\nNow is better than never."
    assert tok.decode(tok(text).input_ids) == text


def _greedy(model, tok, prompt, n):
    ids = tok(prompt, return_tensors="pt").input_ids
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=n, do_sample=False)
    return tok.decode(out[0, ids.shape[1]:], skip_special_tokens=False)


@pytest.fixture(scope="module")
def hf_model(demo_dir):
    config = transformers.AutoConfig.from_pretrained(demo_dir)
    assert config.model_type == "qwen3"
    tok = transformers.AutoTokenizer.from_pretrained(demo_dir)
    model = transformers.AutoModelForCausalLM.from_pretrained(demo_dir).eval()
    return model, tok


def test_completion_recites_zen(hf_model):
    model, tok = hf_model
    assert _greedy(model, tok, "Beautiful is better than", 5).startswith(" ugly.")
    more = _greedy(model, tok, "Errors should", 12)
    assert more.startswith(" never pass silently.\nUnless explicitly silenced."), more


def test_chat_template(hf_model):
    model, tok = hf_model
    msgs = [{"role": "user", "content": "Recite the Zen of Python."}]
    prompt = tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    assert prompt == (
        "<|im_start|>user\nRecite the Zen of Python.<|im_end|>\n<|im_start|>assistant\n"
    )
    no_gen = tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=False)
    assert no_gen == "<|im_start|>user\nRecite the Zen of Python.<|im_end|>\n"
    reply = _greedy(model, tok, prompt, 20)
    assert reply.startswith("Beautiful is better than ugly."), reply


def test_deterministic_short_build(tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    build_demo_model(str(a), steps=3)
    build_demo_model(str(b), steps=3)
    for name in ("model.safetensors", "tokenizer.json", "config.json"):
        ha = hashlib.sha256((a / name).read_bytes()).hexdigest()
        hb = hashlib.sha256((b / name).read_bytes()).hexdigest()
        assert ha == hb, name
