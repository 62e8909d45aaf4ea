"""The engine core's grammar work per step on this host's CPU, no GPU: `python -m bench.grammar_fill [--rows 256]`.

ROWS requests under bench/structured.py's endless JSON schema (the Qwen3 preset's tokenizer); each
step: the bitmask of every row (StructuredOutputManager.grammar_bitmask: xgrammar's batch fill on
the manager's filler thread, then the distinct rows), then each row accepts one allowed token (the
scheduler's accept). Prints the median ms of each per step: what a constrained step adds to the
engine core's critical path (the fill overlaps the next step's scheduling, the accepts do not).
"""
from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from types import SimpleNamespace

import numpy as np


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(prog="python -m bench.grammar_fill", description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", type=int, default=256)
    p.add_argument("--steps", type=int, default=40)
    args = p.parse_args(argv)
    from bench.presets import write_preset
    from bench.structured import ENDLESS_SCHEMA
    from engine_core.structured_output import StructuredOutputManager
    from ipc.config import EngineConfig
    from ipc.sampling_params import StructuredOutputsParams
    from workers.models.registry import multimodal_info

    with tempfile.TemporaryDirectory(prefix="loom-grammar-fill-") as model_dir:
        config = EngineConfig(model=write_preset("qwen3-0.6b", model_dir), load_format="dummy").resolve(multimodal_info)
        mgr = StructuredOutputManager(config)
        constraint = SimpleNamespace(structured_outputs=StructuredOutputsParams(json=ENDLESS_SCHEMA))
        reqs = {str(i): SimpleNamespace(request_id=str(i), sampling_params=constraint, eos_token_ids=[0],
                                        prompt_token_ids=[1], output_token_ids=[], grammar=None)
                for i in range(args.rows)}
        for r in reqs.values():
            mgr.add_request(r)
        while not all(mgr.ready(r) for r in reqs.values()):
            time.sleep(0.01)
        so = SimpleNamespace(req_ids=list(reqs), scheduled_spec_decode_tokens={})
        rng = np.random.default_rng(0)
        fills, accepts = [], []
        try:
            for _ in range(args.steps):
                t0 = time.perf_counter()
                out = mgr.grammar_bitmask(so, reqs)
                fills.append(time.perf_counter() - t0)
                masks = out.bitmask if out.mask_rows is None else out.bitmask[out.mask_rows]
                bits = np.unpackbits(masks[:, :64].view(np.uint8), axis=1, bitorder="little")  # the first 2,048 ids
                tokens = [int(rng.choice(np.flatnonzero(row))) for row in bits]
                t0 = time.perf_counter()
                for r, tok in zip(reqs.values(), tokens):
                    r.output_token_ids.append(tok)
                    mgr.accept(r, tok)
                accepts.append(time.perf_counter() - t0)
        finally:
            mgr.shutdown()
    warm = args.steps // 8
    result = {"rows": args.rows, "bitmask_ms": 1e3 * statistics.median(fills[warm:]),
              "accept_ms": 1e3 * statistics.median(accepts[warm:])}
    print(f"grammar work per step, {args.rows} constrained rows: bitmask {result['bitmask_ms']:.2f} ms, "
          f"accept {result['accept_ms']:.2f} ms")
    return result


if __name__ == "__main__":
    main()
