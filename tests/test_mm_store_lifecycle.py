"""The multimodal store's segments never outlive a server: not after SIGTERM (tested with the
API module's server), nor after a SIGKILL of any one process (API server, engine core, worker,
the `loom serve` parent), whether or not every worker had mapped the segment yet; two servers
on one host run side by side (each run names its segments with its own id)."""
from __future__ import annotations

import os
import signal
import time

import pytest
import requests

from tests.conftest import Server, own_run_id, serve_processes
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


def _start(vl_dir, run_id):
    return Server(vl_dir, "--max-model-len", "256", "--max-num-seqs", "2", "--mm-processor-cache-gb", "0.01",
                  env={"LOOM_RUN_ID": run_id})


def test_sigkill_of_any_process_leaves_nothing_in_dev_shm(vl_dir):
    """Four servers at once, each losing one process to SIGKILL; two before any image (their
    segment still linked: the resource tracker unlinks it), two after one (already unlinked
    once every process had mapped it)."""
    victims = {"api_server": False, "worker": True, "engine": False, "parent": True}  # -> image first?
    runs = {v: own_run_id() for v in victims}
    servers = {v: _start(vl_dir, runs[v]) for v in victims}
    try:
        for s in servers.values():
            s.wait_healthy()
        assert all(_segments(r) for r in runs.values()), "each server has its own segment"
        for v, image_first in victims.items():
            if image_first:
                _image_request(servers[v])
        for v, s in servers.items():
            os.kill(_procs(s)[v], signal.SIGKILL)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and (any(s.descendants() for s in servers.values())
                                               or any(_segments(r) for r in runs.values())):
            time.sleep(0.2)
        assert not {v: _segments(r) for v, r in runs.items() if _segments(r)}, "segments left in /dev/shm"
    finally:
        for s in servers.values():
            s.stop()
