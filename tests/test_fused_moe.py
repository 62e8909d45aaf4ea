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


# ----------------------------------------------------------------------------- Triton kernel
# Under TRITON_INTERPRET=1 (tests/conftest.py sets it on CPU) the kernels run on CPU tensors;
# small shapes and 16-row blocks keep these to a few seconds.
from kernels import fused_moe as fm  # noqa: E402
from kernels.jit import is_interpreted  # noqa: E402

needs_triton = pytest.mark.skipif(not (torch.cuda.is_available() or is_interpreted(fm._fused_moe_gemm_kernel)),
                                  reason="Triton runs neither on a GPU nor in the interpreter here")
DEV = "cuda" if torch.cuda.is_available() else "cpu"
SMALL = fm.MoeTileConfig(BLOCK_SIZE_M=16, BLOCK_SIZE_N=32, BLOCK_SIZE_K=16, GROUP_SIZE_M=2, num_warps=4, num_stages=2)


def check_alignment(topk_ids, block_m, num_experts, sorted_ids, expert_ids, num_post):
    """Every pair once, in its expert's run (stable order), runs padded to whole blocks."""
    flat = topk_ids.reshape(-1).cpu()
    numel, sorted_ids, expert_ids = flat.numel(), sorted_ids.cpu(), expert_ids.cpu()
    assert sorted_ids.numel() == fm.max_num_tokens_padded(numel, num_experts, block_m)
    total = int(num_post)
    assert total % block_m == 0 and (sorted_ids[total:] == numel).all()
    real = sorted_ids[sorted_ids < numel]
    assert sorted(real.tolist()) == list(range(numel))
    blocks = sorted_ids[:total].view(-1, block_m)
    for b, row in enumerate(blocks):
        pairs = row[row < numel]
        want = flat[pairs.long()]
        want = torch.where(want < 0, -1, want)
        assert (want == expert_ids[b]).all()
        assert torch.equal(pairs, pairs.sort().values)
    assert (expert_ids[total // block_m:] == -1).all()


@needs_triton
@pytest.mark.parametrize("t", [0, 1, 3, 40, 90])
@pytest.mark.parametrize("block_m", [16, 4])
def test_moe_align_block_size(t, block_m):
    """The Triton kernels (one program up to ALIGN_MAX_PAIRS_ONE_PROGRAM pairs: 40 x 3; three
    launches over 64-pair chunks above: 90 x 3) equal the torch reference exactly (a stable
    sort), with ids of -1 (another rank's experts) in their own bucket."""
    e, k = 6, 3
    g = torch.Generator().manual_seed(t * 7 + block_m)
    ids = torch.stack([torch.randperm(e + 1, generator=g)[:k] - 1 for _ in range(t)]) if t else torch.zeros(0, k)
    ids = ids.to(torch.int64).to(DEV)
    assert (t * k > fm.ALIGN_MAX_PAIRS_ONE_PROGRAM) == (t == 90)
    got = fm.moe_align_block_size(ids, block_m, e)
    check_alignment(ids, block_m, e, *got)
    want = fm.moe_align_block_size_ref(ids, block_m, e)
    for a, b in zip(got, want):
        assert torch.equal(a, b)


ROUTINGS = [(0, "random"), (1, "random"), (1, "one_expert"), (13, "random"), (21, "one_expert"),
            (21, "skip_expert"), (40, "skip_expert")]


@needs_triton
@pytest.mark.parametrize("t,routing", ROUTINGS)
def test_fused_moe_triton_matches_reference(t, routing):
    """fp32 (the kernel's dot in IEEE precision) over random routings and token counts: 0, 1,
    an expert with no token, every token on one expert."""
    hidden, w13, w2, _, _, weights, ids = moe_problem(t, 6, 2, 32, 16, seed=t, routing=routing, scale=0.25)
    args = [x.to(DEV) for x in (hidden, w13, w2, weights, ids)]
    got = fm.fused_moe(*args, config=SMALL)
    assert got.shape == (t, 32)
    torch.testing.assert_close(got.cpu(), fused_moe_ref(*args).cpu(), rtol=1e-4, atol=1e-4)


@needs_triton
@pytest.mark.parametrize("activation", ["silu", "swigluoai"])
def test_fused_moe_triton_biases_activation_and_other_ranks(activation, monkeypatch):
    """Biases, gpt-oss's activation, a K that the tile does not divide (H 40, I 24), ids of -1
    (adding nothing), and the chunked alignment kernels that large batches take."""
    hidden, w13, w2, b13, b2, weights, ids = moe_problem(9, 5, 3, 40, 24, seed=11, bias=True, scale=0.5)
    ids[::3, 1] = -1
    args = [x.to(DEV) for x in (hidden, w13, w2, weights, ids)]
    kw = dict(w13_bias=b13.to(DEV), w2_bias=b2.to(DEV), activation=activation)
    want = fused_moe_ref(*args, **kw).cpu()
    torch.testing.assert_close(fm.fused_moe(*args, **kw, config=SMALL).cpu(), want, rtol=1e-4, atol=1e-4)
    monkeypatch.setattr(fm, "ALIGN_MAX_PAIRS_ONE_PROGRAM", 0)
    torch.testing.assert_close(fm.fused_moe(*args, **kw, config=SMALL).cpu(), want, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(fused_moe_dense_ref(*args, **kw).cpu(), want, rtol=1e-4, atol=1e-4)


def test_tuned_configs_load_by_nearest_token_count(tmp_path, monkeypatch):
    """A tuned file (vLLM's key and JSON) is read by the nearest token count; an untuned shape
    gets the decode default for a few tokens per expert and the prefill default above."""
    import json
    cfgs = {"1": SMALL.to_json(), "64": fm.PREFILL_CONFIG.to_json()}
    name = fm.config_file_name(8, 32, torch.bfloat16, "NVIDIA_H200")
    assert name == "E=8,N=32,device_name=NVIDIA_H200,dtype=bf16.json"
    (tmp_path / name).write_text(json.dumps(cfgs))
    monkeypatch.setattr(fm, "CONFIG_DIR", tmp_path)
    fm.load_configs.cache_clear()
    try:
        tuned = fm.load_configs(name)
        assert fm.nearest_config(tuned, 1) == SMALL and fm.nearest_config(tuned, 30) == SMALL
        assert fm.nearest_config(tuned, 40) == fm.PREFILL_CONFIG and fm.nearest_config(tuned, 9000) == fm.PREFILL_CONFIG
        assert fm.load_configs("E=9,N=32,device_name=NVIDIA_H200,dtype=bf16.json") is None
    finally:
        fm.load_configs.cache_clear()
    assert fm.default_config(1, 128, 8) == fm.DECODE_CONFIG
    assert fm.default_config(8192, 128, 8) == fm.PREFILL_CONFIG


def test_shipped_configs_parse():
    """Every shipped tuned file names its shape and holds valid configs."""
    for path in fm.CONFIG_DIR.glob("*.json"):
        assert path.name.startswith("E=") and ",device_name=" in path.name and ",dtype=" in path.name
        for cfg in fm.load_configs(path.name).values():
            assert cfg.BLOCK_SIZE_M in (16, 32, 64, 128, 256) and cfg.BLOCK_SIZE_N >= 32


def test_tuner_search_space_is_pruned_and_fits():
    """bench/tune_moe.py's candidates: ~40 at most per token count, each within shared memory,
    the default among them; 16-row blocks for a few tokens per expert, 64+ for many."""
    from bench.tune_moe import BATCH_SIZES, MODEL_SHAPES, SMEM_BYTES, search_space
    for shape in MODEL_SHAPES.values():
        for m in BATCH_SIZES:
            space = search_space(m, shape)
            assert 8 <= len(space) <= 45 and len(set(space)) == len(space)
            assert fm.default_config(m, shape.num_experts, shape.top_k) in space
            assert all((c.BLOCK_SIZE_M + c.BLOCK_SIZE_N) * c.BLOCK_SIZE_K * 2 * c.num_stages <= SMEM_BYTES
                       for c in space)
    q = MODEL_SHAPES["qwen3-30b-a3b"]
    assert {c.BLOCK_SIZE_M for c in search_space(1, q)} <= {16, 32}
    assert min(c.BLOCK_SIZE_M for c in search_space(8192, q)) >= 64   # prefill: no 16-row blocks


@needs_triton
@pytest.mark.parametrize("scoring", ["softmax", "sigmoid"])
@pytest.mark.parametrize("renormalize", [False, True])
def test_fused_topk_matches_select_experts(scoring, renormalize):
    """The one-kernel routing picks the reference's experts in its order, with its weights,
    for a power-of-two and an odd expert count (and no tokens)."""
    for t, e, k in ((5, 8, 2), (9, 60, 4), (0, 8, 2)):
        logits = torch.randn(t, e, generator=torch.Generator().manual_seed(e)).to(DEV)
        want_w, want_ids = select_experts(logits, k, renormalize, scoring)
        w, ids = fm.fused_topk(logits, k, renormalize, scoring)
        assert ids.dtype == want_ids.dtype and torch.equal(ids.cpu(), want_ids.cpu())
        torch.testing.assert_close(w.cpu(), want_w.cpu(), rtol=1e-5, atol=1e-6)


GEMV_TILES = fm.MoeGemvConfig(UP_BLOCK_N=4, UP_BLOCK_K=16, DOWN_BLOCK_N=8, DOWN_BLOCK_K=8, num_warps=1)


@needs_triton
@pytest.mark.parametrize("t", [0, 1, 2, 3, 4])
@pytest.mark.parametrize("routing", ["random", "one_expert", "same_experts"])
def test_fused_moe_gemv_matches_reference(t, routing):
    """The small-batch GEMV path equals the reference at 0-4 tokens over random routings, every
    token's top choice on one expert, and every token choosing the same experts (each expert's
    rows read once per pair); K loops of several tiles with a ragged last one (H 40 / 16, I 24 / 8)."""
    hidden, w13, w2, _, _, weights, ids = moe_problem(t, 6, 3, 40, 24, seed=100 + t, scale=0.25,
                                                      routing="one_expert" if routing == "one_expert" else "random")
    if routing == "same_experts":
        ids[:] = torch.tensor([4, 0, 2])
    args = [x.to(DEV) for x in (hidden, w13, w2, weights, ids)]
    got = fm.fused_moe_gemv(*args, config=GEMV_TILES)
    assert got.shape == (t, 40)
    torch.testing.assert_close(got.cpu(), fused_moe_ref(*args).cpu(), rtol=1e-4, atol=1e-4)


@needs_triton
@pytest.mark.parametrize("activation", ["silu", "swigluoai"])
@pytest.mark.parametrize("shard", ["tp2", "ep2"])
def test_fused_moe_gemv_biases_and_shards(activation, shard):
    """Biases and gpt-oss's activation on a TP shard's shapes (half the intermediate: I 12, an N
    the up tile does not divide) and an EP shard's (ids of -1 for the other rank's experts)."""
    inter = 12 if shard == "tp2" else 24
    hidden, w13, w2, b13, b2, weights, ids = moe_problem(3, 5, 3, 40, inter, seed=7, bias=True, scale=0.5)
    if shard == "ep2":
        ids[ids >= 3] = -1
    args = [x.to(DEV) for x in (hidden, w13, w2, weights, ids)]
    kw = dict(w13_bias=b13.to(DEV), w2_bias=b2.to(DEV), activation=activation)
    tiles = fm.MoeGemvConfig(UP_BLOCK_N=8, UP_BLOCK_K=16, DOWN_BLOCK_N=16, DOWN_BLOCK_K=8, num_warps=1)
    torch.testing.assert_close(fm.fused_moe_gemv(*args, **kw, config=tiles).cpu(), fused_moe_ref(*args, **kw).cpu(),
                               rtol=1e-4, atol=1e-4)


@needs_triton
def test_fused_moe_dispatches_on_token_count():
    """fused_moe takes the GEMV path up to gemv_max_tokens() tokens (default tiles, K in one
    tile) and the grouped GEMMs above; both equal the reference; 0 turns the GEMV path off."""
    calls = []
    real = fm.fused_moe_gemv

    def spy(*a, **kw):
        calls.append(a[0].shape[0])
        return real(*a, **kw)

    before = fm.set_gemv_max_tokens(4)
    try:
        fm.fused_moe_gemv = spy
        for t in (1, 4, 5):
            hidden, w13, w2, _, _, weights, ids = moe_problem(t, 6, 2, 32, 16, seed=t, scale=0.25)
            args = [x.to(DEV) for x in (hidden, w13, w2, weights, ids)]
            torch.testing.assert_close(fm.fused_moe(*args).cpu(), fused_moe_ref(*args).cpu(), rtol=1e-4, atol=1e-4)
        assert calls == [1, 4]
        fm.set_gemv_max_tokens(0)
        hidden, w13, w2, _, _, weights, ids = moe_problem(1, 6, 2, 32, 16, seed=1, scale=0.25)
        args = [x.to(DEV) for x in (hidden, w13, w2, weights, ids)]
        torch.testing.assert_close(fm.fused_moe(*args).cpu(), fused_moe_ref(*args).cpu(), rtol=1e-4, atol=1e-4)
        assert calls == [1, 4]
    finally:
        fm.fused_moe_gemv = real
        fm.set_gemv_max_tokens(before)


def test_gemv_tiles_parse_and_fit():
    """LOOM_MOE_GEMV_TILES's five powers of two; the down K tile widens as top-k narrows (the
    same bytes per step) and no tile outgrows the K it walks."""
    cfg = fm.MoeGemvConfig.parse("2,2048,2,256,4")
    assert cfg == fm.MoeGemvConfig()
    assert cfg.fitted(2048, 768, 8) == cfg
    assert cfg.fitted(4096, 14336, 2) == fm.MoeGemvConfig(2, 2048, 2, 1024, 4)   # Mixtral
    assert cfg.fitted(40, 24, 3) == fm.MoeGemvConfig(2, 64, 2, 32, 4)
    for bad in ("4,2048,4,256", "4,2048,4,255,8", "0,2048,4,256,8", "a,b,c,d,e"):
        with pytest.raises(ValueError):
            fm.MoeGemvConfig.parse(bad)
