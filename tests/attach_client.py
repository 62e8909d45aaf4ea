"""A separate client process for tests/test_attach.py: attaches, starts long requests, waits to be killed."""
import sys
import time

from frontend.engine_client import EngineCoreClient
from ipc.messages import EngineCoreRequest
from ipc.sampling_params import SamplingParams

if __name__ == "__main__":
    address, key = sys.argv[1], sys.argv[2]
    client = EngineCoreClient.attach(address, key)
    for i in range(3):
        client.add_request(EngineCoreRequest(f"doomed-{i}", [5, 6, 7, i + 8],
                                             SamplingParams(temperature=0, max_tokens=400, ignore_eos=True)))
    # "running" only once every request has produced a token: all three are in the engine
    seen: set[str] = set()
    deadline = time.monotonic() + 60
    while len(seen) < 3 and time.monotonic() < deadline:
        outs = client.get_outputs(timeout=1)
        seen.update(o.request_id for o in (outs.outputs if outs else []))
    print("running" if len(seen) == 3 else f"only {sorted(seen)}", flush=True)
    time.sleep(600)
