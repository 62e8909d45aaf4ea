"""--generation-config / --override-generation-config: the model's sampling defaults fill the
fields a request does not set (HTTP: fields the client did not send; offline: generate() with no
SamplingParams, LLM.get_default_sampling_params()), as vLLM does."""
from __future__ import annotations

import json
import shutil

import openai
import pytest

from frontend import LLM, SamplingParams
from ipc.config import ConfigError, EngineConfig
from tests.conftest import Server

ENGINE_IN_PROCESS = True   # the offline test checks outputs only (tests/conftest.py engine_in_process)

# top_k 1 makes the default greedy whatever the temperature; top_p 1.0 equals transformers'
# default, so it is not a recommendation (vLLM reads the file's diff against the defaults)
GEN = {"temperature": 1.7, "top_k": 1, "top_p": 1.0, "repetition_penalty": 1.0, "eos_token_id": 2}
PROMPT = [12, 40, 7, 99, 150, 3, 77, 23]


@pytest.fixture(scope="module")
def model_dir(model_factory, tmp_path_factory) -> str:
    d = tmp_path_factory.mktemp("genconfig") / "model"
    shutil.copytree(model_factory("qwen3"), d)
    (d / "generation_config.json").write_text(json.dumps(GEN))
    return str(d)


def _resolve(model_dir: str, **kw) -> dict:
    return EngineConfig(model=model_dir, **kw).resolve().default_sampling_params


def test_resolve_sources(model_dir, tmp_path):
    assert _resolve(model_dir) == {"temperature": 1.7, "top_k": 1}
    assert _resolve(model_dir, generation_config="vllm") == {}
    assert _resolve(model_dir, override_generation_config='{"temperature": 0.5, "min_p": 0.1}') == \
        {"temperature": 0.5, "top_k": 1, "min_p": 0.1}
    assert _resolve(model_dir, generation_config="vllm", override_generation_config={"top_p": 0.9}) == {"top_p": 0.9}
    (tmp_path / "generation_config.json").write_text(json.dumps({"top_p": 0.8, "repetition_penalty": 1.2}))
    assert _resolve(model_dir, generation_config=str(tmp_path)) == {"top_p": 0.8, "repetition_penalty": 1.2}
    for bad in (dict(generation_config=str(tmp_path / "nowhere")), dict(override_generation_config="{nope"),
                dict(override_generation_config='{"max_tokens": 3}'), dict(override_generation_config="[1]")):
        with pytest.raises(ConfigError):
            _resolve(model_dir, **bad)


def test_offline_defaults_and_request_override(model_dir):
    llm = LLM(model_dir, max_model_len=128)
    try:
        d = llm.get_default_sampling_params()
        assert (d.temperature, d.top_k) == (1.7, 1)
        greedy = llm.generate({"prompt_token_ids": PROMPT}, SamplingParams(temperature=0, max_tokens=8,
                                                                            ignore_eos=True), use_tqdm=False)
        greedy = greedy[0].outputs[0].token_ids
        # no SamplingParams: the model's defaults (top_k 1: greedy), with the API's max_tokens 16
        out = llm.generate({"prompt_token_ids": PROMPT}, use_tqdm=False)[0].outputs[0].token_ids
        assert out[:len(greedy)] == greedy[:len(out)] and len(out) >= 1
        # explicit SamplingParams are the request's own: no top-k, so temperature 1.0 samples
        sampled = [llm.generate({"prompt_token_ids": PROMPT}, SamplingParams(seed=s, max_tokens=8, ignore_eos=True),
                                use_tqdm=False)[0].outputs[0].token_ids for s in range(3)]
        assert any(s != greedy for s in sampled)
    finally:
        llm.shutdown()


def test_http_defaults_fill_unsent_fields(model_dir):
    server = Server(model_dir, "--max-model-len", "128")
    try:
        server.wait_healthy(180)
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=60)
        name = client.models.list().data[0].id

        def complete(**kw):
            r = client.completions.create(model=name, prompt=PROMPT, max_tokens=8, extra_body={"ignore_eos": True,
                                                                                             **kw.pop("extra", {})},
                                          **kw)
            return r.choices[0].text
        greedy = complete(temperature=0)
        assert complete() == greedy                              # the default top_k 1
        assert complete(seed=3) == greedy
        # top_k sent: the default temperature (1.7) still applies to what the client left out
        a = complete(seed=3, extra={"top_k": -1})
        assert a == complete(seed=3, temperature=1.7, extra={"top_k": -1})
        assert any(complete(seed=s, extra={"top_k": -1}) != greedy for s in range(3))
        chat = client.chat.completions.create(model=name, messages=[{"role": "user", "content": "hi"}], max_tokens=6,
                                              extra_body={"ignore_eos": True})
        chat0 = client.chat.completions.create(model=name, messages=[{"role": "user", "content": "hi"}], max_tokens=6,
                                               temperature=0, extra_body={"ignore_eos": True})
        assert chat.choices[0].message.content == chat0.choices[0].message.content
    finally:
        server.stop()
