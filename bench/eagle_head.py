"""EAGLE-3 head cost vs a target decode step (issue 47: <= 6% of a target step per draft token).

    python -m bench.eagle_head [--context 1024] [--k 4] [--modes graph eager] [--output-json PATH]

Llama-3.1-8B shape, bf16, dummy weights, batch 1, at `--context` tokens: one target decode step
and the EAGLE-3-shaped head (one layer over [embed; h] of 2H, fc [H, 3H] fusing three auxiliary
streams, its own lm_head over a 32,000-token draft vocabulary mapped by d2t), as the runner runs
them (workers/spec_decode/eagle.py): the head's pass over a verify step's k + 1 tokens, and its
one-token draft steps. Each is timed alone with CUDA events, captured in a CUDA graph (`graph`)
and launched op by op (`eager`). Per draft token = (pass over k + 1 tokens + (k - 1) draft steps)
/ k, as a fraction of the target's step; the single draft step's fraction is printed beside it."""
from __future__ import annotations

import argparse
import json
import os
import tempfile

import torch


def _meta(start: int, n: int, block_size: int, device, backend: str):
    from workers.attention import AttentionMetadata
    end = start + n
    blocks = -(-end // block_size)
    return AttentionMetadata(torch.tensor([0, n], dtype=torch.int32, device=device),
                             torch.tensor([end], dtype=torch.int32, device=device),
                             torch.arange(blocks, dtype=torch.int32, device=device)[None],
                             torch.arange(start, end, device=device), max_query_len=n, max_seq_len=end,
                             backend=backend, num_decodes=int(n == 1))


def _time(fn, mode: str, iters: int = 50) -> float:
    """Median ms of fn() (captured in a CUDA graph for `graph`)."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    run = fn
    if mode == "graph":
        g = torch.cuda.CUDAGraph()
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            fn()
            with torch.cuda.graph(g):
                fn()
        torch.cuda.current_stream().wait_stream(s)
        run = g.replay
    times = []
    for _ in range(iters):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        run()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    return sorted(times)[len(times) // 2]


def _head_dir(target_dir: str, out: str) -> str:
    with open(os.path.join(target_dir, "config.json")) as f:
        t = json.load(f)
    cfg = {k: t[k] for k in ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads",
                             "rms_norm_eps", "max_position_embeddings", "vocab_size", "rope_theta", "rope_scaling",
                             "head_dim") if k in t}
    cfg.update(architectures=["LlamaForCausalLM"], model_type="llama", num_hidden_layers=1, draft_vocab_size=32000)
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "config.json"), "w") as f:
        json.dump(cfg, f)
    return out


@torch.inference_mode()
def measure(context: int, k: int, modes: list[str]) -> list[dict]:
    from bench.presets import write_preset
    from workers.model_loader import load_model
    from workers.models.layers import use_kernels
    from workers.models.llama_eagle import load_eagle_head
    from workers.spec_decode.eagle import AuxHiddenStates
    dev, dtype, bs = torch.device("cuda"), torch.bfloat16, 16
    use_kernels("triton")
    with tempfile.TemporaryDirectory() as tmp:
        tdir = write_preset("llama-3.1-8b", os.path.join(tmp, "llama"))
        target = load_model(tdir, dtype, dev, "dummy")
        head = load_eagle_head(_head_dir(tdir, os.path.join(tmp, "head")), "eagle3", target, dtype, dev, "dummy",
                               context + 64)
    cfg = target.config
    layers = target.model.layers
    aux = AuxHiddenStates(layers, (2, len(layers) // 2, len(layers) - 3), 64, cfg.hidden_size, dtype, dev)
    blocks = -(-(context + 64) // bs)
    kv_shape = (blocks, bs, cfg.num_key_value_heads, cfg.head_dim)
    t_kv = [(torch.zeros(kv_shape, dtype=dtype, device=dev), torch.zeros(kv_shape, dtype=dtype, device=dev))
            for _ in layers]
    h_kv = (torch.zeros(kv_shape, dtype=dtype, device=dev), torch.zeros(kv_shape, dtype=dtype, device=dev))
    ids1 = torch.ones(1, dtype=torch.long, device=dev)
    idsk = torch.ones(k + 1, dtype=torch.long, device=dev)
    pos1 = torch.tensor([context], device=dev)
    posk = torch.arange(context, context + k + 1, device=dev)
    m1, mk = _meta(context, 1, bs, dev, "triton"), _meta(context, k + 1, bs, dev, "triton")
    lm_head = target.lm_head
    h1 = torch.zeros(1, cfg.hidden_size, dtype=dtype, device=dev)

    def target_step():
        hidden = target(ids1, pos1, t_kv, m1)
        return lm_head.logits(hidden).argmax(-1)

    def head_pass():   # the head over a verify step's k + 1 tokens (their aux streams fused)
        return head(idsk, posk, head.combine(aux.buffer[:k + 1]), h_kv, mk)

    def draft_step():
        rows, _ = head(ids1, pos1, h1, h_kv, m1)
        return head.draft_tokens(rows)

    out = []
    for mode in modes:
        t = _time(target_step, mode)
        p = _time(head_pass, mode)
        d = _time(draft_step, mode)
        per_token = (p + (k - 1) * d) / k
        out.append({"mode": mode, "target_step_ms": t, "head_pass_ms": p, "draft_step_ms": d,
                    "per_draft_token_frac": per_token / t, "draft_step_frac": d / t})
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--modes", nargs="+", choices=("graph", "eager"), default=["graph", "eager"])
    ap.add_argument("--output-json", default=None)
    args = ap.parse_args()
    rows = measure(args.context, args.k, args.modes)
    print(f"\n{'llama8b b1, EAGLE-3 head (k=' + str(args.k) + ')':<44} {'target ms':>9} {'pass ms':>8} {'step ms':>8} "
          f"{'per draft tok':>13} {'target':>7}  ok")
    for r in rows:
        ok = r["per_draft_token_frac"] <= 0.06
        print(f"{r['mode']:<44} {r['target_step_ms']:>9.3f} {r['head_pass_ms']:>8.3f} {r['draft_step_ms']:>8.3f} "
              f"{100 * r['per_draft_token_frac']:>12.1f}% {'<= 6%':>7}  {'yes' if ok else 'NO'} "
              f"(one draft step {100 * r['draft_step_frac']:.1f}%)")
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
