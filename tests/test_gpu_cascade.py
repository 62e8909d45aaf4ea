"""GPU-only checks of cascade (prefix-aware) attention (issue 49 item 2): the kernel exact to
plain paged attention in fp32 at Qwen3-0.6B's heads (compiled, not interpreted), captured in a
CUDA graph as the decode graphs hold it (its per-step inputs, the prefix's length included, are
device tensors), and whole engines under CUDA graphs (cascade decode graphs) giving the same fp32
greedy tokens with cascade on and off, and on without graphs, for many requests sharing a long
prefix.

    python3 -m pytest -q -p no:cacheprovider tests/test_gpu_cascade.py
"""
from __future__ import annotations

import numpy as np
import pytest
import torch

from kernels import cascade_attention as ca
from kernels import paged_attention as pa
from tests.test_cascade_attention import greedy_with_cascade

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]
HQ, HKV, D, BS = 16, 8, 128, 16   # Qwen3-0.6B


def _batch(prefix_len: int, own: list[int], q_lens: list[int], dtype: torch.dtype, seed: int = 0):
    """Sequences whose first prefix_len keys lie in the same (shuffled) blocks, then own keys."""
    g = torch.Generator().manual_seed(seed)
    n_blocks = [-(-(prefix_len + o) // BS) for o in own]
    shared_n = prefix_len // BS
    total = shared_n + sum(n - shared_n for n in n_blocks) + 1
    perm = torch.randperm(total, generator=g).tolist()
    shared, rest = perm[:shared_n], perm[shared_n:]
    bt = torch.zeros((len(own), max(n_blocks)), dtype=torch.int32)
    for i, n in enumerate(n_blocks):
        mine, rest = rest[:n - shared_n], rest[n - shared_n:]
        bt[i, :n] = torch.tensor(shared + mine, dtype=torch.int32)
    kc = torch.randn(total, BS, HKV, D, generator=g).to(dtype)
    vc = torch.randn(total, BS, HKV, D, generator=g).to(dtype)
    sl = torch.tensor([prefix_len + o for o in own], dtype=torch.int32)
    qsl = torch.tensor([0] + np.cumsum(q_lens).tolist(), dtype=torch.int32)
    q = torch.randn(int(qsl[-1]), HQ, D, generator=g).to(dtype)
    return [x.cuda() for x in (q, kc, vc, qsl, sl, bt)]


def _prefix(prefix_len: int, num_tokens: int, num_seqs: int, max_q: int, max_seq: int, bt: torch.Tensor,
            prefix_splits: int | None = None) -> ca.CascadePrefix:
    dev = bt.device
    splits = prefix_splits or ca.choose_prefix_splits(num_tokens, HQ // HKV, HKV, prefix_len, dev)
    return ca.CascadePrefix(torch.tensor([0, num_tokens], dtype=torch.int32, device=dev),
                            torch.tensor([prefix_len], dtype=torch.int32, device=dev), bt[:1, :prefix_len // BS],
                            splits, ca.choose_suffix_splits(num_seqs, HKV, max_q, max_seq - prefix_len, dev))


@pytest.mark.parametrize("prefix_splits", [1, 4, None])
def test_cascade_decodes_exact_to_paged_attention_fp32(prefix_splits):
    # 64 decodes over a 1,024-key shared prefix and 1-200 keys of their own
    own = [1 + (37 * i) % 200 for i in range(64)]
    q, kc, vc, qsl, sl, bt = _batch(1024, own, [1] * 64, torch.float32)
    order = torch.argsort(-sl.long(), stable=True).to(torch.int32)
    want = pa.paged_attention(q, kc, vc, qsl, sl, bt, D ** -0.5, 1, int(sl.max()), num_decodes=64, seq_order=order)
    got = ca.cascade_attention(q, kc, vc, qsl, sl, bt, D ** -0.5, 1, _prefix(1024, 64, 64, 1, int(sl.max()), bt,
                                                                            prefix_splits),
                               num_decodes=64, seq_order=order)
    torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-5)
    ref = pa.paged_attention_ref(q, kc, vc, qsl, sl, bt, D ** -0.5)
    torch.testing.assert_close(got, ref, atol=2e-5, rtol=1e-5)


def test_cascade_mixed_batch_exact_fp32_and_bf16_close():
    # decodes then prompt chunks over a 512-key prefix (two suffix launches)
    own, q_lens = [3, 40, 7, 90, 130, 64], [1, 1, 1, 1, 50, 64]
    for dtype, tol in ((torch.float32, 2e-5), (torch.bfloat16, 3e-2)):
        q, kc, vc, qsl, sl, bt = _batch(512, own, q_lens, dtype, seed=1)
        want = pa.paged_attention_ref(q, kc, vc, qsl, sl, bt, D ** -0.5).float()
        got = ca.cascade_attention(q, kc, vc, qsl, sl, bt, D ** -0.5, 64,
                                   _prefix(512, q.shape[0], 6, 64, int(sl.max()), bt), num_decodes=4).float()
        assert (got - want).abs().max().item() < tol, dtype


@pytest.mark.parametrize("prefix_beside", [False, True])
def test_cascade_captures_in_a_cuda_graph(prefix_beside):
    # no host sync in the launches: captured once as a decode graph holds it (the length a device
    # tensor, the blocks row 0 of the whole table), replayed over new queries, new own keys and
    # other prefix lengths; also with the prefix launch on a side stream (a branch of the graph)
    own = [5 + 3 * i for i in range(32)]
    q, kc, vc, qsl, sl, bt = _batch(512, own, [1] * 32, torch.float32, seed=2)
    length = torch.tensor([512], dtype=torch.int32, device="cuda")
    prefix = ca.CascadePrefix(torch.tensor([0, 32], dtype=torch.int32, device="cuda"), length, bt[:1], 4, 1,
                              beside=prefix_beside)
    out = torch.empty_like(q)
    run = lambda: ca.cascade_attention(q, kc, vc, qsl, sl, bt, D ** -0.5, 1, prefix, num_decodes=32,  # noqa: E731
                                       out=out)
    run()   # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        run()
    q.copy_(torch.randn_like(q))
    sl.sub_(torch.arange(32, device="cuda", dtype=torch.int32) % 4)   # shorter own parts, same prefix
    for prefix_len in (512, 256, 16):   # (whole blocks every sequence shares)
        length.fill_(prefix_len)
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        torch.testing.assert_close(out, pa.paged_attention_ref(q, kc, vc, qsl, sl, bt, D ** -0.5), atol=2e-5,
                                   rtol=1e-5)


def test_engine_fp32_greedy_equal_cascade_on_and_off_under_graphs(model_factory, monkeypatch):
    # 48 requests: a 640-token shared prefix and 5-60 tokens of their own, 24 greedy tokens each;
    # CUDA graphs on: the decode steps replay the size-64 decode graph captured with cascade (its
    # staged prefix length 640), the prompt steps the piecewise graphs with eager cascade between
    # them. The same tokens as cascade off, and as cascade on without graphs (enforce_eager)
    from workers.decode_graphs import DecodeGraphs
    staged = []   # the prefix length each cascade-graph replay reads
    run_model = DecodeGraphs.run_model

    def recording(self, bs, rows, cascade=False):
        if cascade:
            staged.append(int(self._dev_views[bs]["prefix_len"][0]))
        return run_model(self, bs, rows, cascade)
    monkeypatch.setattr(DecodeGraphs, "run_model", recording)
    model_dir = model_factory("qwen3", max_position_embeddings=1024)
    rng = np.random.default_rng(7)
    shared = rng.integers(3, 300, 640).tolist()
    prompts = [shared + rng.integers(3, 300, 5 + (i * 11) % 56).tolist() for i in range(48)]
    options = dict(dtype="float32", max_model_len=1024, max_num_seqs=64, enable_prefix_caching=True,
                   num_gpu_blocks_override=4096)
    off, n_off = greedy_with_cascade(model_dir, prompts, "0", monkeypatch, 24, **options)
    assert not staged
    on, n_on = greedy_with_cascade(model_dir, prompts, "force", monkeypatch, 24, **options)
    assert n_off == 0 and n_on > 0, (n_off, n_on)
    assert len(staged) >= 20 and set(staged) == {640}, staged
    eager, _ = greedy_with_cascade(model_dir, prompts, "force", monkeypatch, 24, enforce_eager=True, **options)
    assert on == off
    assert eager == on
