"""The Qwen2-Audio-7B audio encoder (32 layers, d_model 1280, 128 mel bins, 3000 frames = 30 s;
random weights, bf16) on the GPU: Loom's (workers/models/qwen2_audio.py) against HF
transformers' Qwen2AudioEncoder on the same weights, clips per second at a batch of clips of
10-30 s (the padded 30 s window is always encoded), and their outputs' agreement.

    python3 -m bench.audio_encoder [--batch 16] [--iters 5]"""
from __future__ import annotations

import argparse
import time

import torch


def _sync(dev: str) -> None:
    if dev.startswith("cuda"):
        torch.cuda.synchronize()


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--iters", type=int, default=5)
    p.add_argument("--device", default="cuda")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--tiny", action="store_true", help="a 2-layer, 64-wide encoder (a CPU check of this script)")
    args = p.parse_args()
    from transformers import Qwen2AudioEncoderConfig
    from transformers.models.qwen2_audio.modeling_qwen2_audio import Qwen2AudioEncoder
    from workers.models.qwen2_audio import AudioEncoder
    cfg = Qwen2AudioEncoderConfig()   # the 7B model's defaults
    if args.tiny:
        cfg = Qwen2AudioEncoderConfig(encoder_layers=2, d_model=64, encoder_attention_heads=4, encoder_ffn_dim=128)
    torch.manual_seed(0)
    dev, dtype = args.device, getattr(torch, args.dtype)
    hf = Qwen2AudioEncoder(cfg).to(dev, dtype).eval()
    ours = AudioEncoder(cfg).to(dev, dtype).eval()
    missing = ours.load_state_dict({k: v for k, v in hf.state_dict().items()}, strict=False)
    assert not missing.missing_keys, missing
    frames = torch.randint(1000, 3001, (args.batch,), device=dev)   # 10-30 s of real frames
    feats = torch.randn(args.batch, cfg.num_mel_bins, 3000, device=dev, dtype=dtype)
    valid = torch.arange(1500, device=dev)[None] < ((frames - 1) // 2 + 1)[:, None]
    hf_mask = torch.zeros(args.batch, 1, 1500, 1500, device=dev, dtype=dtype).masked_fill(
        ~valid[:, None, None, :], torch.finfo(dtype).min)

    def timed(fn) -> tuple[float, torch.Tensor]:
        with torch.no_grad():
            out = fn()
            _sync(dev)
            t0 = time.perf_counter()
            for _ in range(args.iters):
                out = fn()
            _sync(dev)
        return (time.perf_counter() - t0) / args.iters, out
    t_ours, a = timed(lambda: ours(feats, frames))
    t_hf, b = timed(lambda: hf(feats, attention_mask=hf_mask).last_hidden_state)
    n = (frames.min().item() - 1) // 2 + 1
    err = (a[:, : n // 2].float() - b[:, : n // 2].float()).abs().max().item()
    name = 'tiny' if args.tiny else 'Qwen2-Audio-7B'
    print(f"{f'{name} encoder, {args.dtype}, batch {args.batch}':<44} {'loom':>10} {'HF':>10}")
    print(f"{'ms per batch':<44} {t_ours * 1e3:>10.1f} {t_hf * 1e3:>10.1f}")
    print(f"{'clips per s (target: >= HF)':<44} {args.batch / t_ours:>10.1f} {args.batch / t_hf:>10.1f}")
    print(f"{'max |loom - HF| on real frames':<44} {err:>10.3g}")


if __name__ == "__main__":
    main()
