"""gpt-oss beyond the architecture parity tests (tests/test_models.py, tests/test_arch_parity.py,
tests/test_arch_tp.py run its tiny model against HF): the MXFP4 checkpoints the released models
ship, dequantized at load."""
from __future__ import annotations

import json
import os

import pytest
import torch

from tests.tiny_models import make_tiny_model
from workers.model_loader import load_model
from workers.models.gpt_oss import FP4_VALUES, dequantize_mxfp4


def quantize_mxfp4(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """w [..., K] (K a multiple of 32) -> (blocks uint8 [..., K/32, 16], scales uint8 [..., K/32]):
    each block of 32 scaled by a power of two that puts its largest magnitude in [4, 8), then
    every value rounded to the nearest FP4 (E2M1) value, two to a byte, low nibble first."""
    x = w.float().reshape(*w.shape[:-1], w.shape[-1] // 32, 32)
    amax = x.abs().amax(-1).clamp(min=2.0 ** -60)
    exp = torch.floor(torch.log2(amax)) - 2          # 6 = 1.5 * 2^2, FP4's largest
    y = x / torch.exp2(exp)[..., None]
    magnitudes = torch.tensor(FP4_VALUES[:8])
    idx = (y.abs()[..., None] - magnitudes).abs().argmin(-1) + 8 * (y < 0)
    blocks = (idx[..., 0::2] | (idx[..., 1::2] << 4)).to(torch.uint8)
    return blocks, (exp + 127).to(torch.uint8)


def test_dequantize_mxfp4_matches_transformers():
    # every nibble, scales from tiny to large: ours keeps [E, out, in]; transformers' helper
    # (the oracle) returns the transpose, HF's [E, in, out]
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors
    g = torch.Generator().manual_seed(0)
    blocks = torch.randint(0, 256, (3, 8, 4, 16), generator=g, dtype=torch.uint8)
    scales = torch.randint(100, 150, (3, 8, 4), generator=g, dtype=torch.uint8)
    for dtype in (torch.float32, torch.bfloat16):
        ours = dequantize_mxfp4(blocks, scales, dtype)
        assert ours.shape == (3, 8, 128) and ours.dtype == dtype
        want = convert_moe_packed_tensors(blocks, scales, dtype=dtype).transpose(1, 2)
        assert torch.equal(ours, want)
    with pytest.raises(ValueError, match="do not match"):
        dequantize_mxfp4(blocks, scales[..., :3], torch.float32)


def _mxfp4_checkpoint(src: str, dst: str) -> dict[str, torch.Tensor]:
    """src's tiny gpt-oss with its expert weights made MXFP4-exact (rewritten in src too), and
    dst the same model as the released checkpoints store it: `*_blocks` / `*_scales` in
    [E, out, in] and `quantization_config.quant_method == "mxfp4"`. Returns src's tensors."""
    from safetensors.torch import load_file, save_file
    weights = load_file(os.path.join(src, "model.safetensors"))
    quantized = {}
    for name in list(weights):
        if name.endswith((".experts.gate_up_proj", ".experts.down_proj")):
            blocks, scales = quantize_mxfp4(weights[name].transpose(1, 2))   # HF's [E, in, out] -> [E, out, in]
            weights[name] = dequantize_mxfp4(blocks, scales, torch.float32).transpose(1, 2).contiguous()
            quantized[f"{name}_blocks"], quantized[f"{name}_scales"] = blocks, scales
    save_file(weights, os.path.join(src, "model.safetensors"), metadata={"format": "pt"})
    rest = {n: t for n, t in weights.items() if not n.endswith((".experts.gate_up_proj", ".experts.down_proj"))}
    os.makedirs(dst, exist_ok=True)
    save_file({**rest, **quantized}, os.path.join(dst, "model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(src, "config.json")) as f:
        config = json.load(f)
    config["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": [
        "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]}
    with open(os.path.join(dst, "config.json"), "w") as f:
        json.dump(config, f)
    return weights


def test_mxfp4_checkpoint_loads_as_its_dequantized_weights(tmp_path):
    # the same weights as an fp32 checkpoint and as an MXFP4 one (blocks before scales, as the
    # files sort, and after): every parameter of the loaded models is equal, in fp32 and bf16
    src = make_tiny_model(str(tmp_path / "fp32"), "gpt_oss", intermediate_size=64)
    weights = _mxfp4_checkpoint(src, str(tmp_path / "mxfp4"))
    for dtype in (torch.float32, torch.bfloat16):
        plain = load_model(src, dtype, "cpu")
        packed = load_model(str(tmp_path / "mxfp4"), dtype, "cpu")
        ours = dict(packed.named_parameters())
        for name, p in plain.named_parameters():
            assert torch.equal(ours[name], p), name
    # the experts really are the checkpoint's: w13 is gate_up_proj's gate columns, then its up columns
    w13 = dict(plain.named_parameters())["model.layers.1.mlp.experts.w13_weight"]
    gate_up = weights["model.layers.1.mlp.experts.gate_up_proj"].to(torch.bfloat16)   # [E, H, 2I]
    assert torch.equal(w13, torch.cat([gate_up[..., 0::2], gate_up[..., 1::2]], -1).transpose(1, 2))
    # scales before blocks (another file order) load alike; a lone half is an error
    from safetensors.torch import load_file
    packed_sd = load_file(str(tmp_path / "mxfp4" / "model.safetensors"))
    model = load_model(str(tmp_path / "mxfp4"), torch.float32, "cpu", load_format="dummy")
    model.load_weights(sorted(packed_sd.items(), reverse=True))
    want = dict(load_model(src, torch.float32, "cpu").named_parameters())
    for name, p in model.named_parameters():
        assert torch.equal(want[name], p), name
    lone = [(n, t) for n, t in packed_sd.items() if not n.endswith("down_proj_scales")]
    with pytest.raises(ValueError, match="without their blocks or scales"):
        model.load_weights(lone)


def test_unsupported_quantization_is_refused(tmp_path):
    src = make_tiny_model(str(tmp_path / "m"), "gpt_oss")
    with open(os.path.join(src, "config.json")) as f:
        config = json.load(f)
    config["quantization_config"] = {"quant_method": "awq"}
    with open(os.path.join(src, "config.json"), "w") as f:
        json.dump(config, f)
    with pytest.raises(ValueError, match="awq"):
        load_model(src, torch.float32, "cpu", load_format="dummy")


def test_bench_preset_shape():
    # gpt-oss-20b's published size (20.9 B with bf16 experts), alternating layer types
    from bench.presets import PRESETS, num_params
    cfg = PRESETS["gpt-oss-20b"]
    assert round(num_params(cfg) / 1e9, 1) == 20.9
    assert cfg["layer_types"][:2] == ["sliding_attention", "full_attention"] and len(cfg["layer_types"]) == 24
