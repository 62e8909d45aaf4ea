"""Engine cores attached from elsewhere: a headless engine, API servers of a second
`loom serve`, and Python clients, all at once; disconnects abort only their own requests;
a wrong key is refused."""
from __future__ import annotations

import concurrent.futures
import os
import subprocess
import sys
import time

import msgspec
import pytest
import requests

from frontend.engine_client import EngineCoreClient, EngineDeadError
from ipc.messages import MsgType
from ipc.sampling_params import SamplingParams
from ipc.sockets import free_tcp_port
from tests.conftest import ROOT, Server, popen_serve, run_to_end, shm_entries
from tests.hf_oracle import hf_greedy

KEY = "s3cret-key"
PROMPTS = [[11, 12, 13, 14], [50, 60, 70], [101, 102, 103, 104, 105, 106]]


def _generate(client: EngineCoreClient, rid: str, prompt: list[int], max_tokens: int = 8) -> list[int]:
    return run_to_end(client, rid, prompt, SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True))[0]


def _attach(address: str, key: str | None = KEY, timeout: float = 120) -> EngineCoreClient:
    """Attach with the right key, retrying until the engine is up. Until it has bound the port,
    whatever else held the port a moment (another test's socket: free_tcp_port only found it free)
    may answer, and refuse the handshake: a PermissionError is retried too. A wrong key is tested
    with EngineCoreClient.attach itself."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            return EngineCoreClient.attach(address, key, timeout=2)
        except (TimeoutError, PermissionError):
            if time.monotonic() > deadline:
                raise
            time.sleep(0.2)


def _send_raw_add(client: EngineCoreClient, rid: str, body: bytes, timeout: float = 10):
    """Send an ADD body as it is (no encoder between) and wait for the output answering `rid`."""
    client.input.send_multipart([client.engines[client.engine_indices[0]], MsgType.ADD.value, body])
    deadline = time.monotonic() + timeout
    while True:
        assert time.monotonic() < deadline, f"the ADD of {rid!r} was not answered"
        outs = client.get_outputs(timeout=1)
        out = next((o for o in outs.outputs if o.request_id == rid), None) if outs else None
        if out is not None:
            return out


def _async_llm_refuses_a_running_request_id(model_dir: str, address: str, expected: list[int]) -> None:
    """An API server's AsyncLLM (in this process, attached like `loom serve --engine-address`):
    generate() with the id of a request it is running raises ValueError (vLLM's "already
    running"). It once registered the new one over the running one, which then never finished."""
    import asyncio
    import tempfile

    from frontend.async_llm import AsyncLLM
    from ipc.config import EngineConfig

    async def scenario(tmp: str) -> list[int]:
        llm = AsyncLLM(EngineConfig(model=model_dir).resolve(), f"ipc://{tmp}/in", f"ipc://{tmp}/out")
        try:
            await llm.start(engine_address=address, auth_key=KEY, timeout=60)
            params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
            running = llm.generate(PROMPTS[0], params, "same-id")
            first = await running.__anext__()
            with pytest.raises(ValueError, match="already running"):
                await llm.generate(PROMPTS[1], params, "same-id").__anext__()
            outs = [first] + [o async for o in running]
            assert outs[-1].finished
            return [t for o in outs for t in o.outputs[0].token_ids]
        finally:
            llm.close()

    with tempfile.TemporaryDirectory() as tmp:
        assert asyncio.run(asyncio.wait_for(scenario(tmp), 120)) == expected


@pytest.fixture
def headless(tiny_model_dir):
    port = free_tcp_port()
    address = f"tcp://127.0.0.1:{port}"
    proc = popen_serve(tiny_model_dir, "--headless", "--engine-address", address, "--engine-auth-key", KEY,
                       "--max-model-len", "512", "--scheduling-policy", "priority")
    try:
        yield address, proc
    finally:
        if proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(20)
            except subprocess.TimeoutExpired:
                proc.kill()
        try:
            os.killpg(proc.pid, 9)
        except ProcessLookupError:
            pass


def test_attach_headless_engine(tiny_model_dir, headless):
    address, engine_proc = headless
    client = _attach(address)
    try:
        expected = [hf_greedy(tiny_model_dir, p, 8) for p in PROMPTS]
        # API servers of a second `loom serve`, attached to the same engine
        # (with neither --max-model-len nor --scheduling-policy: the engine's hold)
        api = Server(tiny_model_dir, "--engine-address", address, "--api-server-count", "2",
                     env={"LOOM_ENGINE_AUTH_KEY": KEY})
        try:
            api.wait_healthy()
            r = requests.post(api.url + "/v1/completions", timeout=60, json={
                "prompt": PROMPTS[0], "max_tokens": 2, "priority": 3})
            assert r.status_code == 200, r.text   # (a 400: "priority needs --scheduling-policy priority")
            r = requests.post(api.url + "/v1/completions", timeout=60, json={"prompt": [5] * 600, "max_tokens": 2})
            assert r.status_code == 400 and "512" in r.json()["error"]["message"], r.text

            def http(prompt):
                r = requests.post(api.url + "/v1/completions", timeout=60, json={
                    "prompt": prompt, "max_tokens": 8, "temperature": 0, "ignore_eos": True})
                assert r.status_code == 200, r.text
                return r.json()["choices"][0]["text"]
            tok = __import__("transformers").AutoTokenizer.from_pretrained(tiny_model_dir)
            with concurrent.futures.ThreadPoolExecutor(8) as pool:
                texts = list(pool.map(http, PROMPTS * 4))
                got = [_generate(client, f"c-{i}", p) for i, p in enumerate(PROMPTS)]
            assert got == expected
            # random tokens of a random model are often partial UTF-8, which streaming and whole
            # decodes render with different numbers of U+FFFD: compare the real characters
            clean = lambda t: t.replace("\ufffd", "")
            assert [clean(t) for t in texts] == [clean(tok.decode(e)) for e in expected] * 4

            # a client that dies loses its requests; the engine and the others go on
            doomed = subprocess.Popen([sys.executable, "-m", "tests.attach_client", address, KEY], cwd=ROOT,
                                      stdout=subprocess.PIPE, text=True)
            assert doomed.stdout.readline().strip() == "running"
            assert client.call_utility("debug_info")["tracked_requests"] == 3
            doomed.kill()
            doomed.wait()
            deadline = time.monotonic() + 5
            while client.call_utility("debug_info")["tracked_requests"] and time.monotonic() < deadline:
                time.sleep(0.1)
            info = client.call_utility("debug_info")
            assert info["tracked_requests"] == 0 and info["free_blocks"] == info["num_blocks"]
            assert _generate(client, "after", PROMPTS[0]) == expected[0]
            assert clean(http(PROMPTS[1])) == clean(tok.decode(expected[1]))

            # every client hears that the engine went idle, though another client's requests ran:
            # the step's stats reached one client, and an API server attached on its own (its
            # /metrics merged with no other's) showed "running 1" for ever
            for _ in range(3):
                while client.get_outputs(timeout=0.2) is not None:
                    pass
                http(PROMPTS[2])
                idle, deadline = False, time.monotonic() + 5
                while not idle:
                    assert time.monotonic() < deadline, "this client never heard that the engine is idle"
                    outs = client.get_outputs(timeout=0.5)
                    s = outs.scheduler_stats if outs else None
                    idle = s is not None and s.num_running == 0 and s.num_waiting == 0

            # an ADD that does not decode (a prompt that is not a list of ints) fails alone, with an
            # error output for its request id, where it was once dropped and left its client waiting
            out = _send_raw_add(client, "bad-add", msgspec.msgpack.encode(["bad-add", "not a prompt", []]))
            assert out.finish_reason == "error" and "malformed request" in out.error
            # a well-formed ADD with a byte after its end: answered too (its id read on its own)
            out = _send_raw_add(client, "bad-tail", msgspec.msgpack.encode(["bad-tail", [1, 2, 3], []]) + b"\x00")
            assert out.finish_reason == "error" and "malformed request" in out.error
            # a UTILITY whose call id reads but whose method is not a string: answered with a failure
            client.input.send_multipart([client.engines[client.engine_indices[0]], MsgType.UTILITY.value,
                                         msgspec.msgpack.encode([0, 987654, 5, []])])
            reply, deadline = None, time.monotonic() + 10
            while reply is None:
                assert time.monotonic() < deadline, "the malformed UTILITY was not answered"
                outs = client.get_outputs(timeout=1)
                reply = outs.utility_output if outs and outs.utility_output and \
                    outs.utility_output.call_id == 987654 else None
            assert "malformed utility call" in reply.failure
            assert _generate(client, "after-bad", PROMPTS[2]) == expected[2]

            _async_llm_refuses_a_running_request_id(tiny_model_dir, address, expected[0])

            # a wrong key, or none, is refused
            with pytest.raises(PermissionError):
                EngineCoreClient.attach(address, "wrong", timeout=5)
            with pytest.raises(PermissionError):
                EngineCoreClient.attach(address, None, timeout=5)
        finally:
            api.stop()
    finally:
        client.close()

    # killing the engine reaches attached clients and ends `loom serve --headless` non-zero
    client = _attach(address)
    try:
        engine_proc.terminate()
        assert engine_proc.wait(30) == 0
        with pytest.raises(EngineDeadError):
            for _ in range(50):
                client.get_outputs(timeout=0.1)
    finally:
        client.close()
    assert not shm_entries()


def test_headless_refuses_network_address_without_key(tiny_model_dir):
    r = subprocess.run([sys.executable, "-m", "frontend.entrypoints.cli", "serve", tiny_model_dir, "--headless",
                        "--engine-address", "tcp://0.0.0.0:5999"], cwd=ROOT, capture_output=True, text=True,
                       timeout=60)
    assert r.returncode != 0 and "auth-key" in r.stderr
