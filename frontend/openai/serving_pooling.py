"""The pooling endpoints of a `--runner pooling` server, in vLLM's wire formats:

    POST /v1/embeddings    OpenAI's: input (string, strings, token ids, token-id lists), dimensions,
                           encoding_format float|base64
    POST /pooling          vLLM's: the raw pooled vector of each input (a classifier's logits)
    POST /classify         vLLM's: label, probs, num_classes per input
    POST /score, /v1/score vLLM's: text_1 against text_2 (one against many, or N against N)
    POST /rerank, /v1/rerank, /v2/rerank   Jina's and Cohere's: query, documents, top_n,
                           return_documents -> results sorted by relevance_score

Each input is one engine request (a prefill that ends with its pooled vector, ipc/pooling.py);
the inputs of one HTTP request share a fairness group. A cross-encoder (a one-label classifier,
such as Qwen3-Reranker under its hf_overrides) scores each pair's joint prompt; an embedding model
scores by the cosine of the two embeddings. Errors are OpenAI's error shape (APIError)."""
from __future__ import annotations

import asyncio
import base64
from typing import Any

import msgspec
import numpy as np
from aiohttp import web

from frontend.openai.protocol import APIError, now, random_id
from frontend.pooling import (POOLING_SAMPLING_PARAMS, PoolingModelInfo, PoolingParams, check_dimensions, cosine,
                              embedding, pair_token_ids, probabilities, score_pairs, vector)
from frontend.processing import truncate_prompt
from ipc.validation import RequestError

_GENERATION_PATHS = frozenset({"/v1/completions", "/v1/chat/completions", "/invocations", "/v1/responses",
                               "/v1/messages"})
MAX_INPUTS = 2048   # inputs (or documents, or pairs) in one request


class _PoolingFields(msgspec.Struct, kw_only=True):
    model: str | None = None
    user: str | None = None
    truncate_prompt_tokens: int | None = None
    add_special_tokens: bool | None = None
    priority: int | None = None


class EmbeddingRequest(_PoolingFields, kw_only=True):
    input: Any = msgspec.UNSET
    encoding_format: str = "float"
    dimensions: int | None = None
    normalize: bool | None = None


class PoolingRequest(EmbeddingRequest, kw_only=True):
    pass


class ClassificationRequest(_PoolingFields, kw_only=True):
    input: Any = msgspec.UNSET
    use_activation: bool | None = None


class ScoreRequest(_PoolingFields, kw_only=True):
    text_1: Any = msgspec.UNSET
    text_2: Any = msgspec.UNSET
    use_activation: bool | None = None


class RerankRequest(_PoolingFields, kw_only=True):
    query: Any = msgspec.UNSET
    documents: Any = msgspec.UNSET
    top_n: int | None = None
    return_documents: bool = True
    use_activation: bool | None = None


def _inputs(value: Any, param: str = "input") -> list[str | list[int]]:
    """OpenAI's input forms: "text", [ids], ["text", ...], [[ids], ...]."""
    bad = APIError(f"'{param}' must be a string, a list of token ids, a list of strings, or a list of token-id "
                   "lists", 400, param)
    if isinstance(value, str):
        return [value]
    if not isinstance(value, list) or not value:
        raise bad if value is msgspec.UNSET or not isinstance(value, list) else \
            APIError(f"'{param}' must not be empty", 400, param)
    if all(type(t) is int for t in value):
        return [list(value)]
    if all(isinstance(p, str) or (isinstance(p, list) and p and all(type(t) is int for t in p)) for p in value):
        if len(value) > MAX_INPUTS:
            raise APIError(f"'{param}' holds {len(value)} inputs, more than the maximum of {MAX_INPUTS}", 400, param)
        return list(value)
    raise bad


def _texts(value: Any, param: str) -> list[str]:
    if isinstance(value, str):
        return [value]
    if isinstance(value, list) and value and all(isinstance(t, str) for t in value):
        if len(value) > MAX_INPUTS:
            raise APIError(f"'{param}' holds {len(value)} texts, more than the maximum of {MAX_INPUTS}", 400, param)
        return value
    raise APIError(f"'{param}' must be a string or a non-empty list of strings", 400, param)


def _encode(vec: np.ndarray, fmt: str) -> list[float] | str:
    if fmt == "base64":   # little-endian float32, as OpenAI's (and the openai SDK decodes)
        return base64.b64encode(vec.astype("<f4").tobytes()).decode("ascii")
    return vec.tolist()


def _usage(num_tokens: int) -> dict:
    return {"prompt_tokens": num_tokens, "total_tokens": num_tokens, "completion_tokens": 0,
            "prompt_tokens_details": None}


class ServingPooling:
    def __init__(self, server):
        self.server = server
        config = server.config
        self.enabled = getattr(config, "runner", "generate") == "pooling"
        self.info = PoolingModelInfo.of(config) if self.enabled else None

    def with_routes(self, routes: list[tuple[str, str, Any]]) -> list[tuple[str, str, Any]]:
        """The server's routes with the pooling endpoints; a pooling runner's generation endpoints
        refuse (its requests would only pool)."""
        if self.enabled:
            routes = [(m, path, self._refuse if path in _GENERATION_PATHS else h) for m, path, h in routes]
        return routes + self.routes()

    async def _refuse(self, request: web.Request) -> web.Response:
        raise APIError(f"The model does not support {request.path}: it is served with --runner pooling "
                       f"(--convert {self.info.convert}).", 400)

    def routes(self) -> list[tuple[str, str, Any]]:
        return [("POST", "/v1/embeddings", self.embeddings), ("POST", "/pooling", self.pooling),
                ("POST", "/classify", self.classify), ("POST", "/score", self.score),
                ("POST", "/v1/score", self.score), ("POST", "/rerank", self.rerank),
                ("POST", "/v1/rerank", self.rerank), ("POST", "/v2/rerank", self.rerank)]

    # ------------------------------------------------------------ plumbing

    def _require(self, api: str, convert: str | None = None) -> PoolingModelInfo:
        if not self.enabled:
            raise APIError(f"The model does not support the {api} API: it is served for generation "
                           "(serve it with --runner pooling).", 400)
        if convert is not None and self.info.convert != convert:
            raise APIError(f"The model does not support the {api} API: it is served with --convert "
                           f"{self.info.convert}.", 400)
        return self.info

    async def _body(self, request: web.Request, cls):
        req = await self.server.body(request, cls)
        self.server._check_model(req.model)
        return req

    def _params(self, req, **fields) -> PoolingParams:
        params = PoolingParams(truncate_prompt_tokens=req.truncate_prompt_tokens, **fields)
        try:
            check_dimensions(params, self.info.hidden_size)
        except RequestError as e:
            raise APIError(str(e), 400, e.param) from None
        return params

    async def _tokenize(self, request: web.Request, inputs: list, req, param: str = "input") -> list[list[int]]:
        add_special = True if req.add_special_tokens is None else req.add_special_tokens
        limit = None if req.truncate_prompt_tokens is not None else self.server.config.max_model_len - 1
        encoded = await self.server.tokenizers.encode(request.content_length or 0, inputs, add_special, limit)
        return self._checked([ids for _, ids in encoded], req)

    def _checked(self, id_lists: list[list[int]], req) -> list[list[int]]:
        out = []
        for i, ids in enumerate(id_lists):
            try:
                ids = truncate_prompt(ids, req.truncate_prompt_tokens, self.server.config.max_model_len)
            except RequestError as e:
                raise APIError(str(e), 400, e.param) from None
            self.server._check_prompt(ids, POOLING_SAMPLING_PARAMS, i if len(id_lists) > 1 else None)
            out.append(ids)
        return out

    async def _pool(self, id_lists: list[list[int]], prefix: str, priority: int | None) -> list[np.ndarray]:
        """Each prompt's pooled vector (float32), all in flight at once."""
        self.server.check_alive()
        rid = random_id(prefix)

        async def one(i: int, ids: list[int]) -> np.ndarray:
            final = None
            async for out in self.server.llm.generate(ids, POOLING_SAMPLING_PARAMS, f"{rid}-{i}",
                                                      priority=priority or 0, group_id=rid):
                final = out
            return vector(final.outputs[0].pooled)

        try:
            return await asyncio.gather(*(one(i, ids) for i, ids in enumerate(id_lists)))
        except ValueError as e:   # the engine refused one (its own input)
            raise APIError(str(e), 400) from None

    # ------------------------------------------------------------ endpoints

    async def embeddings(self, request: web.Request) -> web.Response:
        info = self._require("Embeddings", "embed")
        req: EmbeddingRequest = await self._body(request, EmbeddingRequest)
        return await self._embed_like(request, req, info, "embedding")

    async def pooling(self, request: web.Request) -> web.Response:
        info = self._require("Pooling")
        req: PoolingRequest = await self._body(request, PoolingRequest)
        return await self._embed_like(request, req, info, "pooling")

    async def _embed_like(self, request: web.Request, req: EmbeddingRequest, info: PoolingModelInfo,
                          kind: str) -> web.Response:
        if req.encoding_format not in ("float", "base64"):
            raise APIError(f"encoding_format must be 'float' or 'base64', got {req.encoding_format!r}", 400,
                           "encoding_format")
        params = self._params(req, dimensions=req.dimensions, normalize=req.normalize)
        ids = await self._tokenize(request, _inputs(req.input), req)
        raw = await self._pool(ids, "embd" if kind == "embedding" else "pool", req.priority)
        if kind == "embedding":
            vecs = [embedding(v, params, info.pooler) for v in raw]
            data = [{"index": i, "object": "embedding", "embedding": _encode(v, req.encoding_format)}
                    for i, v in enumerate(vecs)]
        else:   # the raw vector (an embedding model's normalised unless normalize is false)
            vecs = [embedding(v, params, info.pooler) if info.convert == "embed" else v for v in raw]
            data = [{"index": i, "object": "pooling", "data": _encode(v, req.encoding_format)}
                    for i, v in enumerate(vecs)]
        n = sum(map(len, ids))
        return _json({"id": random_id("embd" if kind == "embedding" else "pool"), "object": "list",
                      "created": now(), "model": self.server.model_name, "data": data, "usage": _usage(n)})

    async def classify(self, request: web.Request) -> web.Response:
        info = self._require("Classification", "classify")
        req: ClassificationRequest = await self._body(request, ClassificationRequest)
        params = self._params(req, use_activation=req.use_activation)
        ids = await self._tokenize(request, _inputs(req.input), req)
        raw = await self._pool(ids, "classify", req.priority)
        data = []
        for i, logits in enumerate(raw):
            probs = probabilities(logits, params, info.pooler)
            best = int(np.argmax(probs))
            data.append({"index": i, "label": info.labels.get(best, f"LABEL_{best}"), "probs": probs.tolist(),
                         "num_classes": len(probs)})
        return _json({"id": random_id("classify"), "object": "list", "created": now(),
                      "model": self.server.model_name, "data": data, "usage": _usage(sum(map(len, ids)))})

    async def _scores(self, request: web.Request, pairs: list[tuple[str, str]], req) -> tuple[list[float], int]:
        """One score per pair, and the prompt tokens they took."""
        info = self.info
        params = self._params(req, use_activation=req.use_activation)
        if info.cross_encoder:
            add_special = True if req.add_special_tokens is None else req.add_special_tokens
            size = sum(len(a) + len(b) for a, b in pairs)
            try:
                ids = await self.server.tokenizers.run(size, lambda tok: [pair_token_ids(tok, a, b, add_special)
                                                                          for a, b in pairs])
            except RequestError as e:
                raise APIError(str(e), 400, e.param) from None
            ids = self._checked(ids, req)
            raw = await self._pool(ids, "score", req.priority)
            return [float(probabilities(v, params, info.pooler)[0]) for v in raw], sum(map(len, ids))
        if info.convert != "embed":
            raise APIError(f"The model does not support the Score API: a classifier with {len(info.labels)} labels "
                           "is not a cross-encoder (one label).", 400)
        texts = sorted({t for pair in pairs for t in pair})   # each distinct text embedded once
        ids = await self._tokenize(request, texts, req)
        raw = await self._pool(ids, "score", req.priority)
        vecs = dict(zip(texts, raw))
        return [cosine(vecs[a], vecs[b]) for a, b in pairs], sum(map(len, ids))

    async def score(self, request: web.Request) -> web.Response:
        self._require("Score")
        req: ScoreRequest = await self._body(request, ScoreRequest)
        t1, t2 = _texts(req.text_1, "text_1"), _texts(req.text_2, "text_2")
        try:
            pairs = score_pairs(t1 if len(t1) > 1 else t1[0], t2)
        except RequestError as e:
            raise APIError(str(e), 400, e.param) from None
        scores, n = await self._scores(request, pairs, req)
        data = [{"index": i, "object": "score", "score": s} for i, s in enumerate(scores)]
        return _json({"id": random_id("score"), "object": "list", "created": now(), "model": self.server.model_name,
                      "data": data, "usage": _usage(n)})

    async def rerank(self, request: web.Request) -> web.Response:
        self._require("Rerank")
        req: RerankRequest = await self._body(request, RerankRequest)
        if not isinstance(req.query, str):
            raise APIError("'query' must be a string", 400, "query")
        docs = req.documents
        if isinstance(docs, list) and all(isinstance(d, dict) and isinstance(d.get("text"), str) for d in docs):
            docs = [d["text"] for d in docs]   # Cohere's {"text": ...} documents
        docs = _texts(docs, "documents")
        if req.top_n is not None and req.top_n < 0:
            raise APIError(f"top_n must be non-negative, got {req.top_n}", 400, "top_n")
        scores, n = await self._scores(request, [(req.query, d) for d in docs], req)
        order = sorted(range(len(docs)), key=lambda i: -scores[i])
        if req.top_n:   # (0 or absent: every document, as vLLM)
            order = order[:req.top_n]
        results = []
        for i in order:
            r = {"index": i, "relevance_score": scores[i]}
            if req.return_documents:
                r["document"] = {"text": docs[i]}
            results.append(r)
        return _json({"id": random_id("rerank"), "model": self.server.model_name,
                      "usage": {"total_tokens": n}, "results": results})


def _json(obj: Any) -> web.Response:
    return web.Response(body=msgspec.json.encode(obj), content_type="application/json")
