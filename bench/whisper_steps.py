"""The worker's host time per Whisper step, on this machine's CPU: the engine in-process
(LLM(..., multiprocess=False), LOOM_STEP_STATS=1, LOOM_DECODE_GRAPHS_ON_CPU=1 so that decode
steps take the decode graphs' path uncaptured) over a tiny random Whisper with large-v3's
*sequence* shapes, the ones that drive the host's per-step work: 128 mel bins, 3,000 frames
(1,500 encoder positions, the cross-attention pool's row length), 32 decoder layers, block size
16, --concurrency requests at once. The hidden size is tiny (--d-model), so the device work of
a step is small on the CPU and the host's work per step shows.

  python3 -m bench.whisper_steps [--num-prompts 128] [--concurrency 64] [--output-len 32]
                                 [--encoder-layers 2] [--profile 25]

Prints the step stats per kind of step (host ms per step, by phase: a step that ran the encoder
is "graph+encoder", its encoder and cross K/V fill phases apart; on the CPU the device times
are 0, and the forward and sample phases are the CPU's compute), the wall time and aten calls
(--count-ops: a proxy for a GPU step's launches) of ModelRunner.prepare per step by kind, and
with --profile N the N functions with the most own time per prepare call (cProfile), for the
steps of each kind. With LOOM_ENCODER_GRAPHS on (the default) the encoder's graphs
run uncaptured on the CPU (padded batches), and the count is theirs; LOOM_ENCODER_GRAPHS=0 runs it eagerly. An H200's numbers are the served run's (bench/whisper_asr.py
with LOOM_STEP_STATS=1)."""
from __future__ import annotations

import argparse
import contextlib
import cProfile
import io
import json
import os
import pstats
import random
import tempfile
import time
from collections import defaultdict

from torch.utils._python_dispatch import TorchDispatchMode


def write_model(out_dir: str, d_model: int, heads: int, encoder_layers: int, decoder_layers: int) -> str:
    from bench.whisper_asr import WHISPER_LARGE_V3, write_whisper_preset
    write_whisper_preset(out_dir)
    config = dict(WHISPER_LARGE_V3, d_model=d_model, encoder_attention_heads=heads, decoder_attention_heads=heads,
                  encoder_ffn_dim=2 * d_model, decoder_ffn_dim=2 * d_model, encoder_layers=encoder_layers,
                  decoder_layers=decoder_layers)
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(config, f, indent=2)
    return out_dir


def clips(n: int, seed: int = 0, rate: int = 16000):
    """Speech-like clips of 10-30 s (noise bursts between near-silence)."""
    import numpy as np
    rng = np.random.default_rng(seed)
    for i in range(n):
        seconds = float(rng.uniform(10, 30))
        t = np.arange(int(seconds * rate)) / rate
        envelope = (np.sin(2 * np.pi * 1.3 * t + rng.uniform(0, 6)) > -0.2).astype(np.float32) * 0.5 + 0.01
        yield (rng.standard_normal(len(t)).astype(np.float32) * envelope, rate), seconds


class _OpCounter(TorchDispatchMode):
    """Counts the aten operators called inside it (views included)."""

    def __init__(self):
        super().__init__()
        self.n = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.n += 1
        return func(*args, **(kwargs or {}))


class PrepareTimer:
    """Wraps ModelRunner.prepare: its wall time per call, by kind of step, and a cProfile of each kind."""

    def __init__(self, profile: bool, count_ops: bool):
        self.ms: dict[str, list[float]] = defaultdict(list)
        self.ops: dict[str, list[int]] = defaultdict(list)     # aten calls per prepare (device launches, roughly)
        self.count_ops = count_ops
        self.profiles: dict[str, pstats.Stats] = {}
        self.profile = profile
        self.runner = None

    def install(self) -> None:
        import workers.model_runner as mr
        prepare = mr.ModelRunner.prepare
        timer = self

        def timed(runner, so, prev):
            timer.runner = runner
            prof = cProfile.Profile() if timer.profile else None
            counter = _OpCounter() if timer.count_ops else contextlib.nullcontext()
            t0 = time.perf_counter()
            if prof is not None:
                prof.enable()
            with counter:
                batch = prepare(runner, so, prev)
            if prof is not None:
                prof.disable()
            ms = 1e3 * (time.perf_counter() - t0)
            if batch is None:
                return batch
            joins = sum(1 for st, lo, n in zip(batch.states, batch.computed_before, batch.num_scheduled)
                        for it in st.mm_items if lo <= it.offset < lo + n)   # cross K/V filled this step
            kind = batch.kind + (" +encoder" if so.scheduled_encoder_inputs else "") + (" +joins" if joins else "")
            kind += f" <={1 << max(len(batch.num_scheduled) - 1, 0).bit_length()} rows"
            timer.ms[kind].append(ms)
            if timer.count_ops:
                timer.ops[kind].append(counter.n)
            if prof is not None:
                if kind in timer.profiles:
                    timer.profiles[kind].add(prof)
                else:
                    timer.profiles[kind] = pstats.Stats(prof)
            return batch
        mr.ModelRunner.prepare = timed


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--num-prompts", type=int, default=128)
    p.add_argument("--concurrency", type=int, default=64, help="max_num_seqs")
    p.add_argument("--output-len", type=int, default=32)
    p.add_argument("--d-model", type=int, default=64)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--encoder-layers", type=int, default=2, help="(the encoder's compute is the CPU's, not its host work)")
    p.add_argument("--decoder-layers", type=int, default=32)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--profile", type=int, default=0, metavar="N", help="the N functions with the most own time")
    p.add_argument("--count-ops", action="store_true", help="also count the aten calls per prepare (slower)")
    args = p.parse_args()
    os.environ.setdefault("LOOM_STEP_STATS", "1")
    os.environ.setdefault("LOOM_DECODE_GRAPHS_ON_CPU", "1")
    import torch
    torch.set_num_threads(1)

    from frontend import LLM, SamplingParams
    from workers.models.whisper import WhisperAudio
    timer = PrepareTimer(args.profile > 0, args.count_ops)
    timer.install()
    prompt = WhisperAudio().transcription_prompt("transcribe", "en", "")
    data = list(clips(args.num_prompts))
    prompts = [{"prompt": prompt, "multi_modal_data": {"audio": clip}} for clip, _ in data]
    with tempfile.TemporaryDirectory() as d:
        write_model(d, args.d_model, args.heads, args.encoder_layers, args.decoder_layers)
        with LLM(d, multiprocess=False, load_format="dummy", max_num_seqs=args.concurrency,
                 block_size=args.block_size, max_model_len=448, mm_processor_cache_gb=0.5) as llm:
            llm.generate(prompts[:2], SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)   # warm
            timer.ms.clear()
            timer.ops.clear()
            timer.profiles.clear()
            # output lengths spread over [output_len / 2, 3 * output_len / 2]: requests end apart and
            # clips join running ones a few at a time, as in a served run at this concurrency
            rng = random.Random(0)
            params = [SamplingParams(temperature=0, ignore_eos=True,
                                     max_tokens=rng.randint(args.output_len // 2, 3 * args.output_len // 2))
                      for _ in prompts]
            t0 = time.perf_counter()
            llm.generate(prompts, params, use_tqdm=False)
            wall = time.perf_counter() - t0
            stats = timer.runner.stats.summary() if timer.runner.stats is not None else {}
    print(f"wall {wall:.2f} s for {args.num_prompts} clips ({sum(s for _, s in data):.0f} s of audio)")
    for kind, s in stats.items():
        if kind == "by_tokens" or not isinstance(s, dict):   # (the process's counters)
            continue
        print(f"step stats {kind}: " + ", ".join(f"{k} {v:.3f}" if isinstance(v, float) else f"{k} {v}"
                                                for k, v in s.items() if "device" not in k and "idle" not in k))
    for kind, ms in sorted(timer.ms.items()):
        ms_sorted = sorted(ms)
        print(f"prepare {kind}: {len(ms)} steps, mean {sum(ms) / len(ms):.2f} ms, "
              f"median {ms_sorted[len(ms) // 2]:.2f} ms, max {ms_sorted[-1]:.2f} ms"
              + (f", {sum(timer.ops[kind]) / len(ms):.0f} aten calls" if timer.ops.get(kind) else ""))
    for kind, stats in sorted(timer.profiles.items()):
        n = len(timer.ms[kind])
        out = io.StringIO()
        stats.stream = out
        stats.sort_stats("tottime").print_stats(args.profile)
        print(f"--- cProfile of prepare, {kind} ({n} steps; cumulative seconds over them)")
        print("\n".join(line for line in out.getvalue().splitlines()[6:] if line.strip()))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
