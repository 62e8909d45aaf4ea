"""Pooling models (issue 48, item 3): `--runner pooling` on the Qwen3 architecture.

The oracle is HF transformers on the same tiny random float32 weights: last-token, mean and CLS
pooling against Qwen3Model's last_hidden_state (cosine >= 0.9999), a *ForSequenceClassification
checkpoint's `score` head against HF's Qwen3ForSequenceClassification, and the Qwen3-Reranker
conversion (hf_overrides classifier_from_token + is_original_qwen3_reranker) against the model
card's computation: softmax over the [no, yes] logits of the causal LM's last token. Prompts are
longer than the step's token budget, so that they are pooled across prefill chunks.

Then ONE real `loom serve --runner pooling`: the official openai SDK's embeddings.create (float,
base64, dimensions), token-id inputs, /pooling, /score, /rerank, /v1/rerank and /v2/rerank in
vLLM's (Jina's, Cohere's) wire formats, and bad input answered with a 4xx in OpenAI's error shape
while the server keeps serving."""
from __future__ import annotations

import json
import os

import numpy as np
import pytest
import requests
import torch

from tests.conftest import openai_client, running_server

PROMPTS = ["Hello world! How are you today?",
           "The quick brown fox jumps over the lazy dog. " * 6,   # ~ 100 tokens: several chunks of 32
           "Simple is better than complex."]
LLM_OPTS = dict(multiprocess=False, runner="pooling", max_model_len=256, max_num_seqs=4, max_num_batched_tokens=32)


def _cos(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(a @ b / np.linalg.norm(a) / np.linalg.norm(b))


def _hf_hidden(model_dir: str, ids: list[int]) -> torch.Tensor:
    from transformers import AutoModel
    hf = AutoModel.from_pretrained(model_dir).eval()
    with torch.no_grad():
        return hf(torch.tensor([ids])).last_hidden_state[0]


def _tokenizer(model_dir: str):
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(model_dir)


@pytest.mark.parametrize("pooling_type", ["LAST", "MEAN", "CLS"])
def test_pooling_matches_hf(tiny_model_dir, pooling_type):
    from frontend.entrypoints.llm import LLM
    tok = _tokenizer(tiny_model_dir)
    with LLM(tiny_model_dir, pooler_config={"pooling_type": pooling_type}, **LLM_OPTS) as llm:
        assert llm.config.enable_prefix_caching == (pooling_type == "LAST")
        outs = llm.embed(PROMPTS + PROMPTS[:1], use_tqdm=False)   # the repeat: LAST hits the prefix cache
    assert outs[1].prompt_token_ids == tok(PROMPTS[1])["input_ids"] and len(outs[1].prompt_token_ids) > 64
    for prompt, out in zip(PROMPTS + PROMPTS[:1], outs):
        hidden = _hf_hidden(tiny_model_dir, tok(prompt)["input_ids"])
        want = {"LAST": hidden[-1], "MEAN": hidden.mean(0), "CLS": hidden[0]}[pooling_type]
        got = np.asarray(out.outputs.embedding)
        assert _cos(got, want.numpy()) >= 0.9999
        assert abs(np.linalg.norm(got) - 1) < 1e-5   # normalised by default


def test_embed_dimensions_and_raw(tiny_model_dir):
    from frontend.entrypoints.llm import LLM
    from frontend.pooling import PoolingParams
    tok = _tokenizer(tiny_model_dir)
    with LLM(tiny_model_dir, **LLM_OPTS) as llm:
        short = llm.embed(PROMPTS[0], pooling_params=PoolingParams(dimensions=16), use_tqdm=False)[0]
        raw = llm.embed(PROMPTS[0], pooling_params=PoolingParams(normalize=False), use_tqdm=False)[0]
        encoded = llm.encode([PROMPTS[0]], use_tqdm=False)[0]
        with pytest.raises(ValueError, match="dimensions"):
            llm.embed(PROMPTS[0], pooling_params=PoolingParams(dimensions=10_000), use_tqdm=False)
        with pytest.raises(ValueError, match="classif"):
            llm.classify(PROMPTS[0], use_tqdm=False)
        scores = llm.score(PROMPTS[0], PROMPTS[1:], use_tqdm=False)   # an embedding model: cosine
        embs = [np.asarray(o.outputs.embedding) for o in llm.embed(PROMPTS, use_tqdm=False)]
    want = _hf_hidden(tiny_model_dir, tok(PROMPTS[0])["input_ids"])[-1].numpy()
    assert len(short.outputs.embedding) == 16 and abs(np.linalg.norm(short.outputs.embedding) - 1) < 1e-5
    assert _cos(short.outputs.embedding, want[:16]) >= 0.9999
    np.testing.assert_allclose(raw.outputs.embedding, want, rtol=1e-3, atol=1e-4)
    np.testing.assert_allclose(encoded.outputs.data, want, rtol=1e-3, atol=1e-4)
    assert [round(s.outputs.score, 5) for s in scores] == [round(_cos(embs[0], e), 5) for e in embs[1:]]


def test_bare_decoder_checkpoint_pools_by_default(tiny_model_dir, tmp_path):
    """A checkpoint saved from the bare decoder (Qwen3Model: `layers.0...` names, as Qwen3-Embedding's
    sentence-transformers layout) pools under --runner auto, with 1_Pooling/config.json's mode."""
    from transformers import AutoModel

    from frontend.entrypoints.llm import LLM
    out = tmp_path / "st"
    hf = AutoModel.from_pretrained(tiny_model_dir).eval()
    hf.save_pretrained(str(out), safe_serialization=True)
    _tokenizer(tiny_model_dir).save_pretrained(str(out))
    (out / "1_Pooling").mkdir()
    (out / "1_Pooling" / "config.json").write_text(json.dumps({"pooling_mode_mean_tokens": True}))
    opts = {k: v for k, v in LLM_OPTS.items() if k != "runner"}
    with LLM(str(out), **opts) as llm:
        assert (llm.config.runner, llm.config.convert) == ("pooling", "embed")
        assert llm.config.pooler_config["pooling_type"] == "MEAN"
        got = llm.embed(PROMPTS[1], use_tqdm=False)[0].outputs.embedding
    want = _hf_hidden(tiny_model_dir, _tokenizer(tiny_model_dir)(PROMPTS[1])["input_ids"]).mean(0).numpy()
    assert _cos(got, want) >= 0.9999


def _seq_cls_checkpoint(causal_dir: str, out_dir: str, num_labels: int) -> str:
    """HF's Qwen3ForSequenceClassification on the causal model's decoder, with a random score head."""
    from transformers import AutoConfig, Qwen3ForSequenceClassification
    cfg = AutoConfig.from_pretrained(causal_dir)
    cfg.num_labels = num_labels
    cfg.id2label = {i: f"class_{i}" for i in range(num_labels)}
    cfg.label2id = {v: k for k, v in cfg.id2label.items()}
    cfg.architectures = ["Qwen3ForSequenceClassification"]
    model = Qwen3ForSequenceClassification(cfg).eval()
    causal = _load_causal(causal_dir)
    model.model.load_state_dict(causal.model.state_dict())
    torch.manual_seed(1)
    with torch.no_grad():
        model.score.weight.normal_(0, 0.5)
    model.save_pretrained(out_dir, safe_serialization=True)
    _tokenizer(causal_dir).save_pretrained(out_dir)
    return out_dir


def _load_causal(model_dir: str):
    from transformers import AutoModelForCausalLM
    return AutoModelForCausalLM.from_pretrained(model_dir).eval()


def test_classifier_matches_hf(tiny_model_dir, tmp_path):
    from transformers import Qwen3ForSequenceClassification

    from frontend.entrypoints.llm import LLM
    cls_dir = _seq_cls_checkpoint(tiny_model_dir, str(tmp_path / "cls"), num_labels=3)
    tok = _tokenizer(cls_dir)
    hf = Qwen3ForSequenceClassification.from_pretrained(cls_dir).eval()
    opts = {k: v for k, v in LLM_OPTS.items() if k != "runner"}   # --runner auto: a classifier pools
    with LLM(cls_dir, **opts) as llm:
        assert (llm.config.runner, llm.config.convert) == ("pooling", "classify")
        outs = llm.classify(PROMPTS, use_tqdm=False)
        with pytest.raises(ValueError, match="embed"):
            llm.embed(PROMPTS[0], use_tqdm=False)
    for prompt, out in zip(PROMPTS, outs):
        with torch.no_grad():
            want = hf(torch.tensor([tok(prompt)["input_ids"]])).logits[0].softmax(-1).numpy()
        assert out.outputs.num_classes == 3
        np.testing.assert_allclose(out.outputs.probs, want, atol=1e-4)


def _reranker_tokens(model_dir: str) -> list[str]:
    """Two single-token words of the tiny vocabulary, standing in for Qwen3-Reranker's "no" and "yes"."""
    vocab = _tokenizer(model_dir).get_vocab()
    return [t for t in ("Ġno", "Ġdog", "Ġcat", "Ġis") if t in vocab][:2]


def test_qwen3_reranker_matches_model_card(tiny_model_dir):
    """vLLM's hf_overrides for Qwen3-Reranker: score = softmax([no, yes] logits of the last token))[yes]."""
    from frontend.entrypoints.llm import LLM
    no, yes = _reranker_tokens(tiny_model_dir)
    overrides = {"architectures": ["Qwen3ForSequenceClassification"], "classifier_from_token": [no, yes],
                 "is_original_qwen3_reranker": True}
    tok = _tokenizer(tiny_model_dir)
    hf = _load_causal(tiny_model_dir)
    query = "<|im_start|>system\nJudge whether the Document meets the requirements.<|im_end|>\n<|im_start|>user\n" \
            "<Query>: what is better?\n"
    docs = ["<Document>: Simple is better than complex.<|im_end|>\n<|im_start|>assistant\n",
            "<Document>: The quick brown fox.<|im_end|>\n<|im_start|>assistant\n"]
    opts = {k: v for k, v in LLM_OPTS.items() if k != "runner"}
    with LLM(tiny_model_dir, hf_overrides=overrides, **opts) as llm:
        assert (llm.config.runner, llm.config.convert) == ("pooling", "classify")
        scores = llm.score(query, docs, use_tqdm=False)
    ids_no, ids_yes = tok.convert_tokens_to_ids(no), tok.convert_tokens_to_ids(yes)
    for doc, out in zip(docs, scores):
        ids = tok(query)["input_ids"] + tok(doc)["input_ids"]   # the pair's prompt
        with torch.no_grad():
            last = hf(torch.tensor([ids])).logits[0, -1]
        want = torch.stack([last[ids_no], last[ids_yes]]).softmax(-1)[1].item()
        assert abs(out.outputs.score - want) < 1e-4


def test_generate_runner_refuses_pooling_options(tiny_model_dir):
    from ipc.config import ConfigError, EngineConfig
    with pytest.raises(ConfigError, match="--runner pooling"):
        EngineConfig(model=tiny_model_dir, runner="generate", convert="embed").resolve()
    with pytest.raises(ConfigError, match="pooling_type"):
        EngineConfig(model=tiny_model_dir, runner="pooling", pooler_config={"pooling_type": "MAX"}).resolve()
    with pytest.raises(ConfigError, match="unsupported keys"):
        EngineConfig(model=tiny_model_dir, runner="pooling", pooler_config={"pooling": "LAST"}).resolve()
    assert EngineConfig(model=tiny_model_dir).resolve().runner == "generate"


# ------------------------------------------------------------ one real `loom serve --runner pooling`

@pytest.fixture(scope="module")
def server(tiny_model_dir):
    with running_server(tiny_model_dir, "--runner", "pooling", "--max-model-len", "256", "--max-num-seqs", "8",
                        "--max-num-batched-tokens", "64") as s:
        yield s


@pytest.fixture(scope="module")
def hf_last(tiny_model_dir):
    tok = _tokenizer(tiny_model_dir)

    def last(text_or_ids) -> np.ndarray:
        ids = tok(text_or_ids)["input_ids"] if isinstance(text_or_ids, str) else text_or_ids
        return _hf_hidden(tiny_model_dir, ids)[-1].numpy()
    return last


def test_openai_sdk_embeddings(server, hf_last):
    client = openai_client(server)
    model = client.models.list().data[0].id
    floats = client.embeddings.create(model=model, input=PROMPTS, encoding_format="float")
    b64 = client.embeddings.create(model=model, input=PROMPTS)   # the SDK asks for base64 and decodes it
    short = client.embeddings.create(model=model, input=PROMPTS[0], dimensions=8, encoding_format="float")
    assert [d.index for d in floats.data] == [0, 1, 2] and floats.object == "list"
    n_tokens = sum(len(_tokenizer_ids(server, p)) for p in PROMPTS)
    assert floats.usage.prompt_tokens == floats.usage.total_tokens == n_tokens
    for prompt, f, b in zip(PROMPTS, floats.data, b64.data):
        assert _cos(f.embedding, hf_last(prompt)) >= 0.9999
        np.testing.assert_allclose(f.embedding, b.embedding, atol=1e-5)   # (batched apart: summation order)
    assert len(short.data[0].embedding) == 8 and abs(np.linalg.norm(short.data[0].embedding) - 1) < 1e-5
    assert _cos(short.data[0].embedding, hf_last(PROMPTS[0])[:8]) >= 0.9999


def _tokenizer_ids(server, text: str) -> list[int]:
    return requests.post(server.url + "/tokenize", json={"prompt": text}).json()["tokens"]


def test_token_id_inputs_and_pooling(server, hf_last):
    ids = [[11, 12, 13, 14, 15], [20, 21, 22] * 30]
    one = requests.post(server.url + "/v1/embeddings", json={"input": ids[0]}).json()
    both = requests.post(server.url + "/v1/embeddings", json={"input": ids}).json()
    assert len(one["data"]) == 1 and len(both["data"]) == 2 and both["usage"]["prompt_tokens"] == 95
    for i, d in enumerate(both["data"]):
        assert _cos(d["embedding"], hf_last(ids[i])) >= 0.9999
    pooled = requests.post(server.url + "/pooling", json={"input": ids[0], "normalize": False}).json()
    assert pooled["data"][0]["object"] == "pooling"
    np.testing.assert_allclose(pooled["data"][0]["data"], hf_last(ids[0]), rtol=1e-3, atol=1e-4)


def test_score_and_rerank_wire_formats(server, hf_last):
    docs = PROMPTS[1:]
    want = [_cos(hf_last(PROMPTS[0]), hf_last(d)) for d in docs]
    score = requests.post(server.url + "/score", json={"text_1": PROMPTS[0], "text_2": docs}).json()
    assert score["object"] == "list" and [d["object"] for d in score["data"]] == ["score", "score"]
    assert [d["index"] for d in score["data"]] == [0, 1]
    np.testing.assert_allclose([d["score"] for d in score["data"]], want, atol=1e-4)
    assert score["usage"]["prompt_tokens"] > 0
    v1 = requests.post(server.url + "/v1/score", json={"text_1": docs, "text_2": docs}).json()
    np.testing.assert_allclose([d["score"] for d in v1["data"]], [1.0, 1.0], atol=1e-4)
    order = sorted(range(len(docs)), key=lambda i: -want[i])
    for path in ("/rerank", "/v1/rerank", "/v2/rerank"):
        r = requests.post(server.url + path, json={"query": PROMPTS[0], "documents": docs}).json()
        assert [x["index"] for x in r["results"]] == order
        assert r["results"][0]["document"] == {"text": docs[order[0]]}
        np.testing.assert_allclose([x["relevance_score"] for x in r["results"]], [want[i] for i in order], atol=1e-4)
        assert r["usage"]["total_tokens"] > 0 and r["model"]
    cohere = requests.post(server.url + "/v2/rerank", json={
        "query": PROMPTS[0], "documents": [{"text": d} for d in docs], "top_n": 1, "return_documents": False}).json()
    assert len(cohere["results"]) == 1 and "document" not in cohere["results"][0]
    assert cohere["results"][0]["index"] == order[0]


@pytest.mark.parametrize("path,body,param", [
    ("/v1/embeddings", {"input": []}, "input"),
    ("/v1/embeddings", {"input": 5}, "input"),
    ("/v1/embeddings", {"input": "hi", "encoding_format": "int8"}, "encoding_format"),
    ("/v1/embeddings", {"input": "hi", "dimensions": 0}, "dimensions"),
    ("/v1/embeddings", {"input": "hi", "dimensions": 100000}, "dimensions"),
    ("/v1/embeddings", {"input": [[1, 2, 10 ** 9]]}, None),
    ("/v1/embeddings", {"input": "hi", "model": "nope"}, "model"),
    ("/v1/embeddings", {"input": [1] * 300}, None),   # past --max-model-len
    ("/classify", {"input": "hi"}, None),               # an embedding model
    ("/score", {"text_1": ["a", "b"], "text_2": ["a", "b", "c"]}, "text_2"),
    ("/rerank", {"query": 3, "documents": ["a"]}, "query"),
    ("/rerank", {"query": "q", "documents": []}, "documents"),
    ("/rerank", {"query": "q", "documents": ["a"], "top_n": -1}, "top_n"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 2}, None),   # a pooling runner does not generate
])
def test_bad_input_4xx(server, path, body, param):
    r = requests.post(server.url + path, data=json.dumps(body))
    assert 400 <= r.status_code < 500, (r.status_code, r.text)
    err = r.json()["error"]
    assert err["message"] and err["code"] == r.status_code
    if param is not None:
        assert err["param"] == param
    ok = requests.post(server.url + "/v1/embeddings", json={"input": "still serving"})
    assert ok.status_code == 200


def test_server_flags_in_help():
    import subprocess
    import sys
    out = subprocess.run([sys.executable, "-m", "frontend.entrypoints.cli", "serve", "--help"], capture_output=True,
                         text=True, cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__)))).stdout
    for flag in ("--runner", "--convert", "--pooler-config", "--hf-overrides"):
        assert flag in out


def test_bench_embed_tiny(server, tmp_path):
    """`loom bench embed` (bench/gpu_suite.sh pooling) against the same server: every request counted."""
    from bench import embed
    parser = __import__("argparse").ArgumentParser()
    embed.add_args(parser)
    args = parser.parse_args(["--base-url", server.url, "--input-len", "24", "--num-prompts", "12", "--concurrency",
                              "4", "--processes", "1", "--warmup", "0", "--max-token-id", "300",
                              "--result-file", str(tmp_path / "r.json")])
    assert embed.main(args) == 0
    summary = json.loads((tmp_path / "r.json").read_text())
    assert summary["requests"] == 12 and summary["errors"] == 0 and summary["prompt_tok_per_s"] > 0
