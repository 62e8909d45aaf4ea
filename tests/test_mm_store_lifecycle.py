"""The multimodal store's segments never outlive a server: not after SIGTERM (tested with the
API module's server), nor after a SIGKILL of any one process (API server, engine core, worker,
the `loom serve` parent), whether or not every worker had mapped the segment yet; two servers
on one host run side by side (each run names its segments with its own id)."""
from __future__ import annotations

import os
import shutil
import signal
import tempfile
import time

import pytest
import requests

from tests.conftest import Server, child_pids, is_tokenizer_process, own_run_id, serve_processes, shm_entries
from tests.test_multimodal_api import image_message, png_url
from tests.tiny_vl_models import make_tiny_qwen2_5_vl, random_image


@pytest.fixture(scope="module")
def vl_dir(tmp_path_factory):
    return make_tiny_qwen2_5_vl(str(tmp_path_factory.mktemp("qwen2_5_vl_store")))


def _procs(server) -> dict[str, int]:
    return {"parent": server.proc.pid, **serve_processes(server)}


def _segments(run_id: str) -> list[str]:
    return [n for n in os.listdir("/dev/shm") if run_id in n]


def _image_request(server) -> None:
    model = requests.get(server.url + "/v1/models", timeout=10).json()["data"][0]["id"]
    r = requests.post(server.url + "/v1/chat/completions", timeout=60, json={
        "model": model, "max_tokens": 2, "messages": image_message(png_url(random_image(40, 56, 56)))})
    assert r.status_code == 200, r.text


def _start(vl_dir, run_id, **env):
    return Server(vl_dir, "--max-model-len", "256", "--max-num-seqs", "2", "--mm-processor-cache-gb", "0.01",
                  env={"LOOM_RUN_ID": run_id, **env})


def _start_tokenizer_process(server) -> None:
    """A large input starts the API server's tokenizer process: a SIGKILL of `loom serve` must end it too."""
    r = requests.post(server.url + "/tokenize", json={"prompt": "x " * 40_000}, timeout=120)
    assert r.status_code == 200, r.text
    assert any(is_tokenizer_process(k) for k in child_pids(serve_processes(server)["api_server"]))


def test_sigkill_of_any_process_leaves_nothing_in_dev_shm(vl_dir):
    """Four servers at once, each losing one process to SIGKILL; two before any image (their
    segment still linked: the resource tracker unlinks it), two after one (already unlinked
    once every process had mapped it). The `loom serve` parent's children see its death pipe
    close: they remove the socket and metrics directories, and the tokenizer process goes too
    (as after a SIGKILL of a text model's `loom serve`)."""
    victims = {"api_server": False, "worker": True, "engine": False, "parent": True}  # -> image first?
    runs = {v: own_run_id() for v in victims}
    tmp = tempfile.mkdtemp(prefix="lt-", dir="/tmp")   # the parent's TMPDIR; short: ipc:// paths are at most 107 bytes
    servers = {v: _start(vl_dir, runs[v], **({"TMPDIR": tmp} if v == "parent" else {})) for v in victims}
    try:
        for s in servers.values():
            s.wait_healthy()
        assert all(_segments(r) for r in runs.values()), "each server has its own segment"
        made = sorted(os.listdir(tmp))
        assert any(n.startswith("loom-ipc-") for n in made) and any(n.startswith("loom-metrics-") for n in made), made
        for v, image_first in victims.items():
            if image_first:
                _image_request(servers[v])
        _start_tokenizer_process(servers["parent"])
        pids = {v: [str(p) for p in _procs(s).values()] for v, s in servers.items()}
        ours = lambda: {n for n in shm_entries() if any(p in n for ps in pids.values() for p in ps)}   # ring, weights
        for v, s in servers.items():
            os.kill(_procs(s)[v], signal.SIGKILL)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and (any(s.descendants() for s in servers.values()) or ours()
                                               or any(_segments(r) for r in runs.values()) or os.listdir(tmp)):
            time.sleep(0.2)
        assert not {v: _segments(r) for v, r in runs.items() if _segments(r)}, "segments left in /dev/shm"
        assert not {v: s.descendants() for v, s in servers.items() if s.descendants()}, "processes left behind"
        assert not ours(), ours()
        assert not os.listdir(tmp), f"left behind: {os.listdir(tmp)}"
    finally:
        for s in servers.values():
            s.stop()
        shutil.rmtree(tmp, ignore_errors=True)
