"""Pooling models (vLLM's `--runner pooling`): which task a model serves and how its hidden
states are pooled. Resolved once in the parent (EngineConfig.resolve); the workers' pooler
(workers/pooler.py) and the API servers' post-processing (frontend/pooling.py) read the result.

A pooling request is a prefill that stops there: it goes to the engine as a one-token request
(max_tokens=1, so the scheduler never gives it a decode slot), and the worker answers it with
its pooled vector instead of a sampled token."""
from __future__ import annotations

import logging
import os
from dataclasses import dataclass

logger = logging.getLogger("loom.config")

POOLING_TYPES = ("LAST", "MEAN", "CLS")
_POOLER_KEYS = {"pooling_type", "normalize", "use_activation", "activation"}
# architectures whose checkpoint is a classifier (a `score` head over the pooled state), and those
# of a bare decoder or an embedding model: `--runner auto` pools them (vLLM's suffixes)
CLASSIFIER_SUFFIXES = ("ForSequenceClassification",)
EMBEDDING_SUFFIXES = ("Model", "ForEmbedding", "EmbeddingModel")
# sentence-transformers' 1_Pooling/config.json modes, in vLLM's reading of them
_ST_MODES = {"pooling_mode_lasttoken": "LAST", "pooling_mode_mean_tokens": "MEAN", "pooling_mode_cls_token": "CLS"}


@dataclass(frozen=True)
class PoolerConfig:
    pooling_type: str = "LAST"     # the hidden state of the last token, the mean over all, or the first's
    normalize: bool = True         # embeddings are L2-normalised (embed)
    use_activation: bool = True    # classifier scores go through softmax (or sigmoid for one label)

    @classmethod
    def from_dict(cls, d: dict) -> "PoolerConfig":
        return cls(**{k: d[k] for k in ("pooling_type", "normalize", "use_activation") if k in d})


def is_classifier_architecture(arch: str | None) -> bool:
    return bool(arch) and arch.endswith(CLASSIFIER_SUFFIXES)


def is_embedding_architecture(arch: str | None) -> bool:
    return bool(arch) and arch.endswith(EMBEDDING_SUFFIXES) and not arch.endswith("ForCausalLM")


def sentence_transformers_pooling(model_dir: str) -> str | None:
    """The pooling mode of a sentence-transformers checkpoint (1_Pooling/config.json), if any."""
    import json
    path = os.path.join(model_dir, "1_Pooling", "config.json")
    if not os.path.isfile(path):
        return None
    try:
        with open(path, encoding="utf-8") as f:
            cfg = json.load(f)
    except (OSError, ValueError):
        return None
    return next((kind for key, kind in _ST_MODES.items() if isinstance(cfg, dict) and cfg.get(key)), None)


def resolve_pooling(config, hf: dict) -> None:
    """Fill config.runner, config.convert and config.pooler_config (a PoolerConfig's fields) from
    the flags and the model's config.json (with --hf-overrides merged); ConfigError on a conflict."""
    from ipc.config import ConfigError
    arch = (hf.get("architectures") or [None])[0]
    if not isinstance(config.hf_overrides, dict):
        raise ConfigError("--hf-overrides must be a JSON object")
    if config.runner == "auto":   # vLLM's: a classifier's checkpoint, or an explicit conversion, pools
        pools = (is_classifier_architecture(arch) or is_embedding_architecture(arch)
                 or config.convert in ("embed", "classify"))
        config.runner = "pooling" if pools else "generate"
    if config.runner == "generate":
        if config.convert not in ("auto", "none"):
            raise ConfigError(f"--convert {config.convert} needs --runner pooling")
        if config.pooler_config:
            raise ConfigError("--pooler-config needs --runner pooling")
        config.convert = "none"
        return
    if config.convert in ("auto", "none"):
        config.convert = "classify" if is_classifier_architecture(arch) or hf.get("classifier_from_token") else "embed"
    raw = config.pooler_config if isinstance(config.pooler_config, dict) else None
    if raw is None:
        raise ConfigError("--pooler-config must be a JSON object")
    raw = dict(raw)
    if "activation" in raw:   # (vLLM's older name)
        raw.setdefault("use_activation", raw.pop("activation"))
    unknown = set(raw) - _POOLER_KEYS
    if unknown:
        raise ConfigError(f"--pooler-config: unsupported keys {sorted(unknown)} (supported: pooling_type, "
                          "normalize, use_activation)")
    kind = str(raw.get("pooling_type") or sentence_transformers_pooling(config.model) or "LAST").upper()
    if kind not in POOLING_TYPES:
        raise ConfigError(f"--pooler-config: pooling_type must be one of {', '.join(POOLING_TYPES)}, got "
                          f"{raw.get('pooling_type')!r}")
    for key in ("normalize", "use_activation"):
        if key in raw and type(raw[key]) is not bool:
            raise ConfigError(f"--pooler-config: {key} must be true or false, got {raw[key]!r}")
    if hf.get("classifier_from_token") is not None:
        tokens = hf["classifier_from_token"]
        if not isinstance(tokens, list) or not tokens or not all(isinstance(t, str) for t in tokens):
            raise ConfigError("hf_overrides' classifier_from_token must be a list of token strings")
    config.pooler_config = {"pooling_type": kind, "normalize": raw.get("normalize", True),
                            "use_activation": raw.get("use_activation", True)}
    if kind != "LAST" and config.enable_prefix_caching:
        # a cached prefix's hidden states are never computed again: mean and CLS pooling need them all
        logger.info("--pooler-config pooling_type %s: prefix caching is off (it pools every prompt token)", kind)
        config.enable_prefix_caching = False
