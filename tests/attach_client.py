"""A separate client process for tests/test_attach.py: attaches, starts long requests, waits to be killed."""
import sys
import time

from engine_core.client import EngineCoreClient
from ipc.messages import EngineCoreRequest
from ipc.sampling_params import SamplingParams

if __name__ == "__main__":
    address, key = sys.argv[1], sys.argv[2]
    client = EngineCoreClient.attach(address, key)
    for i in range(3):
        client.add_request(EngineCoreRequest(f"doomed-{i}", [5, 6, 7, i + 8],
                                             SamplingParams(temperature=0, max_tokens=400, ignore_eos=True)))
    client.get_outputs(timeout=30)
    print("running", flush=True)
    time.sleep(600)
