"""Weight quantization (workers/quantization/): each format's checkpoint is written here from a
tiny random model's weights, following the format's specification (compressed-tensors' own
packing where it writes the format); Loom's logits on it must agree with HF transformers on a
dense checkpoint of the dequantized weights (fp32: the CPU paths dequantize exactly, so the
weight-only formats give the same greedy tokens too). The trained demo model, quantized, still
recites the Zen; weight updates re-quantize bf16 tensors into an online-FP8 model."""
from __future__ import annotations

import json
import os
import shutil

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

from tests.hf_oracle import hf_greedy
from tests.test_models import hf_logits, scenario_logits

ENGINE_IN_PROCESS = True
FP8 = torch.float8_e4m3fn


def is_linear(name: str) -> bool:
    """A decoder layer's projection weight (what the formats quantize; embeddings, lm_head and
    norms stay dense)."""
    return name.startswith("model.layers.") and name.endswith("_proj.weight")


def write_variant(src: str, out: str, tensors: dict, quantization_config: dict | None = None) -> str:
    """A copy of the model directory `src` with `tensors` as its checkpoint (and config.json's
    quantization_config set, when given)."""
    shutil.copytree(src, out, dirs_exist_ok=True)
    for f in os.listdir(out):
        if f.endswith(".safetensors") or f.endswith(".index.json"):
            os.remove(os.path.join(out, f))
    save_file({k: v.contiguous() for k, v in tensors.items()}, os.path.join(out, "model.safetensors"),
              metadata={"format": "pt"})
    if quantization_config is not None:
        path = os.path.join(out, "config.json")
        with open(path) as f:
            cfg = json.load(f)
        cfg["quantization_config"] = quantization_config
        with open(path, "w") as f:
            json.dump(cfg, f)
    return out


def quantize_checkpoint(src: str, tmp, fmt, quantization_config: dict | None):
    """(quantized dir, dequantized dense dir): fmt(name, w) -> ({suffix: tensor}, dequantized w)
    for every linear weight."""
    weights = load_file(os.path.join(src, "model.safetensors"))
    quant, dense = {}, {}
    for name, w in weights.items():
        if not is_linear(name):
            quant[name] = dense[name] = w
            continue
        parts, deq = fmt(name, w)
        prefix = name[:-len("weight")]
        quant.update({prefix + k: v for k, v in parts.items()})
        dense[name] = deq.to(w.dtype)
    return (write_variant(src, str(tmp / "quantized"), quant, quantization_config),
            write_variant(src, str(tmp / "dequantized"), dense))


def assert_matches_dequantized(model, ref_dir: str, cos_min: float = 0.999, same_tokens: bool = True) -> None:
    """Every logits row of tests/test_models.py's scenario (prefill, decode, chunked prefill) has
    cosine >= cos_min with HF's on the dequantized weights, and (weight-only) the same argmax."""
    from transformers import AutoModelForCausalLM
    hf = AutoModelForCausalLM.from_pretrained(ref_dir, dtype=torch.float32, attn_implementation="eager").eval()
    for out, tokens, rows in scenario_logits(model):
        ref = hf_logits(hf, tokens)[rows]
        cos = F.cosine_similarity(out.float(), ref, dim=-1)
        assert cos.min() >= cos_min, f"cosine {cos.min():.5f} at {len(tokens)} tokens"
        if same_tokens:
            assert torch.equal(out.argmax(-1), ref.argmax(-1))


def fp8_per_channel(name, w):
    """Per output channel e4m3: scale = row absmax / 448 (vLLM's online FP8)."""
    scale = w.float().abs().amax(dim=1) / 448.0
    q = (w.float() / scale[:, None]).clamp(-448, 448).to(FP8)
    return {"weight": w}, q.float() * scale[:, None]


def test_online_fp8_matches_dequantized(model_factory, tmp_path):
    from workers.model_loader import load_model
    src = model_factory("llama", attention_bias=True)
    _, ref = quantize_checkpoint(src, tmp_path, fp8_per_channel, None)
    model = load_model(src, torch.float32, "cpu", quantization="fp8")
    qkv = model.model.layers[0].self_attn.qkv_proj
    assert qkv.weight.dtype == FP8 and qkv.weight_scale.shape == (qkv.out_features,)
    assert model.quant_config.name == "fp8"
    assert model.lm_head.weight.dtype == torch.float32   # not quantized: lm_head, embeddings, norms
    assert_matches_dequantized(model, ref)


def test_online_fp8_dummy_weights_are_fp8(model_factory):
    from workers.model_loader import load_model
    model = load_model(model_factory("qwen3"), torch.float32, "cpu", load_format="dummy", quantization="fp8")
    down = model.model.layers[1].mlp.down_proj
    assert down.weight.dtype == FP8 and down.weight.float().abs().amax() == 448.0
    assert torch.isfinite(next(scenario_logits(model))[0]).all()


def test_weight_update_requantizes_bf16_on_arrival(model_factory):
    """bf16 tensors loaded into an online-FP8 model (a weight update: load_weights partial) give
    the very fp8 weights and scales a fresh load of those tensors gives."""
    from workers.model_loader import load_model
    a, b = model_factory("qwen3"), model_factory("qwen3", seed=1)
    model = load_model(a, torch.float32, "cpu", quantization="fp8")
    fresh = load_model(b, torch.float32, "cpu", quantization="fp8")
    update = {n: t.to(torch.bfloat16) for n, t in load_file(os.path.join(b, "model.safetensors")).items()}
    fresh_bf16 = load_model(b, torch.float32, "cpu", quantization="fp8")
    fresh_bf16.load_weights(iter(update.items()), partial=True)
    k_only = {n: t for n, t in update.items() if ".k_proj." in n}   # one part of a fused layer
    model.load_weights(iter(update.items()), partial=True)
    for (name, p), (_, q) in zip(model.named_parameters(), fresh_bf16.named_parameters()):
        assert torch.equal(p.float(), q.float()), name
    assert not torch.equal(fresh.model.layers[0].self_attn.qkv_proj.weight.float(),
                           model.model.layers[0].self_attn.qkv_proj.weight.float())   # bf16 rounding shows
    before = model.model.layers[0].self_attn.qkv_proj.weight_scale.clone()
    model.load_weights(iter({n: t * 2 for n, t in k_only.items()}.items()), partial=True)
    after = model.model.layers[0].self_attn.qkv_proj.weight_scale
    q_rows = model.model.layers[0].self_attn.qkv_proj.shards["q"].size
    kv = model.model.layers[0].self_attn.qkv_proj.shards["k"].size
    assert torch.equal(after[:q_rows], before[:q_rows])             # q's rows untouched
    torch.testing.assert_close(after[q_rows:q_rows + kv], before[q_rows:q_rows + kv] * 2)


def test_online_fp8_weight_update_through_the_engine(model_factory):
    """LLM(quantization="fp8"): an update from disk to other weights changes the output, and one
    back restores it token for token (the bf16/fp32 checkpoint re-quantized on arrival)."""
    from frontend import LLM, SamplingParams
    a, b = model_factory("qwen3"), model_factory("qwen3", seed=1)
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    llm = LLM(a, max_model_len=64, block_size=4, quantization="fp8")
    try:
        gen = lambda: llm.generate([{"prompt_token_ids": [11, 12, 13]}], params, use_tqdm=False)[0].outputs[0].token_ids
        first = gen()
        for model_dir in (b, a):
            llm.pause("wait")
            llm.update_weights_from_disk(model_dir)
            llm.resume()
            if model_dir == b:
                other = gen()
        assert gen() == first and other != first
    finally:
        llm.shutdown()


@pytest.mark.parametrize("quantization", ["fp8"])
def test_demo_model_quantized_recites_the_zen(demo_model_dir, quantization, tmp_path):
    """The trained demo model, quantized, gives the unquantized model's 16 greedy tokens."""
    from frontend import LLM, SamplingParams
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(demo_model_dir)
    prompt = tok("Errors should").input_ids
    want = hf_greedy(demo_model_dir, prompt, 16)
    assert tok.decode(want).startswith(" never pass silently.")
    model_dir, kw = demo_variant(demo_model_dir, quantization, tmp_path)
    llm = LLM(model_dir, max_model_len=64, **kw)
    try:
        out = llm.generate([{"prompt_token_ids": prompt}], SamplingParams(temperature=0, max_tokens=16),
                           use_tqdm=False)[0].outputs[0].token_ids
    finally:
        llm.shutdown()
    assert out == want, tok.decode(out)


def demo_variant(demo_dir: str, quantization: str, tmp_path) -> tuple[str, dict]:
    if quantization == "fp8":
        return demo_dir, {"quantization": "fp8"}
    raise AssertionError(quantization)


# ------------------------------------------------------------------ kernels (CPU: interpreted Triton)
@pytest.mark.parametrize("rows", [1, 3])
def test_fp8_gemv_matches_reference(rows):
    """The decode GEMV (per-channel and 128x128 block scales, odd N) against dequantize-and-matmul."""
    from kernels import fp8_linear as k
    g = torch.Generator().manual_seed(rows)
    x, b = torch.randn(rows, 256, generator=g), torch.randn(40, generator=g)
    w, s = k.quantize_rows(torch.randn(40, 256, generator=g))
    torch.testing.assert_close(k.fp8_gemv(x, w, s, b), k.fp8_linear_ref(x, w, s, b), atol=1e-3, rtol=1e-3)
    w, s = k.quantize_blocks(torch.randn(40, 256, generator=g))
    torch.testing.assert_close(k.fp8_gemv(x, w, s, None, 128), k.fp8_linear_ref(x, w, s, None, 128),
                               atol=1e-3, rtol=1e-3)


def test_block_fp8_gemm_matches_reference():
    """The block-scaled GEMM quantizes activations per token and 128 columns: cosine with the
    weight-only reference."""
    from kernels import fp8_linear as k
    g = torch.Generator().manual_seed(0)
    x = torch.randn(20, 256, generator=g)
    w, s = k.quantize_blocks(torch.randn(200, 256, generator=g))
    y, ref = k.block_fp8_gemm(x, w, s, None, 128), k.fp8_linear_ref(x, w, s, None, 128)
    assert F.cosine_similarity(y, ref, dim=-1).min() > 0.999


# ------------------------------------------------------------------ start-up errors
def test_an_unsupported_quantization_config_exits_2_in_one_line(model_factory, tmp_path):
    """`loom serve` on a bitsandbytes checkpoint: exit 2 and one line naming the format, before
    anything starts."""
    import subprocess
    import sys

    from tests.conftest import ROOT
    src = model_factory("qwen3")
    bad = write_variant(src, str(tmp_path / "bnb"), load_file(os.path.join(src, "model.safetensors")),
                        {"quant_method": "bitsandbytes", "load_in_4bit": True})
    r = subprocess.run([sys.executable, "-m", "frontend.entrypoints.cli", "serve", bad, "--port", "0"], cwd=ROOT,
                       capture_output=True, text=True, timeout=120)
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 2 and len(lines) == 1 and "bitsandbytes" in lines[0], r.stderr[-2000:]


def test_quantization_flag_checks(model_factory):
    from workers.quantization import QuantizationError, get_quantization_config
    assert get_quantization_config({}, None) is None and get_quantization_config({}, "auto") is None
    with pytest.raises(QuantizationError, match="needs a checkpoint with a quantization_config"):
        get_quantization_config({}, "gptq")
    with pytest.raises(QuantizationError, match="does not match"):
        get_quantization_config({"quantization_config": {"quant_method": "awq"}}, "fp8")
