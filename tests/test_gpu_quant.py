"""The quantized-linear kernels against their torch references at Llama-3.1-8B's shapes (H200)."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

pytestmark = pytest.mark.gpu

# Llama-3.1-8B's linears (N, K): qkv, o, gate_up, down
SHAPES = [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336)]


def _cos(a, b):
    return F.cosine_similarity(a.float(), b.float(), dim=-1).min().item()


@pytest.mark.parametrize("n,k", SHAPES)
@pytest.mark.parametrize("rows", [1, 4, 8])
def test_fp8_gemv(n, k, rows):
    from kernels import fp8_linear as q
    x = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16)
    w, s = q.quantize_rows(torch.randn(n, k, device="cuda") * 0.02)
    assert _cos(q.fp8_gemv(x, w, s), q.fp8_linear_ref(x.float(), w, s)) > 0.9999
    w, s = q.quantize_blocks(torch.randn(n, k, device="cuda") * 0.02)
    assert _cos(q.fp8_gemv(x, w, s, None, 128), q.fp8_linear_ref(x.float(), w, s, None, 128)) > 0.9999


@pytest.mark.parametrize("n,k", SHAPES)
@pytest.mark.parametrize("rows", [16, 300, 2048])
def test_fp8_gemms(n, k, rows):
    """_scaled_mm (per-channel, per-token activations) and the block GEMM: within FP8's
    activation rounding of the weight-only reference."""
    from kernels import fp8_linear as q
    x = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16)
    w, s = q.quantize_rows(torch.randn(n, k, device="cuda") * 0.02)
    assert _cos(q.scaled_mm_per_channel(x, w, s), q.fp8_linear_ref(x.float(), w, s)) > 0.999
    w, s = q.quantize_blocks(torch.randn(n, k, device="cuda") * 0.02)
    assert _cos(q.block_fp8_gemm(x, w, s, None, 128), q.fp8_linear_ref(x.float(), w, s, None, 128)) > 0.999


@pytest.mark.parametrize("n,k", SHAPES)
@pytest.mark.parametrize("rows", [1, 8, 300, 2048])
@pytest.mark.parametrize("act_order", [False, True])
def test_w4a16(n, k, rows, act_order):
    """The dequantizing GEMV (decode rows) and GEMM, group 128, against dequantize-and-matmul."""
    from kernels import w4a16 as q
    group = 128
    qweight = q.pack_k(torch.randint(0, 16, (k, n), device="cuda", dtype=torch.int32))
    scales = (torch.rand(k // group, n, device="cuda") * 0.002).to(torch.bfloat16)
    zeros = torch.randint(0, 16, (k // group, n), device="cuda").to(torch.bfloat16)
    g_idx = (torch.randperm(k, device="cuda") // group).to(torch.int32) if act_order else None
    x = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16)
    fn = q.w4a16_gemv if rows <= q.MAX_GEMV_ROWS else q.w4a16_gemm
    ref = q.w4a16_ref(x.float(), qweight, scales, zeros, g_idx, group)
    assert _cos(fn(x, qweight, scales, zeros, g_idx, group), ref) > 0.9999


@pytest.mark.parametrize("n,k", SHAPES)
@pytest.mark.parametrize("rows", [1, 4, 16, 300, 2048])
@pytest.mark.parametrize("act_order", [False, True])
def test_w4a16_nk(n, k, rows, act_order):
    """The N x K layout the model runs (w4a16_linear_nk: GEMV, fused GEMM, dequantize + cuBLAS by
    row count; the fused GEMM at every row count too), group 128, against dequantize-and-matmul
    of the [K/8, N] original."""
    from kernels import w4a16 as q
    group = 128
    qweight = q.pack_k(torch.randint(0, 16, (k, n), device="cuda", dtype=torch.int32))
    scales = (torch.rand(k // group, n, device="cuda") * 0.002).to(torch.bfloat16)
    zeros = torch.randint(0, 16, (k // group, n), device="cuda").to(torch.bfloat16)
    g_idx = (torch.randperm(k, device="cuda") // group).to(torch.int32) if act_order else None
    nk = q.repack_nk(qweight, scales, zeros, g_idx, group)
    x = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16)
    ref = q.w4a16_ref(x.float(), qweight, scales, zeros, g_idx, group)
    assert _cos(q.w4a16_linear_nk(x, *nk, group), ref) > 0.9999
    assert _cos(q.w4a16_gemm_nk(x, *nk, group), ref) > 0.9999


@pytest.mark.parametrize("n,k", SHAPES)
@pytest.mark.parametrize("rows", [1, 8])
@pytest.mark.parametrize("prologue", ["none", "add_rms_norm", "silu_mul"])
def test_fp8_gemv_with_prologue(n, k, rows, prologue):
    """kernels/gemv.py on fp8 weights (the FP8 model's decode path, norms and SiLU fused), its
    default and wide tiles, against the unfused ops on the dequantized weight."""
    from kernels import fp8_linear as q
    from kernels.gemv import fp8_tile_config, gemv, gemv_ref
    w, s = q.quantize_rows(torch.randn(n, k, device="cuda") * 0.02)
    x = torch.randn(rows, 2 * k if prologue == "silu_mul" else k, device="cuda", dtype=torch.bfloat16)
    kw = dict(residual=torch.randn(rows, k, device="cuda", dtype=torch.bfloat16),
              norm_weight=torch.rand(k, device="cuda", dtype=torch.bfloat16) + 0.5,
              eps=1e-6) if prologue == "add_rms_norm" else {}
    want, _ = gemv_ref(x.float(), w.float() * s[:, None], prologue=prologue,
                       **{a: (b.float() if isinstance(b, torch.Tensor) else b) for a, b in kw.items()})
    t = fp8_tile_config(n, k, rows, prologue)
    for tiles in (None, dict(t, block_k=min(2 * t["block_k"], 1 << (k.bit_length() - 1)))):
        assert _cos(gemv(x, w, prologue=prologue, scale=s, tiles=tiles, **kw)[0], want) > 0.9999


@pytest.mark.parametrize("quantization", ["fp8", "w4a16-g128", "fp8-block"])
def test_demo_model_quantized_recites_the_zen_on_gpu(demo_model_dir, quantization, tmp_path):
    """The whole path on the GPU (bf16, CUDA graphs, the kernels above in the model): the trained
    demo model quantized (online FP8, GPTQ group 128, block-wise FP8 with 64 blocks: its k/v parts
    have 64 rows) gives the
    unquantized model's 16 greedy tokens over three prompts, decoding one and three at a time."""
    from frontend import LLM, SamplingParams
    from transformers import AutoTokenizer

    from tests.hf_oracle import hf_greedy
    from tests.test_quantization import demo_variant, fp8_serialized, quantize_checkpoint
    tok = AutoTokenizer.from_pretrained(demo_model_dir)
    prompts = [tok.encode(t) for t in ("Beautiful is better than", "Errors should", "Now is better")]
    want = [hf_greedy(demo_model_dir, p, 16) for p in prompts]
    if quantization == "fp8-block":
        model_dir, _ = quantize_checkpoint(demo_model_dir, tmp_path, fp8_serialized("block", block=64,
                                           scale_name="weight_scale_inv"),
                                           {"quant_method": "fp8", "weight_block_size": [64, 64]})
        kw = {}
    else:
        model_dir, kw = demo_variant(demo_model_dir, quantization, tmp_path)
    llm = LLM(model_dir, max_model_len=512, **kw)
    try:
        params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
        one = [llm.generate([{"prompt_token_ids": p}], params, use_tqdm=False)[0].outputs[0].token_ids
               for p in prompts]
        three = [o.outputs[0].token_ids for o in
                 llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)]
    finally:
        llm.shutdown()
    assert one == want and three == want, (tok.batch_decode(one), tok.batch_decode(want))


def _same(a, b) -> bool:
    """Equal fp8 codes but for rare ties (Triton's fp32 division is not IEEE's div.rn)."""
    return bool((a.float() != b.float()).float().mean() < 1e-3)


def test_activation_quantization_kernels_equal_torch():
    from kernels import fp8_linear as q
    x = torch.randn(37, 4096, device="cuda", dtype=torch.bfloat16) * 3
    for static in (None, torch.tensor(0.02, device="cuda")):
        xq, s = q.quantize_per_token(x, static)
        want_s = (x.float().abs().amax(-1, keepdim=True) / 448).clamp(min=1e-12) if static is None \
            else static.reshape(1, 1).expand(37, 1)
        torch.testing.assert_close(s, want_s)
        assert _same(xq, (x.float() / want_s).clamp(-448, 448).to(q.FP8))
    xq, s = q.quantize_per_token_group(x, 128)
    want_s = (x.float().view(37, 32, 128).abs().amax(-1) / 448).clamp(min=1e-12)
    torch.testing.assert_close(s, want_s)
    assert _same(xq, (x.float().view(37, 32, 128) / want_s[..., None]).to(q.FP8).view(37, 4096))
