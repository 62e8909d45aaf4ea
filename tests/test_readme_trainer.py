"""The README's trainer loop (section "RL: weight updates under pause"), run as written against a
real `loom serve` on the CPU (gloo). The block is read from README.md, so the two cannot drift:
the test fills in only what the README leaves to the reader (`prompts`, `policy`, `train`) and
its settings line (this server's URL and key, a free port, two steps instead of 100). Its
`train` returns a second checkpoint's state dict (HF names); afterwards the server must generate
what HF transformers generates from that checkpoint.

The same server also shows `--log-level` reaching every process: it runs with `--log-level
warning` under LOOM_LOG_LEVEL=DEBUG (the flag wins), and no process logs an INFO line."""
from __future__ import annotations

import os
import re
import subprocess

import openai
import pytest
import torch.distributed as dist
from safetensors.torch import load_file

from ipc.sockets import free_tcp_port
from tests.conftest import ROOT, Server, popen_serve
from tests.hf_oracle import hf_greedy

KEY = "readme-key"
PROMPT = [11, 12, 13, 14, 15]
N = 16
SETTINGS = re.compile(r"^URL, KEY, PORT, G, STEPS = .*$", re.M)
# a log line of the launcher, an engine core, a worker or an API server (their formats) at INFO or below
CHATTY = re.compile(r" (loom|engine\d*|worker\d+|api\d+) (INFO|DEBUG) ")


def readme_trainer_block() -> str:
    with open(os.path.join(ROOT, "README.md"), encoding="utf-8") as f:
        readme = f.read()
    section = readme[readme.index("## RL: weight updates under pause"):]
    section = section[:section.index("\n## ")]
    blocks = re.findall(r"```python\n(.*?)```", section, re.S)
    assert len(blocks) == 1, "the section should hold one python block: the trainer loop"
    return blocks[0]


class _LoggedServer(Server):
    """A Server whose output goes to a file (the log-level check reads it)."""

    def __init__(self, model_dir: str, log_path: str, *args: str, env: dict):
        self.port = free_tcp_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = open(log_path, "w")
        self.proc = popen_serve(model_dir, "--host", "127.0.0.1", "--port", str(self.port), *args,
                                env={**os.environ, **env}, stdout=self.log, stderr=subprocess.STDOUT)


@pytest.fixture(scope="module")
def ckpt(model_factory):
    return model_factory("qwen3"), model_factory("qwen3", seed=1)


@pytest.fixture(scope="module")
def server(ckpt, tmp_path_factory):
    log = str(tmp_path_factory.mktemp("readme-trainer") / "serve.log")
    s = _LoggedServer(ckpt[0], log, "--enable-control-endpoints", "--api-key", KEY, "--max-model-len", "512",
                      "--log-level", "warning", "--weight-update-join-timeout-s", "60",
                      env={"OMP_NUM_THREADS": "1", "LOOM_LOG_LEVEL": "DEBUG"})
    try:
        s.wait_healthy(180)
        s.log_path = log
        yield s
    finally:
        s.stop()
        s.log.close()


def greedy_text(server) -> str:
    client = openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0, timeout=60)
    out = client.completions.create(model=client.models.list().data[0].id, prompt=PROMPT, max_tokens=N,
                                    temperature=0, extra_body={"ignore_eos": True})
    return out.choices[0].text


def hf_text(model_dir: str) -> str:
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(model_dir).decode(hf_greedy(model_dir, PROMPT, N))


def test_readme_trainer_loop(server, ckpt):
    a, b = ckpt
    assert hf_text(a) != hf_text(b)
    assert greedy_text(server) == hf_text(a)
    code = readme_trainer_block()
    assert len(SETTINGS.findall(code)) == 1, "the README's settings line changed: update this test's pattern"
    code = SETTINGS.sub(f'URL, KEY, PORT, G, STEPS = {server.url!r}, {KEY!r}, {free_tcp_port()}, '
                        f'"weight_update_group", 2', code)
    new = load_file(os.path.join(b, "model.safetensors"))
    rollouts_seen = []

    def train(policy, rollouts):
        """The reader's training step: here, the second checkpoint, under its HF names."""
        rollouts_seen.append(rollouts)
        return dict(new)

    scope = {"prompts": [PROMPT, PROMPT[:3]], "policy": None, "train": train}
    try:
        exec(compile(code, "README.md (the trainer loop)", "exec"), scope)
    finally:
        if scope.get("group") is not None:
            dist.destroy_process_group(scope["group"])
    assert len(rollouts_seen) == 2 and all(len(r["choices"]) == 2 for r in rollouts_seen), rollouts_seen
    assert greedy_text(server) == hf_text(b)   # served from the broadcast weights (and resumed)

    with open(server.log_path, encoding="utf-8") as f:
        chatty = [line for line in f if CHATTY.search(line)]
    assert not chatty, f"--log-level warning did not reach every process: {chatty[:5]}"
