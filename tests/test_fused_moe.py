"""kernels/fused_moe.py's torch reference against a per-token loop over the chosen experts,
and the routing against HF's (softmax / sigmoid, with and without renormalisation)."""
import pytest
import torch
import torch.nn.functional as F

from kernels.fused_moe import fused_moe_ref, select_experts


def naive_moe(hidden, w13, w2, weights, ids):
    out = torch.zeros_like(hidden)
    for t in range(hidden.shape[0]):
        for j in range(ids.shape[1]):
            e = int(ids[t, j])
            gate, up = (w13[e] @ hidden[t]).chunk(2)
            out[t] += weights[t, j] * (w2[e] @ (F.silu(gate) * up))
    return out


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
    torch.testing.assert_close(got, naive_moe(hidden, w13, w2, weights, ids), rtol=1e-5, atol=1e-5)


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
