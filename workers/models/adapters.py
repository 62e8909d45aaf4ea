"""Serve a *ForCausalLM for pooling (vLLM's as_embedding_model / as_seq_cls_model, in
model_executor/models/adapters.py): the decoder stack is the causal LM's own; `pool_head`
maps the pooled hidden states to what the runner returns (workers/pooler.py).

- embed: the pooled state itself (Qwen3-Embedding).
- classify: a `score` head [num_labels, hidden] (HF's *ForSequenceClassification checkpoints),
  or one made of the vocabulary head's rows of `classifier_from_token` (hf_overrides): with
  two tokens and `is_original_qwen3_reranker` (vLLM's from_2_way_softmax), one label whose
  logit is lm_head[yes] - lm_head[no], so that sigmoid(logit) = softmax([no, yes])[yes], the
  score Qwen3-Reranker's model card computes.

The vocabulary head is not needed for pooling: it is tied to the embedding (warm-up still
computes logits once), and the checkpoint's lm_head is read only for classifier_from_token.
Checkpoints saved from the bare decoder (`layers.0...`, no `model.` prefix, as
Qwen3-Embedding's) load too."""
from __future__ import annotations

import torch
from torch import nn

from workers.models.layers import _narrow, replicated

_OWN_PREFIXES = ("model.", "lm_head.", "score.")


def num_labels(config) -> int:
    tokens = getattr(config, "classifier_from_token", None)
    if tokens:
        return 1 if _two_way(config) else len(tokens)
    id2label = getattr(config, "id2label", None)
    return int(getattr(config, "num_labels", None) or (len(id2label) if id2label else 1))


def _two_way(config) -> bool:
    tokens = getattr(config, "classifier_from_token", None) or []
    method = getattr(config, "method", None)
    return len(tokens) == 2 and (bool(getattr(config, "is_original_qwen3_reranker", False))
                                 or method == "from_2_way_softmax")


class ScoreHead(nn.Module):
    """A classifier's head, [num_labels, hidden], replicated on every rank (HF's `score` Linear)."""

    def __init__(self, num_labels: int, hidden_size: int):
        super().__init__()
        self.weight = replicated(nn.Parameter(torch.empty(num_labels, hidden_size), requires_grad=False))


def as_pooling_model(cls: type[nn.Module], convert: str) -> type[nn.Module]:
    """cls (a DecoderForCausalLM) as a pooling model for `convert` (embed or classify)."""

    class PoolingModel(cls):
        def __init__(self, config, **kwargs):
            super().__init__(config, **kwargs)
            if not self.tie_word_embeddings:   # no second vocabulary-sized matrix
                self.lm_head = self.model.embed_tokens
                self.tie_word_embeddings = True
            self.classifier_token_ids: list[int] = list(getattr(config, "classifier_from_token_ids", None) or [])
            self.score = ScoreHead(num_labels(config), config.hidden_size) if convert == "classify" else None

        def pool_head(self, pooled: torch.Tensor) -> torch.Tensor:
            """Pooled hidden states [N, hidden] -> the runner's vectors [N, D]."""
            if self.score is None:
                return pooled
            return nn.functional.linear(pooled.to(self.score.weight.dtype), self.score.weight)

        def load_weights(self, weights, partial: bool = False) -> set[str]:
            rows: dict[str, torch.Tensor] = {}   # classifier_from_token: the tokens' vocabulary rows

            def stream():
                for name, tensor in weights:
                    if not name.startswith(_OWN_PREFIXES):
                        name = "model." + name
                    if self.classifier_token_ids and name in ("lm_head.weight", "model.embed_tokens.weight"):
                        rows[name] = torch.cat([_narrow(tensor, 0, i, 1) for i in self.classifier_token_ids]).float()
                    if name.startswith("lm_head."):
                        continue
                    yield name, tensor
                if self.score is not None and self.classifier_token_ids:   # the head made of those rows
                    w = rows.get("lm_head.weight", rows.get("model.embed_tokens.weight"))
                    if w is None:
                        raise ValueError("classifier_from_token: the checkpoint has no lm_head or embedding weight")
                    yield "score.weight", (w[1] - w[0]).unsqueeze(0) if _two_way(self.config) else w

            return super().load_weights(stream(), partial)

    PoolingModel.__name__ = PoolingModel.__qualname__ = cls.__name__.replace("ForCausalLM", "ForPooling")
    return PoolingModel
