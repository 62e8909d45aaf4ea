"""Host CPU per output token of the logprobs chain, without a model or a device:
`python -m bench.logprobs_host [--rows 256] [--steps 1000] [--logprobs 5]`.

Synthetic sampler outputs (a [rows, 1 + N] step as the sampler returns it) go through
the same code the processes run, each stage on its own so that its heap is its own:
  worker  workers.logprobs.pack_logprobs + the WorkerReply encoding (finish())
  engine  the WorkerReply decoding, one EngineCoreOutput per request as the scheduler
          builds it, the EngineCoreOutputs encoding
  client  the EngineCoreOutputs decoding and LLM._run (detokenize, logprobs to Logprob
          objects, accumulate), every request running `steps` tokens
Prints CPU microseconds per token of each stage, plain (no logprobs) and with logprobs.
At ~23k tok/s one microsecond per token in a stage on the critical path is ~2.3%.
"""
from __future__ import annotations

import argparse
import tempfile
import time
import types

import numpy as np
import torch

from bench.presets import write_preset
from frontend.detokenizer import TokenTexts
from frontend.entrypoints.llm import LLM, EngineStatsTotals
from frontend.output_processor import RequestState
from frontend.outputs import CompletionOutput, RequestOutput
from ipc.messages import EngineCoreOutput, EngineCoreOutputs, ModelRunnerOutput, MsgType, WorkerReply
from ipc.procs import freeze_startup_heap
from ipc.sampling_params import SamplingParams
from ipc.serial import Decoder, Encoder
from workers.logprobs import pack_logprobs


def sampler_steps(rows: int, steps: int, n: int, vocab: int, seed: int = 0) -> list[tuple]:
    """What copy_back() leaves per step: tokens [rows], and the logprob tensors (ids with the
    sampled token first, logprobs, ranks). Random tokens below 10000, as the workload's."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(min(steps, 16)):  # reused cyclically: building them is not what is measured
        tokens = torch.randint(0, 10000, (rows,), generator=g)
        ids = torch.cat((tokens[:, None], torch.randint(0, vocab, (rows, n), generator=g)), dim=1)
        lps = -torch.rand((rows, 1 + n), generator=g) * 10
        out.append((tokens, (ids, lps, torch.randint(1, 100, (rows,), generator=g))))
    return out


def worker_stage(req_ids, states, steps_data, steps: int, with_lp: bool) -> tuple[float, list]:
    enc, sample_rows, frames_out = Encoder(), np.arange(len(req_ids)), []
    t0 = time.process_time()
    for s in range(steps):
        tokens, topk = steps_data[s % len(steps_data)]
        sampled = tokens.tolist()
        logprobs = pack_logprobs(states, sample_rows, topk) if with_lp else None
        frames = enc.encode(MsgType.WORKER_REPLY.value, WorkerReply(0, ModelRunnerOutput(req_ids, sampled, logprobs)))
        frames_out.append([bytes(f) for f in frames])
    return time.process_time() - t0, frames_out


def engine_stage(worker_frames: list, steps: int) -> tuple[float, list]:
    dec, enc, out_frames = Decoder(WorkerReply), Encoder(), []
    t0 = time.process_time()
    for s, frames in enumerate(worker_frames):
        out = dec.decode(frames).output
        logprobs = out.logprobs or {}
        finish = "length" if s == steps - 1 else None
        outs = [EngineCoreOutput(rid, [tok], finish, None, logprobs.get(rid), None, 0)
                for rid, tok in zip(out.req_ids, out.sampled_token_ids)]
        out_frames.append([bytes(f) for f in enc.encode(MsgType.OUTPUTS.value, EngineCoreOutputs(outs))])
    return time.process_time() - t0, out_frames


class _ReplayClient:
    """Hands LLM._run the engine's frames one step at a time, decoded as the real client does."""
    def __init__(self, frames: list):
        self._frames, self._dec = iter(frames), Decoder(EngineCoreOutputs)

    def get_outputs(self, timeout=None):
        return self._dec.decode(next(self._frames))


def client_stage(tokenizer, req_ids, params, engine_frames: list) -> tuple[float, list]:
    llm = LLM.__new__(LLM)   # the offline client's loop alone: no engine behind it
    llm.mm, llm.stats, llm.router, llm._engine_of = None, EngineStatsTotals(), None, {}
    llm.client = _ReplayClient(engine_frames)
    texts = TokenTexts(tokenizer)
    results, llm._states = [], {}
    for rid in req_ids:
        result = RequestOutput(rid, None, [1] * 16, [CompletionOutput(0, "", [])])
        results.append(result)
        llm._states[rid] = (result, RequestState(rid, 0, [1] * 16, params, tokenizer, texts))
    t0 = time.process_time()
    llm._run(results, use_tqdm=False)
    return time.process_time() - t0, results


def run(rows: int, steps: int, n: int, model_dir: str) -> dict:
    from transformers import AutoTokenizer
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    vocab = len(tokenizer)
    req_ids = [f"{i:032x}" for i in range(rows)]
    report = {}
    for mode in ("plain", "logprobs"):
        params = SamplingParams(temperature=0.6, ignore_eos=True, max_tokens=steps,
                                logprobs=n if mode == "logprobs" else None)
        states = [types.SimpleNamespace(req_id=r, params=params) for r in req_ids]
        data = sampler_steps(rows, steps, n, vocab)
        tw, wf = worker_stage(req_ids, states, data, steps, mode == "logprobs")
        te, ef = engine_stage(wf, steps)
        del wf
        tc, results = client_stage(tokenizer, req_ids, params, ef)
        assert all(len(r.outputs[0].token_ids) == steps for r in results)
        if mode == "logprobs":
            assert all(len(r.outputs[0].logprobs) == steps for r in results)
        per = 1e6 / (rows * steps)
        report[mode] = {"worker": tw * per, "engine": te * per, "client": tc * per}
        print(f"{mode:9s} CPU us per token: worker {tw * per:6.2f}  engine {te * per:6.2f}  client {tc * per:6.2f}",
              flush=True)
    return report


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", type=int, default=256, help="requests per step (default: 256)")
    p.add_argument("--steps", type=int, default=1000, help="steps = output tokens per request (default: 1000)")
    p.add_argument("--logprobs", type=int, default=5, help="top-N logprobs per token (default: 5)")
    p.add_argument("--preset", default="qwen3-0.6b", help="the preset whose tokenizer is used (default: qwen3-0.6b)")
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as d:
        model_dir = write_preset(args.preset, d)
        freeze_startup_heap()   # as the engine core and the worker do once they are up
        run(args.rows, args.steps, args.logprobs, model_dir)


if __name__ == "__main__":
    main()
