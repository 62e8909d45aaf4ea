"""Pooling in the API processes (--runner pooling): vLLM's PoolingParams and output objects,
and the per-request post-processing of the vectors the workers pool (workers/pooler.py).

The engine returns each prompt's raw pooled vector (float32; a classifier's logits). What a
request asks for is applied here, per request, as vLLM's pooler would: Matryoshka truncation
(`dimensions`) then L2 normalisation for embeddings, softmax (sigmoid for one label) for
classifier probabilities, cosine similarity or the cross-encoder's sigmoid for scores.
Shared by the offline LLM (embed, classify, score, encode) and the API server
(frontend/openai/serving_pooling.py)."""
from __future__ import annotations

import json
import os
from dataclasses import dataclass, field

import msgspec
import numpy as np

from ipc.pooling import PoolerConfig
from ipc.sampling_params import SamplingParams
from ipc.validation import RequestError

# the engine request a pooling prompt becomes: a prefill that ends there (ipc/pooling.py)
POOLING_SAMPLING_PARAMS = SamplingParams(max_tokens=1, temperature=0.0)


class PoolingParams(msgspec.Struct, kw_only=True):
    """vLLM's PoolingParams. None: the model's default (--pooler-config)."""
    truncate_prompt_tokens: int | None = None
    dimensions: int | None = None        # Matryoshka: keep the first N dimensions (then normalise)
    normalize: bool | None = None        # embed: L2-normalise
    use_activation: bool | None = None   # classify / score: softmax, or sigmoid for one label
    task: str | None = None              # embed | classify | score | encode


@dataclass
class PoolingOutput:
    data: np.ndarray


@dataclass
class EmbeddingOutput:
    embedding: list[float]

    @property
    def hidden_size(self) -> int:
        return len(self.embedding)


@dataclass
class ClassificationOutput:
    probs: list[float]

    @property
    def num_classes(self) -> int:
        return len(self.probs)


@dataclass
class ScoringOutput:
    score: float


@dataclass
class PoolingRequestOutput:
    """vLLM's PoolingRequestOutput and its typed views (EmbeddingRequestOutput, ...): `outputs`
    is a PoolingOutput, EmbeddingOutput, ClassificationOutput or ScoringOutput."""
    request_id: str
    outputs: object
    prompt_token_ids: list[int]
    finished: bool = True
    num_cached_tokens: int = 0
    prompt: str | None = field(default=None, repr=False)


EmbeddingRequestOutput = ClassificationRequestOutput = ScoringRequestOutput = PoolingRequestOutput


def vector(pooled: bytes) -> np.ndarray:
    return np.frombuffer(pooled, dtype=np.float32)


def embedding(raw: np.ndarray, params: PoolingParams, pooler: PoolerConfig) -> np.ndarray:
    """An embedding as the request asks: its first `dimensions`, L2-normalised unless it says not."""
    if params.dimensions is not None:
        raw = raw[:params.dimensions]
    normalize = pooler.normalize if params.normalize is None else params.normalize
    if normalize:
        raw = raw / max(float(np.linalg.norm(raw)), 1e-12)   # (torch's F.normalize eps)
    return raw.astype(np.float32, copy=False)


def probabilities(logits: np.ndarray, params: PoolingParams, pooler: PoolerConfig) -> np.ndarray:
    """A classifier's logits as probabilities: softmax, sigmoid for a single label."""
    use = pooler.use_activation if params.use_activation is None else params.use_activation
    if not use:
        return logits
    if len(logits) == 1:
        return 1.0 / (1.0 + np.exp(-logits))
    e = np.exp(logits - logits.max())
    return e / e.sum()


def check_dimensions(params: PoolingParams, hidden_size: int) -> None:
    d = params.dimensions
    if d is not None and not 1 <= d <= hidden_size:
        raise RequestError(f"dimensions must be in [1, {hidden_size}] (the model's embedding size), got {d}",
                           "dimensions")


def cosine(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.dot(a, b) / max(float(np.linalg.norm(a) * np.linalg.norm(b)), 1e-12))


def score_pairs(data_1, data_2) -> list[tuple[object, object]]:
    """vLLM's pairing: one query against every document, or N against N."""
    one = isinstance(data_1, (str, dict))
    d1 = [data_1] if one else list(data_1)
    d2 = [data_2] if isinstance(data_2, (str, dict)) else list(data_2)
    if not d1 or not d2:
        raise RequestError("score needs at least one text on each side", "text_1")
    if len(d1) == 1:
        d1 = d1 * len(d2)
    if len(d1) != len(d2):
        raise RequestError(f"text_1 and text_2 must pair up: {len(d1)} against {len(d2)} (one text_1 scores "
                           "against every text_2)", "text_2")
    return list(zip(d1, d2))


def pair_token_ids(tokenizer, text_1: str, text_2: str, add_special_tokens: bool = True) -> list[int]:
    """A cross-encoder's prompt for a pair: the tokenizer's pair encoding (its template's
    separators; Qwen3-Reranker's client formats its own prompt template into the two texts)."""
    if not isinstance(text_1, str) or not isinstance(text_2, str):
        raise RequestError("a cross-encoder scores text pairs: text_1 and text_2 must be strings", "text_1")
    return list(tokenizer(text_1, text_pair=text_2, add_special_tokens=add_special_tokens)["input_ids"])


@dataclass(frozen=True)
class PoolingModelInfo:
    """What the API processes know of a pooling model: its task, pooler and labels."""
    convert: str                         # embed | classify
    pooler: PoolerConfig
    hidden_size: int
    labels: dict[int, str]               # classifier labels (id2label)
    cross_encoder: bool                  # a one-label classifier: /score and /rerank score pairs

    @classmethod
    def of(cls, config) -> "PoolingModelInfo":
        with open(os.path.join(config.model, "config.json"), encoding="utf-8") as f:
            hf = {**json.load(f), **(config.hf_overrides or {})}
        hf = {**hf.get("text_config", {}), **hf} if isinstance(hf.get("text_config"), dict) else hf
        tokens = hf.get("classifier_from_token")
        two_way = tokens and len(tokens) == 2 and (hf.get("is_original_qwen3_reranker")
                                                    or hf.get("method") == "from_2_way_softmax")
        if tokens:
            labels = {0: "score"} if two_way else dict(enumerate(tokens))
        else:
            labels = {int(k): str(v) for k, v in (hf.get("id2label") or {}).items()}
            if not labels and hf.get("num_labels"):
                labels = {i: f"LABEL_{i}" for i in range(int(hf["num_labels"]))}
        return cls(config.convert, PoolerConfig.from_dict(config.pooler_config), int(hf.get("hidden_size") or 0),
                   labels, config.convert == "classify" and len(labels) == 1)
