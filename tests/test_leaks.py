"""1,000 requests through the engine, some aborted mid-stream: afterwards no request
object is alive (with the cyclic GC off in the engine) and every KV block is free."""
from __future__ import annotations

import random

from frontend.engine_client import EngineCoreClient
from frontend import LLM
from ipc.messages import EngineCoreRequest
from ipc.sampling_params import SamplingParams


def test_thousand_requests_leave_nothing(tiny_model_dir, monkeypatch):
    monkeypatch.setenv("LOOM_DEBUG_DISABLE_GC", "1")   # the engine process inherits it
    llm = LLM(tiny_model_dir, max_model_len=128, block_size=4, num_gpu_blocks_override=400)
    client: EngineCoreClient = llm.client
    try:
        rng = random.Random(0)
        params = SamplingParams(temperature=0.8, max_tokens=12, ignore_eos=True)
        doomed = {f"r{i}" for i in range(0, 1000, 4)}          # every 4th is aborted once it streams
        for i in range(1000):
            prompt = [rng.randrange(3, 300) for _ in range(rng.randrange(1, 40))]
            client.add_request(EngineCoreRequest(f"r{i}", prompt, params))
        finished, aborted = set(), set()
        while len(finished) + len(aborted) < 1000:
            outs = client.get_outputs(timeout=120)
            assert outs is not None, "engine stalled"
            for o in outs.outputs:
                if o.request_id in aborted:
                    continue
                if o.finish_reason is not None:
                    finished.add(o.request_id)
                elif o.request_id in doomed:
                    client.abort([o.request_id])
                    aborted.add(o.request_id)
        assert len(aborted) == 250 and len(finished) == 750
        info = client.call_utility("debug_info")
        assert info["tracked_requests"] == 0 and info["waiting"] == 0 and info["running"] == 0
        assert info["live_requests"] == 0, f"{info['live_requests']} request objects still alive"
        assert info["free_blocks"] == info["num_blocks"] == 400
    finally:
        llm.shutdown()
