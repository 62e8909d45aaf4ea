"""The offline pooling API of `LLM` (vLLM's LLM.embed, classify, score and encode), for a model
served with runner="pooling": each prompt is prefilled once and answered with its pooled
vector, post-processed per request by frontend/pooling.py."""
from __future__ import annotations

from functools import cached_property

from frontend.pooling import (POOLING_SAMPLING_PARAMS, ClassificationOutput, EmbeddingOutput, PoolingModelInfo,
                              PoolingOutput, PoolingParams, PoolingRequestOutput, ScoringOutput, check_dimensions,
                              cosine, embedding, pair_token_ids, probabilities, score_pairs, vector)
from frontend.processing import tokenize_prompt, truncate_prompt


class PoolingMixin:
    """LLM's pooling methods; they read self.config, self.tokenizer and self.generate."""

    @cached_property
    def pooling_model(self) -> PoolingModelInfo:
        return PoolingModelInfo.of(self.config)

    def _check_task(self, task: str) -> PoolingModelInfo:
        if self.config.runner != "pooling":
            raise ValueError(f"LLM.{task} needs a pooling model: LLM(..., runner=\"pooling\") (or convert=\"embed\" / "
                             "\"classify\"); this one generates text")
        info = self.pooling_model
        if task == "classify" and info.convert != "classify":
            raise ValueError("LLM.classify needs a classifier (convert=\"classify\"); this model embeds")
        if task == "embed" and info.convert != "embed":
            raise ValueError("LLM.embed needs an embedding model (convert=\"embed\"); this model classifies")
        return info

    def _pool(self, token_id_lists: list[list[int]], use_tqdm: bool) -> list:
        return self.generate([{"prompt_token_ids": ids} for ids in token_id_lists], POOLING_SAMPLING_PARAMS,
                             use_tqdm=use_tqdm)

    def _token_ids(self, prompts, params: PoolingParams) -> list[list[int]]:
        from frontend.entrypoints.llm import _prompt_list
        return [truncate_prompt(tokenize_prompt(self.tokenizer, p)[1], params.truncate_prompt_tokens,
                                self.config.max_model_len) for p in _prompt_list(prompts)]

    @staticmethod
    def _params(pooling_params: PoolingParams | None, truncate_prompt_tokens: int | None) -> PoolingParams:
        params = pooling_params or PoolingParams()
        if truncate_prompt_tokens is not None:
            params = PoolingParams(**{**{f: getattr(params, f) for f in params.__struct_fields__},
                                      "truncate_prompt_tokens": truncate_prompt_tokens})
        return params

    def encode(self, prompts, pooling_params: PoolingParams | None = None, *, truncate_prompt_tokens: int | None = None,
               use_tqdm: bool = True, pooling_task: str = "encode") -> list[PoolingRequestOutput]:
        """The raw pooled vector of each prompt (a classifier's logits), as vLLM's LLM.encode."""
        self._check_task("encode")
        params = self._params(pooling_params, truncate_prompt_tokens)
        outs = self._pool(self._token_ids(prompts, params), use_tqdm)
        return [PoolingRequestOutput(o.request_id, PoolingOutput(vector(o.outputs[0].pooled).copy()),
                                     o.prompt_token_ids, num_cached_tokens=o.num_cached_tokens) for o in outs]

    def embed(self, prompts, *, truncate_prompt_tokens: int | None = None, use_tqdm: bool = True,
              pooling_params: PoolingParams | None = None) -> list[PoolingRequestOutput]:
        """One EmbeddingRequestOutput per prompt: `.outputs.embedding` (normalised unless
        pooling_params.normalize is False; its first `dimensions` where asked)."""
        info = self._check_task("embed")
        params = self._params(pooling_params, truncate_prompt_tokens)
        check_dimensions(params, info.hidden_size)
        outs = self._pool(self._token_ids(prompts, params), use_tqdm)
        return [PoolingRequestOutput(o.request_id, EmbeddingOutput(
            embedding(vector(o.outputs[0].pooled), params, info.pooler).tolist()), o.prompt_token_ids,
            num_cached_tokens=o.num_cached_tokens) for o in outs]

    def classify(self, prompts, *, use_tqdm: bool = True, pooling_params: PoolingParams | None = None,
                 truncate_prompt_tokens: int | None = None) -> list[PoolingRequestOutput]:
        """One ClassificationRequestOutput per prompt: `.outputs.probs` (softmax; sigmoid for one label)."""
        info = self._check_task("classify")
        params = self._params(pooling_params, truncate_prompt_tokens)
        outs = self._pool(self._token_ids(prompts, params), use_tqdm)
        return [PoolingRequestOutput(o.request_id, ClassificationOutput(
            probabilities(vector(o.outputs[0].pooled), params, info.pooler).tolist()), o.prompt_token_ids,
            num_cached_tokens=o.num_cached_tokens) for o in outs]

    def score(self, data_1, data_2, /, *, truncate_prompt_tokens: int | None = None, use_tqdm: bool = True,
              pooling_params: PoolingParams | None = None) -> list[PoolingRequestOutput]:
        """vLLM's LLM.score: one ScoringRequestOutput per pair (data_1 one text against every
        data_2, or N against N). A cross-encoder (a one-label classifier, such as Qwen3-Reranker)
        scores each pair's joint prompt; an embedding model the cosine of the two embeddings."""
        info = self._check_task("score")
        params = self._params(pooling_params, truncate_prompt_tokens)
        pairs = score_pairs(data_1, data_2)
        if info.cross_encoder:
            ids = [truncate_prompt(pair_token_ids(self.tokenizer, a, b), params.truncate_prompt_tokens,
                                   self.config.max_model_len) for a, b in pairs]
            outs = self._pool(ids, use_tqdm)
            return [PoolingRequestOutput(o.request_id, ScoringOutput(
                float(probabilities(vector(o.outputs[0].pooled), params, info.pooler)[0])), o.prompt_token_ids)
                for o in outs]
        if info.convert != "embed":
            raise ValueError("LLM.score needs an embedding model or a one-label classifier (a cross-encoder); "
                             f"this classifier has {len(info.labels)} labels")
        flat = [t for pair in pairs for t in pair]
        outs = self._pool(self._token_ids(flat, params), use_tqdm)
        vecs = [embedding(vector(o.outputs[0].pooled), PoolingParams(normalize=True), info.pooler) for o in outs]
        return [PoolingRequestOutput(outs[2 * i].request_id, ScoringOutput(cosine(vecs[2 * i], vecs[2 * i + 1])),
                                     outs[2 * i].prompt_token_ids + outs[2 * i + 1].prompt_token_ids)
                for i in range(len(pairs))]
