"""Weight updates and the profiler over HTTP, against a real `loom serve`
(--enable-control-endpoints --api-key --profiler-dir), with SGLang's endpoints and bodies:
a trainer process (gloo) broadcasts checkpoint B through /init_weights_update_group and
/update_weights_from_distributed; /update_weights_from_tensor takes shared-memory handles.
The oracle is HF transformers. Every test leaves the server on checkpoint A, unpaused."""
from __future__ import annotations

import glob
import json
import os
import shutil
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import openai
import pytest
import requests
import torch
from safetensors.torch import load_file

from ipc.sockets import free_tcp_port
from ipc.tensor_handles import SharedTensors
from tests.conftest import ROOT, Server, run_fake, shm_entries
from tests.hf_oracle import hf_greedy

KEY = "rl-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
PROMPT = [11, 12, 13, 14, 15]
N = 16
K_PROJ = "model.layers.0.self_attn.k_proj.weight"
WEIGHT_ENDPOINTS = [("POST", "/update_weights_from_disk"), ("POST", "/init_weights_update_group"),
                    ("POST", "/update_weights_from_distributed"), ("POST", "/destroy_weights_update_group"),
                    ("POST", "/update_weights_from_tensor"), ("GET", "/get_weights_by_name"),
                    ("POST", "/pause_generation"), ("POST", "/continue_generation"), ("POST", "/flush_cache"),
                    ("GET", "/get_load")]
PROFILER_ENDPOINTS = [("POST", "/start_profile"), ("POST", "/stop_profile")]
JOIN_TIMEOUT_S = 6   # a trainer that never joins fails /init_weights_update_group after this


@pytest.fixture(scope="module")
def ckpt(model_factory):
    return model_factory("qwen3"), model_factory("qwen3", seed=1)


@pytest.fixture(scope="module")
def server(ckpt, tmp_path_factory):
    traces = str(tmp_path_factory.mktemp("traces"))
    s = Server(ckpt[0], "--enable-control-endpoints", "--api-key", KEY, "--profiler-dir", traces,
               "--max-model-len", "256",
               env={"OMP_NUM_THREADS": "1", "LOOM_WEIGHT_UPDATE_JOIN_TIMEOUT_S": str(JOIN_TIMEOUT_S)})
    try:
        s.wait_healthy(180)
        s.traces = traces
        yield s
    finally:
        s.stop()


def post(server, path: str, body: dict | None = None, **kw) -> tuple[int, dict]:
    r = requests.post(server.url + path, json=body, headers=kw.pop("headers", AUTH), timeout=120, **kw)
    return r.status_code, r.json()


def greedy_text(server) -> str:
    client = openai.OpenAI(base_url=server.url + "/v1", api_key=KEY)
    out = client.completions.create(model=client.models.list().data[0].id, prompt=PROMPT, max_tokens=N,
                                    temperature=0, extra_body={"ignore_eos": True})
    return out.choices[0].text


def hf_text(model_dir: str) -> str:
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(model_dir).decode(hf_greedy(model_dir, PROMPT, N))


def weights_rows(server, name: str, n: int) -> torch.Tensor:
    r = requests.get(server.url + "/get_weights_by_name", params={"name": name, "truncate_size": n},
                     headers=AUTH, timeout=30)
    assert r.status_code == 200, r.text
    return torch.tensor(r.json())


def restore(server, model_dir: str) -> None:
    assert post(server, "/pause?mode=keep")[0] == 200
    status, body = post(server, "/update_weights_from_disk", {"model_path": model_dir})
    assert status == 200 and body["success"], body
    assert post(server, "/resume")[0] == 200


def test_weights_from_a_trainer_group(server, ckpt):
    a, b = ckpt
    assert hf_text(a) != hf_text(b)
    assert greedy_text(server) == hf_text(a)
    new = load_file(os.path.join(b, "model.safetensors"))
    names = sorted(new)
    meta = {"names": names, "dtypes": ["float32"] * len(names), "shapes": [list(new[n].shape) for n in names]}
    port = free_tcp_port()
    trainer = subprocess.Popen([sys.executable, os.path.join(ROOT, "tests", "_rl_trainer.py"), str(port), "2",
                                "rl_group", b], cwd=ROOT, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                               env={**os.environ, "PYTHONPATH": ROOT})
    pool = ThreadPoolExecutor(1)

    def broadcast(body: dict) -> tuple[int, dict]:
        """The server receives (an HTTP call in flight) while the trainer sends."""
        fut = pool.submit(post, server, "/update_weights_from_distributed", {**body, "group_name": "rl_group"})
        trainer.stdin.write(json.dumps(body) + "\n")
        trainer.stdin.flush()
        assert trainer.stdout.readline().strip() == "sent"
        return fut.result(timeout=120)

    try:
        _wait_listening(port)   # the trainer's store: the server's join waits JOIN_TIMEOUT_S at most
        status, body = post(server, "/init_weights_update_group", {
            "master_address": "127.0.0.1", "master_port": port, "rank_offset": 1, "world_size": 2,
            "group_name": "rl_group", "backend": "gloo"})
        assert status == 200 and body["success"], body
        assert trainer.stdout.readline().strip() == "ready"
        status, body = post(server, "/init_weights_update_group", {
            "master_address": "127.0.0.1", "master_port": port, "rank_offset": 1, "world_size": 2,
            "group_name": "rl_group", "backend": "gloo"})
        assert status == 400 and not body["success"] and "already exists" in body["message"], body

        # TorchRL's sequence: SGLang's pause_generation (retract), get_load until nothing runs,
        # the update, continue_generation
        assert post(server, "/pause_generation", {"mode": "retract"})[0] == 200
        load = requests.get(server.url + "/get_load", headers=AUTH, timeout=30).json()
        assert load[0]["num_running_reqs"] == 0 and load[0]["num_reqs"] == 0, load
        status, body = broadcast(meta)
        assert status == 200 and body == {"success": True, "message": body["message"]}, body
        assert post(server, "/continue_generation", {"torch_empty_cache": True})[0] == 200
        assert greedy_text(server) == hf_text(b)
        assert post(server, "/flush_cache") == (200, {"success": True, "message": "Cache flushed."})
        assert torch.equal(weights_rows(server, K_PROJ, 2), new[K_PROJ][:2])

        # a wrong shape: 400 naming the tensor; the broadcasts are taken (the trainer does not hang),
        # and nothing changes
        assert post(server, "/pause?mode=keep")[0] == 200
        bad = {**meta, "shapes": [[3, 3] if n == K_PROJ else s for n, s in zip(names, meta["shapes"])]}
        status, body = broadcast(bad)
        assert status == 400 and not body["success"], body
        assert K_PROJ in body["message"] and "[3, 3]" in body["message"], body
        assert body["error"]["code"] == 400
        assert post(server, "/resume")[0] == 200
        assert greedy_text(server) == hf_text(b)

        status, body = post(server, "/destroy_weights_update_group", {"group_name": "rl_group"})
        assert status == 200 and body["success"], body
        trainer.stdin.close()
        assert trainer.wait(60) == 0
        status, body = post(server, "/destroy_weights_update_group", {"group_name": "rl_group"})
        assert status == 400 and "no weight update group" in body["message"], body
    finally:
        pool.shutdown(wait=False)
        if trainer.poll() is None:
            trainer.kill()
            trainer.wait()
    restore(server, a)
    assert greedy_text(server) == hf_text(a)


def _wait_listening(port: int, timeout: float = 120.0) -> None:
    """Until something accepts connections on the port (the trainer's process loads torch first)."""
    import socket
    deadline = time.monotonic() + timeout
    while True:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return
        except OSError:
            assert time.monotonic() < deadline, f"nothing listens on port {port}"
            time.sleep(0.1)


def test_requests_step_while_a_trainer_group_forms(server, ckpt):
    """The join waits for the trainer (here: none, a port nobody listens on), but not the engine's
    loop: a request sent meanwhile is answered first (it waited out the whole join timeout)."""
    with ThreadPoolExecutor(1) as pool:
        join = pool.submit(post, server, "/init_weights_update_group", {
            "master_address": "127.0.0.1", "master_port": free_tcp_port(), "rank_offset": 1, "world_size": 2,
            "group_name": "nobody", "backend": "gloo"})
        time.sleep(0.5)   # the workers are joining
        assert greedy_text(server) == hf_text(ckpt[0])
        assert not join.done()
        status, body = join.result(timeout=JOIN_TIMEOUT_S + 60)
    assert status == 400 and f"did not form within {JOIN_TIMEOUT_S} s" in body["message"], body
    status, body = post(server, "/destroy_weights_update_group", {"group_name": "nobody"})
    assert status == 400 and "no weight update group" in body["message"], body


def test_weights_from_tensor_handles(server, ckpt):
    a, b = ckpt
    assert post(server, "/pause?mode=abort")[0] == 200
    with SharedTensors(load_file(os.path.join(b, "model.safetensors")).items()) as shared:
        status, body = post(server, "/update_weights_from_tensor", {"named_tensors": shared.to_builtins()})
    assert status == 200 and body["success"], body
    assert post(server, "/resume")[0] == 200
    assert greedy_text(server) == hf_text(b)
    # SGLang's pickled form is refused
    status, body = post(server, "/update_weights_from_tensor", {"serialized_named_tensors": ["gASVAAAA"]})
    assert status == 400 and body["error"]["param"] == "serialized_named_tensors", body
    # abort_all_requests: no pause needed (in-flight requests would end with "abort")
    status, body = post(server, "/update_weights_from_disk", {"model_path": a, "abort_all_requests": True})
    assert status == 200 and body["success"], body
    assert greedy_text(server) == hf_text(a)
    assert not [n for n in shm_entries() if n.startswith("loom-tensors-")]


def test_bad_updates_over_http(server, ckpt, tmp_path):
    a, b = ckpt
    before = weights_rows(server, K_PROJ, 3)
    status, body = post(server, "/update_weights_from_disk", {"model_path": b})   # not paused
    assert status == 400 and not body["success"] and "pause it first" in body["message"], body
    assert post(server, "/pause?mode=keep")[0] == 200
    new = load_file(os.path.join(b, "model.safetensors"))
    new["model.layers.0.self_attn.q_proj.weight"] = new["model.layers.0.self_attn.q_proj.weight"][:, :8]
    with SharedTensors(new.items()) as shared:
        status, body = post(server, "/update_weights_from_tensor", {"named_tensors": shared.to_builtins()})
    assert status == 400 and "'model.layers.0.self_attn.q_proj.weight' has shape [64, 8]" in body["message"], body
    with SharedTensors([("model.layers.9.mlp.up_proj.weight", torch.zeros(128, 64))]) as shared:
        status, body = post(server, "/update_weights_from_tensor", {"named_tensors": shared.to_builtins()})
    assert status == 400 and "'model.layers.9.mlp.up_proj.weight' is not a weight" in body["message"], body
    status, body = post(server, "/update_weights_from_disk", {"model_path": str(tmp_path)})
    assert status == 400 and "no config.json" in body["message"], body
    status, body = post(server, "/update_weights_from_disk", {"path": b})
    assert status == 400 and body["error"]["param"] == "model_path", body
    truncated = tmp_path / "truncated"            # a checkpoint cut short: the caller's file, a 400 (was a 500)
    shutil.copytree(b, truncated)
    with open(truncated / "model.safetensors", "r+b") as f:
        f.truncate(100)
    status, body = post(server, "/update_weights_from_disk", {"model_path": str(truncated)})
    assert status == 400 and "not a readable safetensors file" in body["message"], body
    r = requests.get(server.url + "/get_weights_by_name", params={"name": "nope"}, headers=AUTH, timeout=30)
    assert r.status_code == 400 and "'nope' is not a weight" in r.json()["error"]["message"]
    r = requests.get(server.url + "/get_weights_by_name", params={"name": K_PROJ, "truncate_size": -1}, headers=AUTH,
                     timeout=30)
    assert r.status_code == 400 and "truncate_size" in r.json()["error"]["message"], r.text
    assert r.json()["error"]["param"] == "truncate_size"   # (it named "name")
    status, body = post(server, "/collective_rpc", {"method": "get_weights_by_name", "args": [K_PROJ, -1]})
    assert status == 400 and "truncate_size" in body["error"]["message"], body  # the same check on this path
    assert post(server, "/resume")[0] == 200
    assert torch.equal(weights_rows(server, K_PROJ, 3), before)
    assert greedy_text(server) == hf_text(a)
    for method, path in WEIGHT_ENDPOINTS + PROFILER_ENDPOINTS:   # the API key guards them all
        r = requests.request(method, server.url + path, json={}, timeout=30)
        assert r.status_code == 401, path


def test_profiler_over_http(server):
    status, body = post(server, "/start_profile", {"profile_prefix": "http"})
    assert status == 200 and body["traces"] == ["http_dp0_tp0_rank0"], body
    assert post(server, "/v1/completions", {"prompt": PROMPT, "max_tokens": 2})[0] == 200
    assert post(server, "/stop_profile")[0] == 200
    status, body = post(server, "/stop_profile")
    assert status == 400 and "not running" in body["error"]["message"], body
    assert post(server, "/start_profile?profile_prefix=again")[0] == 200
    assert post(server, "/stop_profile")[0] == 200
    names = sorted(os.path.basename(p).split(".")[0] for p in glob.glob(os.path.join(server.traces, "*.pt.trace.json")))
    assert names == ["again_dp0_tp0_rank0", "http_dp0_tp0_rank0"], names
    [path] = glob.glob(os.path.join(server.traces, "http_dp0_tp0_rank0.*.pt.trace.json"))
    with open(path) as f:
        ops = {e["name"] for e in json.load(f)["traceEvents"] if e.get("cat") == "cpu_op"}
    assert "aten::linear" in ops or "aten::mm" in ops, sorted(ops)[:20]


class _FakeLLM:
    def __init__(self, profiler_dir: str | None):
        from ipc.config import EngineConfig
        self.config = EngineConfig(model="fake", max_model_len=64, vocab_size=100, profiler_dir=profiler_dir)
        self.tokenizer = None
        self.client_index = 0
        self.is_dead = False
        self.dead_reason = None
        self.calls: list[tuple] = []

    async def call_utility(self, method, *args, timeout=None):
        self.calls.append((method, *args))
        return ["t"]


@pytest.mark.parametrize("profiler_dir", [None, "/tmp/loom-traces"])
def test_endpoints_off_without_control_endpoints(profiler_dir):
    """Weight updates need --enable-control-endpoints; the profiler is also on with a profiler dir."""
    async def scenario(s, url, llm):
        for method, path in WEIGHT_ENDPOINTS:
            async with s.request(method, url + path, json={}) as r:
                assert r.status == 404, path
        for method, path in PROFILER_ENDPOINTS:
            async with s.request(method, url + path) as r:
                assert r.status == (200 if profiler_dir else 404), path
        assert llm.calls == ([("start_profile", None), ("stop_profile",)] if profiler_dir else [])
    run_fake(_FakeLLM(profiler_dir), scenario)
