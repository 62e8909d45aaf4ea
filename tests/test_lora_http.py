"""LoRA over HTTP against one real `loom serve --enable-lora` (official openai client): adapters
from --lora-modules listed by /v1/models with their parent, selected by `model`; an unknown
adapter is a 404 in OpenAI's shape; /v1/load_lora_adapter, in-place reload and
/v1/unload_lora_adapter change the output as they should; an adapter that does not fit is a 400
with nothing loaded; vllm:lora_requests_info is exported. (Numerics: tests/test_lora.py.)"""
from __future__ import annotations

import openai
import pytest
import requests

from tests.conftest import Server, openai_client
from tests.lora_adapters import make_adapter

PROMPT = [5, 17, 33, 2, 9, 41, 7, 12]


@pytest.fixture(scope="module")
def setup(model_factory, tmp_path_factory):
    model = model_factory("llama")
    root = tmp_path_factory.mktemp("http-loras")
    paths = [make_adapter(model, str(root / f"h{i}"), seed=20 + i) for i in range(3)]
    big = make_adapter(model, str(root / "big"), seed=30, r=16)
    server = Server(model, "--enable-lora", "--max-loras", "2", "--max-lora-rank", "8",
                    "--enable-control-endpoints", "--max-model-len", "128",
                    "--lora-modules", f"h0={paths[0]}", f'{{"name": "h1", "path": "{paths[1]}"}}',
                    env={"OMP_NUM_THREADS": "1"})
    try:
        server.wait_healthy(180)
        yield server, paths, big
    finally:
        server.stop()


def _complete(client, model: str) -> str:
    out = client.completions.create(model=model, prompt=PROMPT, max_tokens=8, temperature=0)
    assert out.model == model
    return out.choices[0].text


def test_models_lists_adapters_with_parent(setup):
    server, paths, _ = setup
    client = openai_client(server)
    models = {m.id: m for m in client.models.list().data}
    base = next(m for m in models.values() if m.model_extra.get("parent") is None)
    assert {"h0", "h1"} <= set(models)
    assert models["h0"].model_extra["parent"] == base.id and models["h0"].model_extra["root"] == paths[0]
    assert client.models.retrieve("h1").id == "h1"


def test_adapters_select_by_model_and_unknown_is_404(setup):
    server, _, _ = setup
    client = openai_client(server)
    base_model = next(m.id for m in client.models.list().data if m.model_extra.get("parent") is None)
    base, h0, h1 = _complete(client, base_model), _complete(client, "h0"), _complete(client, "h1")
    assert len({base, h0, h1}) == 3
    assert _complete(client, "h0") == h0   # deterministic
    with pytest.raises(openai.NotFoundError) as e:
        client.completions.create(model="nope", prompt=PROMPT, max_tokens=2)
    assert e.value.body["type"] == "NotFoundError" and "nope" in e.value.body["message"]
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="nope", messages=[{"role": "user", "content": "hi"}], max_tokens=2)
    chat = client.chat.completions.create(model="h1", messages=[{"role": "user", "content": "hi"}], max_tokens=3)
    assert chat.model == "h1"


def test_load_inplace_unload(setup):
    server, paths, big = setup
    client = openai_client(server)
    h0, h1 = _complete(client, "h0"), _complete(client, "h1")
    url = server.url
    r = requests.post(url + "/v1/load_lora_adapter", json={"lora_name": "x", "lora_path": paths[0]})
    assert r.status_code == 200, r.text
    assert _complete(client, "x") == h0                       # the same weights as h0
    r = requests.post(url + "/v1/load_lora_adapter", json={"lora_name": "x", "lora_path": paths[1]})
    assert r.status_code == 400 and "load_inplace" in r.json()["error"]["message"]
    r = requests.post(url + "/v1/load_lora_adapter", json={"lora_name": "x", "lora_path": paths[1], "load_inplace": True})
    assert r.status_code == 200, r.text
    assert _complete(client, "x") == h1                       # replaced in place
    assert _complete(client, "h0") == h0                      # the others keep theirs
    # a third adapter beside h0 and h1 in 2 GPU slots: served by swapping slots
    r = requests.post(url + "/v1/load_lora_adapter", json={"lora_name": "z", "lora_path": paths[2]})
    assert r.status_code == 200
    z = _complete(client, "z")
    assert z not in (h0, h1) and _complete(client, "h0") == h0
    assert requests.post(url + "/v1/unload_lora_adapter", json={"lora_name": "x"}).status_code == 200
    with pytest.raises(openai.NotFoundError):
        _complete(client, "x")
    r = requests.post(url + "/v1/unload_lora_adapter", json={"lora_name": "x"})
    assert r.status_code == 404 and r.json()["error"]["type"] == "NotFoundError"
    ids = {m.id for m in client.models.list().data}
    assert "x" not in ids and "z" in ids


def test_adapter_that_does_not_fit_is_400_and_nothing_loaded(setup):
    server, _, big = setup
    client = openai_client(server)
    r = requests.post(server.url + "/v1/load_lora_adapter", json={"lora_name": "big", "lora_path": big})
    assert r.status_code == 400 and "max-lora-rank" in r.json()["error"]["message"]
    r = requests.post(server.url + "/v1/load_lora_adapter", json={"lora_name": "gone", "lora_path": "/nowhere"})
    assert r.status_code == 400
    assert not {"big", "gone"} & {m.id for m in client.models.list().data}
    assert _complete(client, "h0")   # serving on


def test_lora_requests_info_metric(setup):
    server, _, _ = setup
    _complete(openai_client(server), "h1")
    text = requests.get(server.url + "/metrics").text
    lines = [ln for ln in text.splitlines() if ln.startswith("vllm:lora_requests_info{")]
    assert lines and all('max_lora="2"' in ln for ln in lines)
    assert any('running_lora_adapters="h1"' in ln for ln in lines)
