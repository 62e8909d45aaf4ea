"""kernels/fused_moe.py's torch reference against a per-token loop over the chosen experts,
and the routing against HF's (softmax / sigmoid, with and without renormalisation)."""
import pytest
import torch
import torch.nn.functional as F

from kernels.fused_moe import fused_moe_dense_ref, fused_moe_ref, select_experts


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
    want = naive_moe(hidden, w13, w2, weights, ids)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    # the sync-free path that CUDA-graph capture runs
    torch.testing.assert_close(fused_moe_dense_ref(hidden, w13, w2, weights, ids), want, rtol=1e-5, atol=1e-5)


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

    from workers.models.moe import ExpertPlacement, _w2_loader, _w13_loader
    e, h, i, half = 3, 4, 6, 3
    every = ExpertPlacement.of_rank(e, 0, 1)
    g = torch.Generator().manual_seed(1)
    gate, up, down = torch.randn(e, i, h, generator=g), torch.randn(e, i, h, generator=g), torch.randn(e, h, i, generator=g)
    rows = slice(rank * half, (rank + 1) * half)
    want13 = torch.cat([gate[:, rows], up[:, rows]], dim=1)
    want2 = down[:, :, rows]
    whole13, whole2 = nn.Parameter(torch.zeros(e, 2 * half, h)), nn.Parameter(torch.zeros(e, h, half))
    _w13_loader(every, half, rank, 2, whole13, torch.cat([gate, up], dim=1))
    _w2_loader(every, half, rank, 2, whole2, down)
    parts13, parts2 = nn.Parameter(torch.zeros(e, 2 * half, h)), nn.Parameter(torch.zeros(e, h, half))
    for x in range(e):
        _w13_loader(every, half, rank, 2, parts13, gate[x], (x, 0))
        _w13_loader(every, half, rank, 2, parts13, up[x], (x, 1))
        _w2_loader(every, half, rank, 2, parts2, down[x], x)
    for got in (whole13, parts13):
        assert torch.equal(got.data, want13)
    for got in (whole2, parts2):
        assert torch.equal(got.data, want2)


@pytest.mark.parametrize("num_experts,ranks,want", [(8, 2, [(0, 4), (4, 4)]), (5, 2, [(0, 3), (3, 2)]),
                                                    (7, 4, [(0, 2), (2, 2), (4, 2), (6, 1)]), (4, 1, [(0, 4)])])
def test_expert_placement(num_experts, ranks, want):
    """vLLM's linear placement: contiguous blocks, the first E % N ranks one expert more."""
    from workers.models.moe import ExpertPlacement
    got = [ExpertPlacement.of_rank(num_experts, r, ranks) for r in range(ranks)]
    assert [(p.first, p.count) for p in got] == want
    for e in range(num_experts):   # every expert on exactly one rank, at its place in the block
        assert sum(p.local(e) is not None for p in got) == 1
    p = got[-1]
    assert p.expert_map().tolist() == [e - p.first if p.local(e) is not None else -1 for e in range(num_experts)]


@pytest.mark.parametrize("rank", [0, 1])
def test_expert_parallel_loaders_keep_the_ranks_experts(rank):
    """Under expert parallelism a rank keeps its experts whole, from per-expert tensors and from the
    stacked tensor alike; another rank's expert tensors are shape-checked but not copied."""
    from torch import nn

    from workers.models.moe import ExpertPlacement, _w2_loader, _w13_loader
    e, h, i = 5, 4, 6
    mine = ExpertPlacement.of_rank(e, rank, 2)
    g = torch.Generator().manual_seed(2)
    gate, up, down = torch.randn(e, i, h, generator=g), torch.randn(e, i, h, generator=g), torch.randn(e, h, i, generator=g)
    held = slice(mine.first, mine.first + mine.count)
    want13, want2 = torch.cat([gate, up], dim=1)[held], down[held]
    whole13, whole2 = nn.Parameter(torch.zeros(mine.count, 2 * i, h)), nn.Parameter(torch.zeros(mine.count, h, i))
    _w13_loader(mine, i, 0, 1, whole13, torch.cat([gate, up], dim=1))
    _w2_loader(mine, i, 0, 1, whole2, down)
    parts13, parts2 = nn.Parameter(torch.zeros(mine.count, 2 * i, h)), nn.Parameter(torch.zeros(mine.count, h, i))
    for x in range(e):
        _w13_loader(mine, i, 0, 1, parts13, gate[x], (x, 0))
        _w13_loader(mine, i, 0, 1, parts13, up[x], (x, 1))
        _w2_loader(mine, i, 0, 1, parts2, down[x], x)
    for got in (whole13, parts13):
        assert torch.equal(got.data, want13)
    for got in (whole2, parts2):
        assert torch.equal(got.data, want2)
    with pytest.raises(ValueError, match="checkpoint shape"):   # a wrong shape fails on every rank
        _w13_loader(mine, i, 0, 1, parts13, gate[0][:, :2], (4 if rank == 0 else 0, 0))


@pytest.mark.parametrize("t", [0, 1, 9])
def test_other_ranks_experts_contribute_nothing(t):
    """Expert parallelism: ids of -1 (an expert on another rank) are skipped, so the ranks' sums
    over their own experts add up to the whole routed sum; the dense reference agrees."""
    from workers.models.moe import ExpertPlacement
    e, k, h, i = 5, 2, 8, 6
    g = torch.Generator().manual_seed(t)
    hidden = torch.randn(t, h, generator=g)
    w13, w2 = torch.randn(e, 2 * i, h, generator=g), torch.randn(e, h, i, generator=g)
    weights, ids = select_experts(torch.randn(t, e, generator=g), k, renormalize=True)
    total = torch.zeros(t, h)
    for rank in range(2):
        p = ExpertPlacement.of_rank(e, rank, 2)
        local = p.expert_map()[ids]
        held = slice(p.first, p.first + p.count)
        part = fused_moe_ref(hidden, w13[held], w2[held], weights, local)
        torch.testing.assert_close(fused_moe_dense_ref(hidden, w13[held], w2[held], weights, local), part,
                                   rtol=1e-5, atol=1e-5)
        total += part
    torch.testing.assert_close(total, naive_moe(hidden, w13, w2, weights, ids), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("rank,size,expert_parallel,experts", [(0, 1, False, (0, 5)), (1, 2, False, (0, 5)),
                                                               (1, 2, True, (3, 5)), (0, 3, True, (0, 2))])
def test_expert_bias_loaders_follow_the_placement(rank, size, expert_parallel, experts, monkeypatch):
    """FusedMoE.add_biases (gpt-oss): under TP each rank keeps its intermediate half of every
    expert's gate/up bias and the whole down bias; under EP its experts' whole biases."""
    from workers import distributed
    from workers.models.moe import FusedMoE
    monkeypatch.setattr(distributed, "_state", distributed.TPState(rank=rank, size=size,
                                                                   expert_parallel=expert_parallel))
    e, h, i = 5, 4, 6
    moe = FusedMoE(e, 2, h, i, renormalize=True)
    moe.add_biases()
    g = torch.Generator().manual_seed(3)
    b13, b2 = torch.randn(e, 2 * i, generator=g), torch.randn(e, h, generator=g)
    moe.w13_bias.weight_loader(moe.w13_bias, b13)
    moe.w2_bias.weight_loader(moe.w2_bias, b2)
    held = slice(*experts)
    i_rank, part = (0, i) if expert_parallel else (rank, i // size)
    cols = [c for j in (0, 1) for c in range(j * i + i_rank * part, j * i + (i_rank + 1) * part)]
    assert torch.equal(moe.w13_bias.data, b13[held][:, cols])
    assert torch.equal(moe.w2_bias.data, b2[held])
    assert moe.w13_weight.shape == (experts[1] - experts[0], 2 * part, h)
