"""Whisper-large-v3 on one GPU (random weights): Loom's RTFx through /v1/audio/transcriptions at
concurrency 64 on 10-30 s clips, against HF transformers' batched generate (batch 64) of the
same model shapes in the same call, plus the encoder's share of device time; one table at the end.

  python3 -m bench.whisper_asr [--num-prompts 256] [--concurrency 64] [--output-len 64]

The preset (WHISPER_LARGE_V3: the Hub's config.json values, a Whisper feature extractor with 128
mel bins, a stand-in tokenizer with Whisper's special tokens at their real ids) is written by
write_whisper_preset; `loom serve DIR --load-format dummy` serves it. Every request decodes
--output-len tokens (ignore_eos): random weights would otherwise stop at random points; HF is
forced to the same length (min_new_tokens). RTFx = seconds of audio / seconds of wall time.
The encoder's share: its device time per clip (CUDA events, batch of `concurrency` clips in
Loom's encoder) times the clips, over the serving run's wall time."""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import time

import numpy as np

WHISPER_LARGE_V3 = {
    "architectures": ["WhisperForConditionalGeneration"], "model_type": "whisper", "activation_function": "gelu",
    "d_model": 1280, "encoder_layers": 32, "decoder_layers": 32, "encoder_attention_heads": 20,
    "decoder_attention_heads": 20, "encoder_ffn_dim": 5120, "decoder_ffn_dim": 5120, "num_mel_bins": 128,
    "max_source_positions": 1500, "max_target_positions": 448, "vocab_size": 51866, "scale_embedding": False,
    "bos_token_id": 50257, "eos_token_id": 50257, "pad_token_id": 50256, "decoder_start_token_id": 50258,
    "begin_suppress_tokens": None, "suppress_tokens": None, "tie_word_embeddings": True, "torch_dtype": "float16",
}
LANGS = ("en zh de es ru ko fr ja pt tr pl ca nl ar sv it id hi fi vi he uk el ms cs ro da hu ta no th ur hr bg lt "
         "la mi ml cy sk te fa lv bn sr az sl kn et mk br eu is hy ne mn bs kk sq sw gl mr pa si km sn yo so af oc ka "
         "be tg sd gu am yi lo uz fo ht ps tk nn mt sa lb my bo tl mg as tt haw ln ha ba jw su yue").split()
FEATURES = {"feature_extractor_type": "WhisperFeatureExtractor", "feature_size": 128, "sampling_rate": 16000,
            "hop_length": 160, "chunk_length": 30, "n_fft": 400, "n_samples": 480000, "nb_max_frames": 3000,
            "padding_side": "right", "padding_value": 0.0, "return_attention_mask": False}


def whisper_special() -> dict[int, str]:
    """Whisper-large-v3's special tokens at their ids (50257 on: 100 languages, then the tasks)."""
    special = {50257: "<|endoftext|>", 50258: "<|startoftranscript|>"}
    special.update({50259 + i: f"<|{code}|>" for i, code in enumerate(LANGS)})
    for i, name in enumerate(("translate", "transcribe", "startoflm", "startofprev", "nospeech", "notimestamps")):
        special[50359 + i] = f"<|{name}|>"
    return special


def write_whisper_preset(out_dir: str) -> str:
    from bench.presets import write_tokenizer
    os.makedirs(out_dir, exist_ok=True)
    for name, body in (("config.json", WHISPER_LARGE_V3), ("preprocessor_config.json", FEATURES),
                       ("generation_config.json", {"decoder_start_token_id": 50258, "eos_token_id": 50257})):
        with open(os.path.join(out_dir, name), "w") as f:
            json.dump(body, f, indent=2)
    write_tokenizer(out_dir, WHISPER_LARGE_V3["vocab_size"], whisper_special(), 50257, None)
    return out_dir


def clips(num: int, seed: int, lo: float = 10.0, hi: float = 30.0) -> list[np.ndarray]:
    from bench.asr import RATE, speech_like
    rng = np.random.default_rng(seed)
    assert RATE == FEATURES["sampling_rate"]
    return [speech_like(rng, float(rng.uniform(lo, hi - 0.01))) for _ in range(num)]


async def loom_rtfx(url: str, audio: list[np.ndarray], concurrency: int, output_len: int) -> dict:
    """Every clip through /v1/audio/transcriptions (json), `concurrency` in flight; with the CPU
    ms per clip of this client and of the API servers (bench/server_cpu.py), so that a run shows
    whether either bounds it."""
    import aiohttp

    from bench import server_cpu
    from bench.asr import RATE, _wav
    files = [_wav(a, RATE) for a in audio]
    sem = asyncio.Semaphore(concurrency)
    latencies: list[float] = []

    async def one(session, data: bytes):
        form = aiohttp.FormData()
        form.add_field("file", data, filename="a.wav", content_type="audio/wav")
        for k, v in (("model", "whisper"), ("language", "en"), ("temperature", "0"),
                     ("max_completion_tokens", str(output_len)), ("ignore_eos", "true")):
            form.add_field(k, v)
        async with sem:
            t0 = time.perf_counter()
            async with session.post(url + "/v1/audio/transcriptions", data=form) as r:
                body = await r.text()
                if r.status != 200:
                    raise RuntimeError(f"{r.status}: {body[:300]}")
            latencies.append(time.perf_counter() - t0)

    timeout = aiohttp.ClientTimeout(total=3600)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        await one(session, files[0])   # warm: the first request's compile and cache fills
        latencies.clear()
        servers = server_cpu.api_server_pids(url)
        cpu0, t0, client0 = server_cpu.cpu_seconds(servers), time.perf_counter(), time.process_time()
        await asyncio.gather(*(one(session, f) for f in files))
        wall, client = time.perf_counter() - t0, time.process_time() - client0
        served = server_cpu.cpu_seconds(servers) - cpu0
    seconds = sum(len(a) for a in audio) / RATE
    return {"wall_s": wall, "audio_s": seconds, "rtfx": seconds / wall, "p50_latency_s": float(np.median(latencies)),
            "client_cpu_ms_per_clip": 1e3 * client / len(files),
            "api_server_cpu_ms_per_clip": 1e3 * served / len(files) if servers else None}


def hf_rtfx(model_dir: str, audio: list[np.ndarray], batch: int, output_len: int, device: str = "cuda") -> dict:
    """transformers' WhisperForConditionalGeneration (random weights, fp16, SDPA), batched
    generate of the same forced prompt and the same number of new tokens; features computed
    before the clock (in HF's favour)."""
    import torch
    from transformers import WhisperConfig, WhisperFeatureExtractor, WhisperForConditionalGeneration
    from transformers.generation.utils import GenerationMixin
    config = WhisperConfig(**{k: v for k, v in WHISPER_LARGE_V3.items() if k not in ("architectures", "model_type")})
    dtype = torch.float16 if device == "cuda" else torch.float32
    with torch.device(device):   # (initialised on the device: 1.5 B parameters on the CPU take tens of seconds)
        model = WhisperForConditionalGeneration(config).to(dtype).eval()
    fe = WhisperFeatureExtractor(**{k: v for k, v in FEATURES.items() if k != "feature_extractor_type"})
    prompt = [50258, 50259, 50360, 50364]   # <|startoftranscript|><|en|><|transcribe|><|notimestamps|>
    batches = []
    for i in range(0, len(audio), batch):
        chunk = audio[i:i + batch]
        feats = fe(chunk, sampling_rate=16000, return_tensors="pt")["input_features"].to(device, dtype)
        batches.append(feats)

    def run(feats):
        ids = torch.tensor([prompt] * feats.shape[0], device=device)
        with torch.no_grad():
            return GenerationMixin.generate(model, input_features=feats, decoder_input_ids=ids, do_sample=False,
                                            max_new_tokens=output_len, min_new_tokens=output_len, pad_token_id=50256,
                                            eos_token_id=50257)
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    run(batches[0][:2])   # warm
    sync()
    t0 = time.perf_counter()
    for feats in batches:
        run(feats)
    sync()
    wall = time.perf_counter() - t0
    seconds = sum(len(a) for a in audio) / 16000
    return {"wall_s": wall, "audio_s": seconds, "rtfx": seconds / wall}


def encoder_ms_per_clip(batch: int) -> float:
    """Loom's Whisper encoder (random bf16 weights), device ms per clip at a batch of `batch` clips."""
    import torch
    from transformers import WhisperConfig

    from workers.models.whisper import WhisperEncoder
    config = WhisperConfig(**{k: v for k, v in WHISPER_LARGE_V3.items() if k not in ("architectures", "model_type")})
    with torch.device("cuda"):
        enc = WhisperEncoder(config).to(torch.bfloat16).eval()
    feats = torch.randn(batch, 128, 3000, device="cuda", dtype=torch.bfloat16)
    with torch.no_grad():
        enc(feats)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(3):
            enc(feats)
        end.record()
        torch.cuda.synchronize()
    ms = start.elapsed_time(end) / 3 / batch
    del enc
    torch.cuda.empty_cache()
    return ms


def serve(model_dir: str, port: int, concurrency: int, log: str, api_servers: int) -> subprocess.Popen:
    """loom serve of the preset (dummy weights). The log-mel features are computed in the API
    servers, on the CPU (multimodal/log_mel.py, ~5 ms a clip on one core): several API servers
    share that work."""
    cmd = [sys.executable, "-m", "frontend.entrypoints.cli", "serve", model_dir, "--load-format", "dummy",
           "--port", str(port), "--max-num-seqs", str(concurrency), "--served-model-name", "whisper",
           "--gpu-memory-utilization", "0.6", "--api-server-count", str(api_servers)]
    env = dict(os.environ, LOOM_STEP_STATS="1")   # the worker logs its device time per kind of step at exit
    return subprocess.Popen(cmd, stdout=open(log, "w"), stderr=subprocess.STDOUT, env=env)


def encoder_share_from_log(log: str) -> float | None:
    """The encoder's share of the serving run's device time, from the worker's step stats
    (LOOM_STEP_STATS=1): encoder device time over every step's, the encoder's included (the
    encoder passes are steps of their own kind: ModelRunner._run_encoders)."""
    import ast
    import re
    totals = {}
    with open(log) as f:
        for m in re.finditer(r"step stats (\S+): (\{.*\})", f.read()):
            if m.group(1) != "by_tokens" and m.group(1) != "triton_compiles_while_serving":
                s = ast.literal_eval(m.group(2))
                totals[m.group(1)] = s["steps"] * s["device_ms_per_step"]
    steps = sum(totals.values())
    return totals["encoder"] / steps if "encoder" in totals and steps else None


def step_stats_from_log(log: str) -> dict[str, dict]:
    """kind -> the worker's step stats summary (LOOM_STEP_STATS=1), from the server log."""
    import ast
    import re
    with open(log) as f:
        return {m.group(1): ast.literal_eval(m.group(2))
                for m in re.finditer(r"step stats (\S+): (\{.*\})", f.read())
                if m.group(1) not in ("by_tokens", "triton_compiles_while_serving")}


def print_step_stats(stats: dict[str, dict]) -> None:
    """Per kind of step: device and idle ms, and the host's ms by phase (a step that ran the
    encoder is "KIND+encoder": its encoder and cross K/V phases apart)."""
    phases = ("prepare", "encoder", "cross_kv", "forward", "sample", "finish")
    print(f"\n{'served step stats (ms per step)':<20} {'steps':>6} {'device':>8} {'idle':>8} "
          + " ".join(f"{p:>9}" for p in phases))
    for kind, s in sorted(stats.items()):
        print(f"{kind:<20} {s['steps']:>6} {s['device_ms_per_step']:>8.2f} {s['idle_ms_before']:>8.2f} "
              + " ".join(f"{s.get(f'host_ms_{p}', 0.0):>9.2f}" for p in phases))


def wait_healthy(url: str, proc: subprocess.Popen, seconds: int = 200) -> None:
    import urllib.request
    for _ in range(seconds):
        if proc.poll() is not None:
            raise SystemExit(f"loom serve exited with {proc.returncode}")
        try:
            urllib.request.urlopen(url + "/health", timeout=1)
            return
        except Exception:   # noqa: BLE001  (not up yet)
            time.sleep(1)
    raise SystemExit("loom serve did not become healthy")


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--num-prompts", type=int, default=256)
    p.add_argument("--concurrency", type=int, default=64)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--port", type=int, default=8131)
    p.add_argument("--out", default=os.environ.get("OUT", "/tmp/loom-bench"))
    p.add_argument("--skip-hf", action="store_true")
    p.add_argument("--api-server-count", type=int, default=6, help="API server processes (feature extraction)")
    args = p.parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    model_dir = write_whisper_preset(os.path.join(args.out, "whisper-large-v3"))
    audio = clips(args.num_prompts, 0)
    url = f"http://127.0.0.1:{args.port}"
    proc = serve(model_dir, args.port, args.concurrency, os.path.join(args.out, "whisper-server.log"),
                 args.api_server_count)
    try:
        wait_healthy(url, proc)
        loom = asyncio.run(loom_rtfx(url, audio, args.concurrency, args.output_len))
    finally:
        proc.send_signal(2)
        proc.wait(60)
    print(f"loom: {json.dumps(loom)}", flush=True)
    hf = None if args.skip_hf else hf_rtfx(model_dir, audio[:args.concurrency * 2], args.concurrency, args.output_len)
    print(f"hf: {json.dumps(hf)}", flush=True)
    enc_ms = encoder_ms_per_clip(args.concurrency)
    share = enc_ms * len(audio) / 1e3 / loom["wall_s"]
    served_share = encoder_share_from_log(os.path.join(args.out, "whisper-server.log"))
    steps = step_stats_from_log(os.path.join(args.out, "whisper-server.log"))
    print_step_stats(steps)
    with open(os.path.join(args.out, "whisper_asr.json"), "w") as f:
        json.dump({"loom": loom, "hf": hf, "encoder_ms_per_clip": enc_ms, "encoder_share": share,
                   "encoder_share_of_device_time": served_share, "step_stats": steps}, f, indent=2)
    print(f"\n{'Whisper-large-v3 (random bf16), 10-30 s clips':<52} {'measured':>10} {'target':>10}")
    print(f"{f'Loom RTFx, c{args.concurrency}, {args.output_len} tokens, {args.api_server_count} API servers':<52} "
          f"{loom['rtfx']:>10.0f} "
          f"{'>= 1000':>10}")
    if hf:
        print(f"{f'HF generate RTFx, batch {args.concurrency}':<52} {hf['rtfx']:>10.0f} {'':>10}")
        print(f"{'Loom / HF':<52} {loom['rtfx'] / hf['rtfx']:>10.1f} {'>= 5':>10}")
    print(f"{'client CPU ms per clip':<52} {loom['client_cpu_ms_per_clip']:>10.1f} {'':>10}")
    if loom["api_server_cpu_ms_per_clip"] is not None:
        print(f"{'API servers CPU ms per clip (all of them)':<52} {loom['api_server_cpu_ms_per_clip']:>10.1f} {'':>10}")
    print(f"{'encoder ms per clip (device, batch of concurrency)':<52} {enc_ms:>10.2f} {'':>10}")
    print(f"{'encoder share of the run (clips x ms per clip / wall)':<52} {share:>10.1%} {'(report)':>10}")
    if served_share is not None:
        print(f"{'encoder share of device time (served, step stats)':<52} {served_share:>10.1%} {'(report)':>10}")


if __name__ == "__main__":
    main()
