"""kernels/fused_moe.py's torch reference against a per-token loop over the chosen experts,
and the routing against HF's (softmax / sigmoid, with and without renormalisation)."""
import pytest
import torch
import torch.nn.functional as F

from kernels.fused_moe import deinterleave_gate_up, fused_moe_dense_ref, fused_moe_ref, select_experts


def naive_act(gate, up, activation):
    if activation == "silu":
        return F.silu(gate) * up
    # transformers' GptOssExperts._apply_gate, written out
    gate = torch.minimum(gate, torch.tensor(7.0))
    up = torch.maximum(torch.minimum(up, torch.tensor(7.0)), torch.tensor(-7.0))
    return (up + 1) * gate * torch.sigmoid(1.702 * gate)


def naive_moe(hidden, w13, w2, weights, ids, w13_bias=None, w2_bias=None, activation="silu"):
    out = torch.zeros_like(hidden)
    half = w13.shape[1] // 2
    for t in range(hidden.shape[0]):
        for j in range(ids.shape[1]):
            e = int(ids[t, j])
            gate_up = w13[e] @ hidden[t] + (0 if w13_bias is None else w13_bias[e])
            y = w2[e] @ naive_act(gate_up[:half], gate_up[half:], activation)
            out[t] += weights[t, j] * (y + (0 if w2_bias is None else w2_bias[e]))
    return out


def moe_problem(t, e, k, h, i, seed, routing="random", bias=False, scale=1.0):
    """Random hidden, weights, biases and a routing of t tokens; routing "one_expert": every
    token's top choice is expert 3, "skip_expert": expert 0 receives no token."""
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(t, h, generator=g)
    w13, w2 = scale * torch.randn(e, 2 * i, h, generator=g), scale * torch.randn(e, h, i, generator=g)
    b13 = torch.randn(e, 2 * i, generator=g) if bias else None
    b2 = torch.randn(e, h, generator=g) if bias else None
    weights, ids = select_experts(torch.randn(t, e, generator=g), k, renormalize=True)
    if routing == "one_expert":
        ids[:, 0] = 3
        ids[:, 1:][ids[:, 1:] == 3] = 4
    elif routing == "skip_expert":
        ids[ids == 0] = 5
        ids[:, 1:][ids[:, 1:] == ids[:, :1]] = 1
    return hidden, w13, w2, b13, b2, weights, ids


@pytest.mark.parametrize("t", [0, 1, 7])
@pytest.mark.parametrize("routing", ["random", "one_expert", "skip_expert"])
def test_fused_moe_ref_matches_per_token_loop(t, routing):
    g = torch.Generator().manual_seed(t)
    e, k, h, i = 6, 2, 16, 8
    hidden = torch.randn(t, h, generator=g)
    w13, w2 = torch.randn(e, 2 * i, h, generator=g), torch.randn(e, h, i, generator=g)
    weights, ids = select_experts(torch.randn(t, e, generator=g), k, renormalize=True)
    if routing == "one_expert":          # every token's top choice is expert 3
        ids[:, 0] = 3
    elif routing == "skip_expert":       # expert 0 receives no token
        ids[ids == 0] = 5
    got = fused_moe_ref(hidden, w13, w2, weights, ids)
    assert got.shape == (t, h)
    want = naive_moe(hidden, w13, w2, weights, ids)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    # the sync-free path that CUDA-graph capture runs
    torch.testing.assert_close(fused_moe_dense_ref(hidden, w13, w2, weights, ids), want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("activation", ["silu", "swigluoai"])
@pytest.mark.parametrize("bias", [False, True])
def test_fused_moe_ref_biases_and_activations(activation, bias):
    """Both references with expert biases and gpt-oss's clamped SwiGLU (the weights are scaled
    so that some gate/up values pass the +-7 clamp)."""
    hidden, w13, w2, b13, b2, weights, ids = moe_problem(9, 6, 2, 16, 8, seed=3, routing="skip_expert",
                                                         bias=bias, scale=2.0)
    want = naive_moe(hidden, w13, w2, weights, ids, b13, b2, activation)
    kw = dict(w13_bias=b13, w2_bias=b2, activation=activation)
    torch.testing.assert_close(fused_moe_ref(hidden, w13, w2, weights, ids, **kw), want, rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(fused_moe_dense_ref(hidden, w13, w2, weights, ids, **kw), want, rtol=1e-5, atol=1e-4)
    with pytest.raises(ValueError, match="activation"):
        fused_moe_ref(hidden, w13, w2, weights, ids, activation="gelu")


def test_deinterleave_gate_up_matches_gpt_oss_layout():
    """gpt-oss's gate_up_proj [E, H, 2I] has gate at even and up at odd columns; de-interleaved
    and transposed it is w13 [E, 2I, H] (gate rows first), and the bias [E, 2I] alike."""
    e, h, i = 2, 3, 4
    gate_up = torch.randn(e, h, 2 * i)
    w13 = deinterleave_gate_up(gate_up, dim=2).transpose(1, 2)
    assert torch.equal(w13[:, :i], gate_up[..., 0::2].transpose(1, 2))
    assert torch.equal(w13[:, i:], gate_up[..., 1::2].transpose(1, 2))
    bias = torch.randn(e, 2 * i)
    assert torch.equal(deinterleave_gate_up(bias, dim=1), torch.cat([bias[:, 0::2], bias[:, 1::2]], dim=1))


@pytest.mark.parametrize("scoring", ["softmax", "sigmoid"])
@pytest.mark.parametrize("renormalize", [False, True])
def test_select_experts(scoring, renormalize):
    logits = torch.randn(5, 8, generator=torch.Generator().manual_seed(0))
    weights, ids = select_experts(logits, 3, renormalize, scoring)
    scores = logits.softmax(-1) if scoring == "softmax" else logits.sigmoid()
    want_w, want_ids = scores.topk(3, dim=-1)
    if renormalize:
        want_w = want_w / want_w.sum(-1, keepdim=True)
        torch.testing.assert_close(weights.sum(-1), torch.ones(5))
    assert torch.equal(ids, want_ids)
    torch.testing.assert_close(weights, want_w)


@pytest.mark.parametrize("rank", [0, 1])
def test_expert_loaders_shard_the_intermediate_dim(rank):
    """At TP=2 each rank keeps its half of every expert's gate, up (w13 rows) and down (w2
    columns), from per-expert checkpoint tensors and from the whole stacked tensor (dummy
    weights) alike."""
    from torch import nn

    from workers.models.moe import _w2_loader, _w13_loader
    e, h, i, half = 3, 4, 6, 3
    g = torch.Generator().manual_seed(1)
    gate, up, down = torch.randn(e, i, h, generator=g), torch.randn(e, i, h, generator=g), torch.randn(e, h, i, generator=g)
    rows = slice(rank * half, (rank + 1) * half)
    want13 = torch.cat([gate[:, rows], up[:, rows]], dim=1)
    want2 = down[:, :, rows]
    whole13, whole2 = nn.Parameter(torch.zeros(e, 2 * half, h)), nn.Parameter(torch.zeros(e, h, half))
    _w13_loader(e, half, rank, 2, whole13, torch.cat([gate, up], dim=1))
    _w2_loader(e, half, rank, 2, whole2, down)
    parts13, parts2 = nn.Parameter(torch.zeros(e, 2 * half, h)), nn.Parameter(torch.zeros(e, h, half))
    for x in range(e):
        _w13_loader(e, half, rank, 2, parts13, gate[x], (x, 0))
        _w13_loader(e, half, rank, 2, parts13, up[x], (x, 1))
        _w2_loader(e, half, rank, 2, parts2, down[x], x)
    for got in (whole13, parts13):
        assert torch.equal(got.data, want13)
    for got in (whole2, parts2):
        assert torch.equal(got.data, want2)


def test_swigluoai_matches_transformers_gpt_oss_experts():
    """HF's GptOssExperts on its interleaved checkpoint layout equals fused_moe_ref on the
    de-interleaved w13 (the layout gpt-oss's loader builds), biases included."""
    from transformers import GptOssConfig
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssExperts
    e, k, h, i, t = 4, 2, 8, 6, 5
    cfg = GptOssConfig(hidden_size=h, intermediate_size=i, num_local_experts=e, num_experts_per_tok=k)
    experts = GptOssExperts(cfg)
    g = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for p in experts.parameters():
            p.copy_(2 * torch.randn(p.shape, generator=g))
    hidden = torch.randn(t, h, generator=g)
    weights, ids = select_experts(torch.randn(t, e, generator=g), k, renormalize=True)
    with torch.no_grad():
        want = experts(hidden, ids, weights)
    w13 = deinterleave_gate_up(experts.gate_up_proj.data, dim=2).transpose(1, 2)
    got = fused_moe_ref(hidden, w13, experts.down_proj.data.transpose(1, 2), weights, ids,
                        w13_bias=deinterleave_gate_up(experts.gate_up_proj_bias.data, dim=1),
                        w2_bias=experts.down_proj_bias.data, activation="swigluoai")
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-4)
