"""Weight quantization (workers/quantization/): each format's checkpoint is written here from a
tiny random model's weights, following the format's specification (compressed-tensors' own
packing where it writes the format); Loom's logits on it must agree with HF transformers on a
dense checkpoint of the dequantized weights (fp32: the CPU paths dequantize exactly, so the
weight-only formats give the same greedy tokens too). The trained demo model, quantized, still
recites the Zen; weight updates re-quantize bf16 tensors into an online-FP8 model. (Each format
sharded over two ranks: tests/test_arch_tp.py's quant-* cases.)"""
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


@pytest.mark.parametrize("quantization", ["gptq", "awq", "fp8-block"])
def test_dummy_weights_in_each_formats_layout(model_factory, tmp_path, quantization):
    """--load-format dummy with --quantization gptq/awq (their default group 128), or a config.json
    naming block-wise FP8 (the bench's qwen3-8b-fp8 preset): the format's parameters, drawn dense
    and quantized, give finite logits; TP=1's draw order makes a TP=N dummy model TP=1's split."""
    from workers.model_loader import load_model
    src = model_factory("qwen3", hidden_size=128, intermediate_size=256, head_dim=32)
    kw = {"quantization": quantization}
    if quantization == "fp8-block":
        src = write_variant(src, str(tmp_path / "block"), load_file(os.path.join(src, "model.safetensors")),
                            {"quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": [64, 64]})
        kw = {}
    model = load_model(src, torch.float32, "cpu", load_format="dummy", **kw)
    down = model.model.layers[0].mlp.down_proj
    if quantization == "fp8-block":
        assert down.weight.dtype == FP8 and down.weight_scale_inv.shape == (2, 4)
    else:
        # repacked into kernels/w4a16.py's N x K layout: [N, K/8] words, [N, G] scales
        assert down.w4_nk and down.qweight.dtype == torch.int32 and down.qweight.shape == (128, 256 // 8)
        assert down.scales.shape == (128, 2)
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
        k_proj = load_file(os.path.join(a, "model.safetensors"))["model.layers.0.self_attn.k_proj.weight"]
        back = torch.tensor(llm.get_weights_by_name("model.layers.0.self_attn.k_proj.weight", truncate_size=4))
        torch.testing.assert_close(back, k_proj[:4], rtol=0.07, atol=1e-3)   # dequantized (e4m3: 3 mantissa bits)
    finally:
        llm.shutdown()


@pytest.mark.parametrize("quantization", ["fp8", "w4a16-g128"])
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
    """(model dir, LLM keywords): online FP8 of the demo checkpoint, or a GPTQ W4A16 group-128
    checkpoint written from it."""
    if quantization == "fp8":
        return demo_dir, {"quantization": "fp8"}
    quant_dir, _ = quantize_checkpoint(demo_dir, tmp_path, gptq(128, sym=True, desc_act=False), {
        "quant_method": "gptq", "bits": 4, "group_size": 128, "desc_act": False, "sym": True})
    return quant_dir, {}



# ------------------------------------------------------------------ pre-quantized formats, written here
def fp8_serialized(strategy: str, static_input: bool = False, scale_name: str = "weight_scale", block: int = 16):
    """FP8 e4m3 weights: one scale per tensor ([1]), per output channel ([N, 1]) or per block x
    block tile (the float32 `scale_inv` of Qwen3-FP8/DeepSeek, [N/block, K/block])."""
    def fmt(name, w):
        wf = w.float()
        if strategy == "block":
            n, k = wf.shape
            tiles = wf.view(n // block, block, k // block, block)
            scale = tiles.abs().amax(dim=(1, 3)) / 448.0
            q = (tiles / scale[:, None, :, None]).to(FP8)
            deq = (q.float() * scale[:, None, :, None]).view(n, k)
            return {"weight": q.view(n, k), scale_name: scale}, deq
        scale = wf.abs().amax(dim=1, keepdim=True) / 448.0 if strategy == "channel" else wf.abs().amax().view(1, 1) / 448
        q = (wf / scale).to(FP8)
        out = {"weight": q, scale_name: scale if strategy == "channel" else scale.view(1)}
        if static_input:   # q, k and v differ: the fused layer takes the largest
            out["input_scale"] = torch.tensor([{"q_proj": 0.03, "k_proj": 0.05}.get(name.split(".")[-2], 0.04)])
        return out, q.float() * scale
    return fmt


def ct_config(weights: dict, input_activations: dict | None, fmt: str) -> dict:
    from compressed_tensors.quantization import QuantizationArgs, QuantizationConfig, QuantizationScheme
    scheme = QuantizationScheme(targets=["Linear"], weights=QuantizationArgs(**weights),
                                input_activations=QuantizationArgs(**input_activations) if input_activations else None)
    cfg = QuantizationConfig(config_groups={"group_0": scheme}, format=fmt, ignore=["lm_head"],
                             quantization_status="compressed")
    return cfg.model_dump(mode="json")


def ct_w4a16(group: int, symmetric: bool):
    """compressed-tensors' own quantize and pack (pack-quantized: weight_packed [N, K/8], weight_scale
    [N, G], weight_zero_point [N/8, G] when asymmetric, weight_shape)."""
    from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32
    from compressed_tensors.quantization import QuantizationArgs
    from compressed_tensors.quantization.lifecycle.forward import dequantize, quantize
    from compressed_tensors.quantization.utils import calculate_qparams
    args = QuantizationArgs(num_bits=4, type="int", symmetric=symmetric, group_size=group, strategy="group")

    def fmt(name, w):
        n, k = w.shape
        wg = w.float().view(n, k // group, group)
        scale, zp = calculate_qparams(wg.amin(-1), wg.amax(-1), args)
        q = quantize(w.float(), scale, zp, args, dtype=torch.int8)
        out = {"weight_packed": pack_to_int32(q, 4), "weight_scale": scale,
               "weight_shape": torch.tensor([n, k], dtype=torch.int64)}
        if not symmetric:
            out["weight_zero_point"] = pack_to_int32(zp.to(torch.int8), 4, packed_dim=0)
        return out, dequantize(q, scale, zp, args)
    return fmt


def _round_groups(wt: torch.Tensor, g_idx: torch.Tensor, groups: int, sym: bool):
    """GPTQ/AWQ's round-to-nearest grid over W^T [K, N] with each k in group g_idx[k]: (q [K, N]
    in 0..15, scales [G, N] as fp16, zeros [G, N])."""
    scales, zeros = [], []
    for j in range(groups):
        rows = wt[g_idx == j]
        lo, hi = rows.amin(0).clamp(max=0), rows.amax(0).clamp(min=0)
        if sym:
            s, z = torch.maximum(hi, -lo) * 2 / 15, torch.full_like(hi, 8.0)
        else:
            s = (hi - lo) / 15
            z = torch.round(-lo / s).clamp(1, 15)   # >= 1: GPTQ v1 stores zero - 1
        scales.append(s.half().float())
        zeros.append(z)
    s, z = torch.stack(scales), torch.stack(zeros)
    q = torch.clamp(torch.round(wt / s[g_idx]) + z[g_idx], 0, 15).to(torch.int32)
    return q, s, z.to(torch.int32)


def _pack(q: torch.Tensor, dim: int, order=tuple(range(8))) -> torch.Tensor:
    """8 nibbles per int32 along `dim`: nibble i holds element 8j + order[i]."""
    q = q.to(torch.int32).movedim(dim, -1)
    words = torch.zeros(*q.shape[:-1], q.shape[-1] // 8, dtype=torch.int32)
    for i, src in enumerate(order):
        words |= (q[..., src::8] & 0xF) << (4 * i)
    return words.movedim(-1, dim)


def gptq(group: int, sym: bool, desc_act: bool):
    """AutoGPTQ's layout: qweight [K/8, N] (packed along K), qzeros [G, N/8] holding zero - 1,
    scales [G, N] fp16, g_idx [K] (act-order: the groups follow a permutation of the columns)."""
    def fmt(name, w):
        wt = w.float().t()
        k = wt.shape[0]
        # the permutation follows the input's Hessian: one per input, shared by q/k/v and gate/up
        layer, proj = name.split(".")[2], name.split(".")[-2]
        inputs = {"q_proj": 0, "k_proj": 0, "v_proj": 0, "o_proj": 1, "gate_proj": 2, "up_proj": 2, "down_proj": 3}
        gen = torch.Generator().manual_seed(int(layer) * 10 + inputs[proj])
        perm = torch.randperm(k, generator=gen) if desc_act else torch.arange(k)
        g_idx = torch.empty(k, dtype=torch.int32)
        g_idx[perm] = (torch.arange(k) // group).to(torch.int32)
        q, s, z = _round_groups(wt, g_idx, k // group, sym)
        out = {"qweight": _pack(q, 0), "qzeros": _pack(z - 1, 1), "scales": s.half(), "g_idx": g_idx}
        return out, ((q - z[g_idx]) * s[g_idx]).t()
    return fmt


def awq(group: int):
    """AutoAWQ's GEMM layout: qweight [K, N/8] and qzeros [G, N/8] packed along N in the order
    0, 2, 4, 6, 1, 3, 5, 7; scales [G, N] fp16."""
    order = (0, 2, 4, 6, 1, 3, 5, 7)

    def fmt(name, w):
        wt = w.float().t()
        g_idx = (torch.arange(wt.shape[0]) // group).to(torch.int32)
        q, s, z = _round_groups(wt, g_idx, wt.shape[0] // group, sym=False)
        out = {"qweight": _pack(q, 1, order), "qzeros": _pack(z, 1, order), "scales": s.half()}
        return out, ((q - z[g_idx]) * s[g_idx]).t()
    return fmt


# name -> (format writer, quantization_config, weight-only)
FORMATS = {
    "ct-fp8-dynamic": (fp8_serialized("channel"), ct_config(
        dict(num_bits=8, type="float", strategy="channel"),
        dict(num_bits=8, type="float", strategy="token", dynamic=True), "float-quantized"), True),
    "ct-fp8-static": (fp8_serialized("tensor", static_input=True), ct_config(
        dict(num_bits=8, type="float", strategy="tensor"),
        dict(num_bits=8, type="float", strategy="tensor", dynamic=False), "float-quantized"), False),
    "ct-fp8-block": (fp8_serialized("block"), ct_config(
        dict(num_bits=8, type="float", strategy="block", block_structure=[16, 16]),
        dict(num_bits=8, type="float", strategy="group", group_size=16, dynamic=True), "float-quantized"), True),
    "fp8-block": (fp8_serialized("block", scale_name="weight_scale_inv"), {
        "quant_method": "fp8", "activation_scheme": "dynamic", "fmt": "e4m3", "weight_block_size": [16, 16]}, True),
    "fp8-per-tensor": (fp8_serialized("tensor"), {"quant_method": "fp8", "activation_scheme": "dynamic"}, True),
    "ct-w4a16-g64": (ct_w4a16(64, True), ct_config(
        dict(num_bits=4, type="int", strategy="group", group_size=64, symmetric=True), None, "pack-quantized"), True),
    "ct-w4a16-g32-asym": (ct_w4a16(32, False), ct_config(
        dict(num_bits=4, type="int", strategy="group", group_size=32, symmetric=False), None, "pack-quantized"),
        True),
    "gptq-g32": (gptq(32, sym=True, desc_act=False), {
        "quant_method": "gptq", "bits": 4, "group_size": 32, "desc_act": False, "sym": True}, True),
    "gptq-g32-desc-act-asym": (gptq(32, sym=False, desc_act=True), {
        "quant_method": "gptq", "bits": 4, "group_size": 32, "desc_act": True, "sym": False}, True),
    "awq-g32": (awq(32), {"quant_method": "awq", "bits": 4, "group_size": 32, "zero_point": True,
                          "version": "gemm"}, True),
}


@pytest.fixture(scope="module")
def format_dirs(model_factory, tmp_path_factory) -> dict[str, tuple[str, str]]:
    """format -> (its checkpoint, the dequantized dense one), from one tiny Llama (with biases)."""
    src = model_factory("llama", attention_bias=True)
    out = {}
    for name, (fmt, qcfg, _) in FORMATS.items():
        out[name] = quantize_checkpoint(src, tmp_path_factory.mktemp(name), fmt, qcfg)
    return out


@pytest.mark.parametrize("name", list(FORMATS))
def test_checkpoint_format_matches_dequantized(format_dirs, name):
    from workers.model_loader import load_model
    quant_dir, ref_dir = format_dirs[name]
    model = load_model(quant_dir, torch.float32, "cpu")
    assert model.quant_config is not None
    weight_only = FORMATS[name][2]   # else the static activation scale rounds x to e4m3's 3 mantissa bits too
    assert_matches_dequantized(model, ref_dir, cos_min=0.999 if weight_only else 0.9, same_tokens=weight_only)


def test_static_input_scale_rounds_activations_as_specified(format_dirs):
    """compressed-tensors FP8 with static input scales: a fused qkv_proj takes the largest of its
    parts' scales (vLLM's rule) and computes (e4m3(x / s) * s) W^T exactly (the weight dequantized)."""
    from workers.model_loader import load_model
    model = load_model(format_dirs["ct-fp8-static"][0], torch.float32, "cpu")
    qkv = model.model.layers[0].self_attn.qkv_proj
    assert qkv.input_scale.item() == pytest.approx(0.05)
    x = torch.randn(5, qkv.in_features, generator=torch.Generator().manual_seed(0))
    s = qkv.input_scale.item()
    xq = (x / s).clamp(-448, 448).to(FP8).float() * s
    w = qkv.weight.float() * qkv.weight_scale[:, None]
    torch.testing.assert_close(qkv(x), F.linear(xq, w, qkv.bias))


# exact against HF (weight-only), and groups that split: o_proj's 64 inputs are 32 per rank
# (one of each layout: per-shard scalar scales, blocks, packed zero points, act-order, AWQ's order)
# ------------------------------------------------------------------ kernels (CPU: interpreted Triton)
@pytest.mark.parametrize("rows", [1, 3])
def test_fp8_gemv_matches_reference(rows):
    """The decode GEMV (per-channel and 128x128 block scales, odd N) against dequantize-and-matmul."""
    from kernels import fp8_linear as k
    g = torch.Generator().manual_seed(rows)
    x, b = torch.randn(rows, 256, generator=g), torch.randn(40, generator=g)
    w, s = k.quantize_rows(torch.randn(40, 256, generator=g))
    torch.testing.assert_close(k.fp8_gemv(x, w, s, b), k.fp8_linear_ref(x, w, s, b), atol=1e-3, rtol=1e-3)
    torch.testing.assert_close(k.fp8_gemv_legacy(x, w, s, b), k.fp8_linear_ref(x, w, s, b), atol=1e-3, rtol=1e-3)
    w, s = k.quantize_blocks(torch.randn(40, 256, generator=g))
    torch.testing.assert_close(k.fp8_gemv(x, w, s, None, 128), k.fp8_linear_ref(x, w, s, None, 128),
                               atol=1e-3, rtol=1e-3)


@pytest.mark.parametrize("prologue", ["add_rms_norm", "silu_mul"])
@pytest.mark.parametrize("rows", [1, 3])
def test_fp8_gemv_fuses_the_prologue(prologue, rows, monkeypatch):
    """kernels/gemv.py's GEMV on fp8 weights with per-channel scales (what an FP8 model's decode
    runs, the norm or SiLU fused in; LOOM_FP8_GEMV=wide's doubled BLOCK_K too) against the
    unfused ops on the dequantized weight."""
    from kernels import fp8_linear as k
    from kernels.gemv import fp8_tile_config, gemv, gemv_ref
    g = torch.Generator().manual_seed(rows)
    kdim = 256
    w, s = k.quantize_rows(torch.randn(40, kdim, generator=g))
    x = torch.randn(rows, 2 * kdim if prologue == "silu_mul" else kdim, generator=g)
    kw = dict(residual=torch.randn(rows, kdim, generator=g), norm_weight=torch.rand(kdim, generator=g) + 0.5,
              eps=1e-6) if prologue == "add_rms_norm" else {}
    bias = torch.randn(40, generator=g)
    want, want_res = gemv_ref(x, w.float() * s[:, None], bias, prologue=prologue, **kw)
    for mode in ("gemv", "wide"):
        monkeypatch.setenv("LOOM_FP8_GEMV", mode)
        # (wide: the GPU's tiles themselves, prologue unfused as on Llama-3.1-8B's big weights)
        tiles = None if mode == "gemv" else fp8_tile_config(40, kdim, rows, prologue)
        got, res = gemv(x, w, bias, prologue=prologue, scale=s, tiles=tiles, **kw)
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
        if want_res is not None:
            torch.testing.assert_close(res, want_res)


def test_block_fp8_gemm_matches_reference():
    """The block-scaled GEMM quantizes activations per token and 128 columns: cosine with the
    weight-only reference (0.99: the interpreter's e4m3 cast truncates; tests/test_gpu_quant.py
    asks 0.999 of the GPU's, which rounds to nearest)."""
    from kernels import fp8_linear as k
    g = torch.Generator().manual_seed(0)
    w, s = k.quantize_blocks(torch.randn(200, 256, generator=g))
    for rows in (20, 300):   # a decode batch's tiles, and prefill's 128 x 128 in L2 bands
        x = torch.randn(rows, 256, generator=g)
        y, ref = k.block_fp8_gemm(x, w, s, None, 128), k.fp8_linear_ref(x, w, s, None, 128)
        assert F.cosine_similarity(y, ref, dim=-1).min() > 0.99


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
    with pytest.raises(QuantizationError, match="mixture of experts"):
        get_quantization_config({"num_experts": 8, "quantization_config": {"quant_method": "fp8"}}, None)
    with pytest.raises(QuantizationError, match="gptq with 8 bits"):
        get_quantization_config({"quantization_config": {"quant_method": "gptq", "bits": 8}}, None)
    with pytest.raises(QuantizationError, match="compressed-tensors 8-bit int"):
        get_quantization_config({"quantization_config": {"quant_method": "compressed-tensors", "config_groups": {
            "g": {"targets": ["Linear"], "weights": {"num_bits": 8, "type": "int", "strategy": "channel"}}}}}, None)


@pytest.mark.parametrize("group,act_order", [(32, False), (128, False), (64, True)])
def test_w4a16_kernels_match_reference(group, act_order):
    """The dequantizing GEMV (1 and 3 rows) and GEMM (20 rows) against dequantize-and-matmul."""
    from kernels import w4a16 as k
    g = torch.Generator().manual_seed(group)
    kdim, n = 256, 48
    q = torch.randint(0, 16, (kdim, n), generator=g, dtype=torch.int32)
    qweight = k.pack_k(q)
    assert torch.equal(k.unpack_k(qweight), q)
    scales = torch.rand(kdim // group, n, generator=g) * 0.1
    zeros = torch.randint(0, 16, (kdim // group, n), generator=g).float()
    g_idx = (torch.randperm(kdim, generator=g) // group).to(torch.int32) if act_order else None
    bias = torch.randn(n, generator=g)
    for rows, fn in ((1, k.w4a16_gemv), (3, k.w4a16_gemv), (20, k.w4a16_gemm)):
        x = torch.randn(rows, kdim, generator=g)
        torch.testing.assert_close(fn(x, qweight, scales, zeros, g_idx, group, bias),
                                   k.w4a16_ref(x, qweight, scales, zeros, g_idx, group, bias), atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("group,act_order", [(32, False), (128, False), (256, False), (64, True)])
def test_w4a16_nk_kernels_match_reference(group, act_order):
    """The N x K layout's kernels (what the model runs): the GEMV (1 and 3 rows: the per-row-scale
    and per-word-scale tiles), the fused dequantizing GEMM (2 and 20 rows) and the dequantization,
    from the [K/8, N] layout repacked (act-order: k sorted by group, x permuted), against
    dequantize-and-matmul of the original; odd N (48 columns)."""
    from kernels import w4a16 as k
    g = torch.Generator().manual_seed(group)
    kdim, n = 256, 48
    qweight = k.pack_k(torch.randint(0, 16, (kdim, n), generator=g, dtype=torch.int32))
    scales = torch.rand(kdim // group, n, generator=g) * 0.1
    zeros = torch.randint(0, 16, (kdim // group, n), generator=g).float()
    g_idx = (torch.randperm(kdim, generator=g) // group).to(torch.int32) if act_order else None
    bias = torch.randn(n, generator=g)
    nk = k.repack_nk(qweight, scales, zeros, g_idx, group)
    assert (nk[3] is not None) == act_order
    for rows, fn in ((1, k.w4a16_gemv_nk), (3, k.w4a16_gemv_nk), (2, k.w4a16_gemm_nk), (20, k.w4a16_gemm_nk)):
        x = torch.randn(rows, kdim, generator=g)
        want = k.w4a16_ref(x, qweight, scales, zeros, g_idx, group, bias)
        torch.testing.assert_close(k.w4a16_nk_ref(x, *nk, group, bias), want, atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(fn(x, *nk, group, bias), want, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(k.dequantize_nk_to(nk[0], nk[1], nk[2], group, torch.float32),
                               k.dequantize_nk(nk[0], nk[1], nk[2], group))
    # a row-parallel rank's act-order k (half of them, groups shared with the other rank): no N x K
    if act_order:
        half = k.pack_k(k.unpack_k(qweight)[: kdim // 2])
        assert k.repack_nk(half, scales, zeros, g_idx[: kdim // 2], group) is None


def test_models_card_names_the_quantization(format_dirs, model_factory):
    """/v1/models' card carries the weights' method (vLLM's --quantization name; None: unquantized)."""
    from frontend.openai.protocol import models_response
    from ipc.config import EngineConfig, weight_quantization
    quant_dir, dense_dir = format_dirs["awq-g32"]
    assert weight_quantization(EngineConfig(model=quant_dir)) == "awq"
    assert weight_quantization(EngineConfig(model=format_dirs["ct-w4a16-g64"][0])) == "compressed-tensors"
    assert weight_quantization(EngineConfig(model=dense_dir)) is None
    assert weight_quantization(EngineConfig(model=dense_dir, quantization="fp8")) == "fp8"
    assert models_response("m", quant_dir, 64, quantization="awq")["data"][0]["quantization"] == "awq"


def test_w4a16_dequantize_kernel_matches_reference():
    from kernels import w4a16 as k
    g = torch.Generator().manual_seed(3)
    q = k.pack_k(torch.randint(0, 16, (256, 80), generator=g, dtype=torch.int32))
    scales, zeros = torch.rand(4, 80, generator=g), torch.randint(0, 16, (4, 80), generator=g).float()
    for g_idx in (None, (torch.randperm(256, generator=g) // 64).to(torch.int32)):
        torch.testing.assert_close(k.dequantize_to(q, scales, zeros, g_idx, 64, torch.float32),
                                   k.dequantize(q, scales, zeros, g_idx, 64))


def test_ignored_layers_stay_dense(model_factory, tmp_path):
    """compressed-tensors' `ignore` (a "re:" pattern on checkpoint names: gate_proj and up_proj
    of layer 1, fused into one gate_up_proj here) keeps those linears in the model dtype."""
    from workers.model_loader import load_model
    fp8 = fp8_serialized("channel")
    fmt = lambda name, w: ({"weight": w}, w) if ".layers.1.mlp." in name else fp8(name, w)  # noqa: E731
    cfg = ct_config(dict(num_bits=8, type="float", strategy="channel"),
                    dict(num_bits=8, type="float", strategy="token", dynamic=True), "float-quantized")
    cfg["ignore"] = ["lm_head", r"re:.*layers\.1\.mlp\..*"]
    quant_dir, ref_dir = quantize_checkpoint(model_factory("llama"), tmp_path, fmt, cfg)
    model = load_model(quant_dir, torch.float32, "cpu")
    mlp1, mlp0 = model.model.layers[1].mlp, model.model.layers[0].mlp
    assert mlp1.gate_up_proj.quant_method is None and mlp1.gate_up_proj.weight.dtype == torch.float32
    assert mlp1.down_proj.weight.dtype == torch.float32 and mlp0.gate_up_proj.weight.dtype == FP8
    assert_matches_dequantized(model, ref_dir)


def test_float_weight_update_into_block_fp8_is_quantized_by_block(format_dirs):
    """A float tensor sent to a block-FP8 model (a weight update of k_proj alone) is quantized per
    block on arrival: k's rows and block scales as a checkpoint of it would hold them, q's kept."""
    from kernels.fp8_linear import quantize_blocks
    from workers.model_loader import load_model
    model = load_model(format_dirs["fp8-block"][0], torch.float32, "cpu")
    qkv = model.model.layers[0].self_attn.qkv_proj
    before_q = qkv.weight[:64].clone()
    new_k = torch.randn(32, 64, generator=torch.Generator().manual_seed(0))
    model.load_weights(iter([("model.layers.0.self_attn.k_proj.weight", new_k.to(torch.bfloat16))]), partial=True)
    q, s = quantize_blocks(new_k.to(torch.bfloat16), 16)
    assert torch.equal(qkv.weight[64:96].float(), q.float()) and torch.equal(qkv.weight_scale_inv[4:6], s)
    assert torch.equal(qkv.weight[:64].float(), before_q.float())


def _within_one_fp8_step(q: torch.Tensor, want: torch.Tensor) -> bool:
    """Triton's interpreter casts fp32 to e4m3 with its own rounding (values just under a power of
    two even land a binade low); the GPU rounds to nearest as torch does (tests/test_gpu_quant.py
    asks equality there). Here: the same value almost everywhere."""
    return bool((q.float() != want.float()).float().mean() < 0.05)


def test_activation_quantization_kernels_match_torch():
    """The one-kernel per-token (dynamic and static) and per-token-group FP8 quantization against
    the torch ops they replace."""
    from kernels import fp8_linear as k
    x = torch.randn(3, 1500, generator=torch.Generator().manual_seed(0)) * 4
    for static in (None, torch.tensor(0.02)):
        q, s = k.quantize_per_token(x, static)
        xf = x.float()
        want_s = (xf.abs().amax(-1, keepdim=True) / 448).clamp(min=1e-12) if static is None else \
            static.reshape(1, 1).expand(3, 1)
        torch.testing.assert_close(s, want_s)
        assert _within_one_fp8_step(q, (xf / want_s).clamp(-448, 448).to(FP8))
    q, s = k.quantize_per_token_group(x[:, :1280], 128)
    want_s = (x[:, :1280].reshape(3, 10, 128).abs().amax(-1) / 448).clamp(min=1e-12)
    torch.testing.assert_close(s, want_s)
    assert _within_one_fp8_step(q, (x[:, :1280].reshape(3, 10, 128) / want_s[..., None]).to(FP8).view(3, 1280))


def test_mfu_counts_quantized_weight_bytes(format_dirs):
    """--enable-mfu-metrics: a step's weight reads count the linears at their stored bytes."""
    from ipc.config import EngineConfig
    from metrics.mfu import MfuEstimator, ModelShape
    quant_dir, dense_dir = format_dirs["ct-w4a16-g64"]
    read = {}
    for name, kw in (("dense", dict(model=dense_dir)), ("fp8", dict(model=dense_dir, quantization="fp8")),
                     ("w4", dict(model=quant_dir))):
        shape = ModelShape.from_engine_config(EngineConfig(dtype="bfloat16", **kw))
        read[name] = MfuEstimator(shape).step(1, 1, 0, 0).read_bytes
        assert shape.linear_weight_bytes == {"dense": 0.0, "fp8": 1.0, "w4": 0.5}[name]
    s = ModelShape.from_engine_config(EngineConfig(model=dense_dir, dtype="bfloat16"))
    h = s.hidden_size   # the decoder linears' weights: q/k/v, o and the gated MLP of every layer
    linear = s.num_layers * (h * (s.num_heads + 2 * s.num_kv_heads) * s.head_dim + s.num_heads * s.head_dim * h
                             + 3 * h * s.intermediate_size)
    assert read["dense"] - read["fp8"] == pytest.approx(linear * 1.0)   # 2 bytes -> 1
    assert read["dense"] - read["w4"] == pytest.approx(linear * 1.5)    # 2 bytes -> 0.5


def test_quant_kernels_bench_times_every_variant(monkeypatch, capsys):
    """bench/quant_kernels.py on CPU (interpreted kernels, toy shapes, a call instead of the GPU
    timing): every family's variants run and the choice and target tables print."""
    import bench.quant_kernels as b
    monkeypatch.setattr(b, "DEVICE", "cpu")
    monkeypatch.setattr(b, "SHAPES", {"o": (64, 256), "down": (64, 512)})
    monkeypatch.setattr(b, "per_call_us", lambda fn, copies: (fn(0), 1.0)[1])
    monkeypatch.setattr(b, "copies_for", lambda nbytes: 1)
    monkeypatch.setattr("sys.argv", ["quant_kernels", "--rows", "1", "16", "--shapes", "o", "down", "--legacy"])
    assert b.main() == 0
    out = capsys.readouterr().out
    assert "failed" not in out, out
    timed = {tuple(line.split()[2:4]) for line in out.splitlines() if line.startswith(("o ", "down "))}
    for family, variant in (("fp8", "legacy"), ("fp8", "gemv-wide"), ("fp8", "scaled_mm"), ("fp8blk", "default"),
                            ("w4a16", "gemm"), ("w4a16", "dense"), ("w4a16", "actorder"), ("w4a16", "legacy")):
        assert (family, variant) in timed, (family, variant)
    assert "=== choice table" in out and "w4a16 default, 1 row: share of HBM bandwidth" in out
