"""Models given by Hugging Face Hub id (frontend/entrypoints/model_download.py), with no network:
a Hub cache is built on disk (models--ORG--NAME/snapshots/REV, refs/BRANCH) from a tiny model,
and huggingface_hub reads it with HF_HUB_OFFLINE=1."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest

from frontend.entrypoints.model_download import resolve_hub_model
from ipc.config import ConfigError, EngineConfig

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
REV_MAIN = "a" * 40
REV_V2 = "b" * 40


def add_snapshot(cache: str, repo_id: str, src: str, rev: str, refs: tuple[str, ...] = ("main",)) -> str:
    """src's files as the snapshot `rev` of repo_id in the Hub cache, named by `refs`."""
    repo = os.path.join(cache, "models--" + repo_id.replace("/", "--"))
    snap = os.path.join(repo, "snapshots", rev)
    shutil.copytree(src, snap)
    os.makedirs(os.path.join(repo, "refs"), exist_ok=True)
    for ref in refs:
        with open(os.path.join(repo, "refs", ref), "w") as f:
            f.write(rev)
    return snap


@pytest.fixture
def hub_cache(tmp_path, monkeypatch) -> str:
    """An empty Hub cache under a temporary HF_HOME, offline. huggingface_hub reads its variables
    at import (transformers imported it already): its constants are set too."""
    from huggingface_hub import constants
    home = tmp_path / "hf-home"
    cache = str(home / "hub")
    os.makedirs(cache)
    for name, value in (("HF_HOME", str(home)), ("HF_HUB_CACHE", cache), ("HF_HUB_OFFLINE", "1")):
        monkeypatch.setenv(name, value)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", cache)
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    return cache


def _greedy(llm, prompts):
    from ipc.sampling_params import SamplingParams
    out = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True), use_tqdm=False)
    return [o.outputs[0].token_ids for o in out]


def test_llm_by_hub_id_generates_as_from_the_folder(hub_cache, tiny_model_dir):
    from frontend import LLM
    snap = add_snapshot(hub_cache, "org/tiny", tiny_model_dir, REV_MAIN)
    prompts = ["hello world", "the quick brown fox"]
    by_id = LLM("org/tiny", multiprocess=False, max_model_len=128, max_num_seqs=4)
    try:
        assert by_id.config.model == snap and by_id.config.model_name == "org/tiny"
        got = _greedy(by_id, prompts)
    finally:
        by_id.shutdown()
    by_dir = LLM(tiny_model_dir, multiprocess=False, max_model_len=128, max_num_seqs=4)
    try:
        assert _greedy(by_dir, prompts) == got
    finally:
        by_dir.shutdown()


def test_revision_and_tokenizer_revision_pick_their_snapshots(hub_cache, tiny_model_dir, tmp_path):
    main = add_snapshot(hub_cache, "org/tiny", tiny_model_dir, REV_MAIN)
    v2 = add_snapshot(hub_cache, "org/tiny", tiny_model_dir, REV_V2, refs=("v2",))
    assert resolve_hub_model(EngineConfig(model="org/tiny")).model == main
    config = resolve_hub_model(EngineConfig(model="org/tiny", revision="v2"))
    assert config.model == v2 and config.tokenizer is None and config.tokenizer_dir == v2
    config = resolve_hub_model(EngineConfig(model="org/tiny", revision=REV_V2, tokenizer_revision="main"))
    assert config.model == v2 and config.tokenizer == main
    # --download-dir: another cache than HF_HOME's
    other = str(tmp_path / "downloads")
    mine = add_snapshot(other, "org/tiny", tiny_model_dir, REV_V2)
    assert resolve_hub_model(EngineConfig(model="org/tiny", download_dir=other)).model == mine
    with pytest.raises(ConfigError, match="'org/tiny' at revision 'nope'"):
        resolve_hub_model(EngineConfig(model="org/tiny", revision="nope"))
    # a local directory is never looked up
    assert resolve_hub_model(EngineConfig(model=tiny_model_dir)).model == tiny_model_dir


def _loom(*args: str, env: dict) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "frontend.entrypoints.cli", *args], cwd=ROOT, capture_output=True,
                          text=True, timeout=120, env={**os.environ, **env})


@pytest.mark.parametrize("how", ["offline", "unreachable"])
def test_an_id_not_in_the_cache_fails_in_one_line(tmp_path, how):
    """HF_HUB_OFFLINE=1, or a Hub that cannot be reached: exit 2 with one line, before any
    engine starts (nothing else is logged)."""
    env = {"HF_HOME": str(tmp_path / "hf-home"), "HF_HUB_OFFLINE": "1" if how == "offline" else "0",
           "HF_ENDPOINT": "http://127.0.0.1:9", "HF_HUB_ETAG_TIMEOUT": "2", "HF_HUB_DOWNLOAD_TIMEOUT": "2"}
    r = _loom("serve", "org/not-cached", "--port", "0", env=env)
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 2 and len(lines) == 1 and "Traceback" not in r.stderr, r.stderr
    assert "'org/not-cached'" in lines[0] and "not in the Hugging Face cache" in lines[0], lines[0]


def test_a_snapshot_with_only_bin_weights_loads(hub_cache, tiny_model_dir, tmp_path):
    import torch
    from safetensors.torch import load_file
    from workers.model_loader import load_model
    src = tmp_path / "bin-only"
    shutil.copytree(tiny_model_dir, src)
    state = load_file(str(src / "model.safetensors"))
    os.remove(src / "model.safetensors")
    torch.save(state, src / "pytorch_model.bin")
    snap = add_snapshot(hub_cache, "org/tiny-bin", str(src), REV_MAIN)
    config = resolve_hub_model(EngineConfig(model="org/tiny-bin"))
    assert config.model == snap
    from_bin = load_model(config.model, torch.float32, "cpu").state_dict()
    from_st = load_model(tiny_model_dir, torch.float32, "cpu").state_dict()
    assert from_bin.keys() == from_st.keys()
    for name, t in from_st.items():
        assert torch.equal(from_bin[name], t), name


def test_only_weights_and_tokenizer_files_are_asked_for(hub_cache, tiny_model_dir, tmp_path, monkeypatch):
    """snapshot_download's allow_patterns (seen through the real call, on the cache): safetensors,
    configs and tokenizer files; the .bin files only for a revision without safetensors."""
    import huggingface_hub
    real, asked = huggingface_hub.snapshot_download, []

    def spy(*args, **kwargs):
        asked.append(kwargs["allow_patterns"])
        return real(*args, **kwargs)
    monkeypatch.setattr(huggingface_hub, "snapshot_download", spy)
    add_snapshot(hub_cache, "org/tiny", tiny_model_dir, REV_MAIN)
    resolve_hub_model(EngineConfig(model="org/tiny"))
    assert len(asked) == 1 and "*.safetensors" in asked[0] and "*.json" in asked[0]
    assert not any(p.endswith((".bin", ".py", ".pt", ".h5", ".msgpack")) for p in asked[0]), asked
    src = tmp_path / "bin-only"
    shutil.copytree(tiny_model_dir, src)
    os.rename(src / "model.safetensors", src / "pytorch_model.bin")
    add_snapshot(hub_cache, "org/tiny-bin", str(src), REV_MAIN)
    asked.clear()
    resolve_hub_model(EngineConfig(model="org/tiny-bin", trust_remote_code=True))
    assert len(asked) == 2 and "*.bin" in asked[1] and "*.safetensors" not in asked[1] and "*.py" in asked[1]
    asked.clear()   # a tokenizer alone: no weights at all
    resolve_hub_model(EngineConfig(model=tiny_model_dir, tokenizer="org/tiny"))
    assert len(asked) == 1 and not any(p.endswith((".safetensors", ".bin")) for p in asked[0])


def test_eos_from_the_tokenizer_when_the_configs_name_none(tiny_model_dir, tmp_path):
    from transformers import AutoTokenizer
    d = tmp_path / "no-eos"
    shutil.copytree(tiny_model_dir, d)
    for name in ("config.json", "generation_config.json"):
        path = d / name
        if path.exists():
            cfg = json.loads(path.read_text())
            cfg.pop("eos_token_id", None)
            path.write_text(json.dumps(cfg))
    eos = AutoTokenizer.from_pretrained(str(d)).eos_token_id
    assert eos is not None
    assert EngineConfig(model=str(d), max_model_len=64).resolve().eos_token_ids == [eos]
    # the configs' ids come first; the tokenizer's is added once
    assert EngineConfig(model=tiny_model_dir, max_model_len=64).resolve().eos_token_ids == [eos]


def test_served_model_name_without_a_model_is_one_line(capsys):
    from frontend.entrypoints.cli import main
    with pytest.raises(SystemExit) as e:
        main(["serve", "--served-model-name", "x"])
    lines = capsys.readouterr().err.strip().splitlines()
    assert e.value.code == 2 and len(lines) == 1 and "required: model" in lines[0], lines


def test_a_warm_cache_resolves_without_the_network(hub_cache, tiny_model_dir, monkeypatch):
    """HF_HUB_OFFLINE=1 and the id in the cache: resolved with no connection opened (the cost of
    an id over a folder is huggingface_hub's import and a look at the cache: bench/RESULTS.md)."""
    import socket
    snap = add_snapshot(hub_cache, "org/tiny", tiny_model_dir, REV_MAIN)

    opened = []

    def no_network(*args, **kwargs):
        opened.append(args)   # (recorded: huggingface_hub would catch an error and use the cache)
        raise OSError("no network in this test")
    monkeypatch.setattr(socket.socket, "connect", no_network)
    monkeypatch.setattr(socket, "create_connection", no_network)
    assert resolve_hub_model(EngineConfig(model="org/tiny")).model == snap
    assert opened == []


def test_a_warm_cache_serves_when_the_hub_cannot_be_reached(tmp_path, tiny_model_dir):
    """Online (no HF_HUB_OFFLINE) but the Hub unreachable: huggingface_hub falls back to the cache."""
    home = tmp_path / "hf-home"
    snap = add_snapshot(str(home / "hub"), "org/tiny", tiny_model_dir, REV_MAIN)
    code = ("from frontend.entrypoints.model_download import resolve_hub_model\n"
            "from ipc.config import EngineConfig\n"
            "print(resolve_hub_model(EngineConfig(model='org/tiny')).model)")
    env = {**os.environ, "HF_HOME": str(home), "HF_HUB_OFFLINE": "0", "HF_ENDPOINT": "http://127.0.0.1:9",
           "HF_HUB_ETAG_TIMEOUT": "2", "HF_HUB_DOWNLOAD_TIMEOUT": "2"}
    env.pop("HF_HUB_CACHE", None)
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60, env=env)
    assert r.returncode == 0 and r.stdout.strip().splitlines()[-1] == snap, r.stderr
