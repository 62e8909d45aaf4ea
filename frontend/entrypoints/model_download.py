"""A Hugging Face Hub id -> the local directory of its snapshot, resolved once, in the entry
point (`loom serve`, `LLM(...)`), before EngineConfig.resolve(): every process it starts gets
the local directory, so none of them calls the Hub (a warm cache starts as fast as a folder).

huggingface_hub does the work: HF_TOKEN, HF_HOME / HF_HUB_CACHE and HF_HUB_OFFLINE=1 (the cache
alone, no network) are its variables. Only what we read is downloaded: safetensors weights (the
`.bin` files only when a revision has no safetensors), JSON configs and tokenizer files."""
from __future__ import annotations

import glob
import logging
import os
import re

from ipc.config import ConfigError, EngineConfig

logger = logging.getLogger("loom")

_CONFIG_AND_TOKENIZER = ["*.json", "*.model", "*.tiktoken", "tokenizer*", "vocab*", "merges*",
                         "*chat_template*", "*.jinja"]
_REPO_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+|[A-Za-z0-9][\w.-]*")


def is_hub_id(name: str) -> bool:
    """A name that is no local path and reads as ORG/NAME (or NAME)."""
    return not os.path.exists(name) and not name.startswith((".", "/", "~")) and bool(_REPO_ID.fullmatch(name))


def resolve_hub_model(config: EngineConfig) -> EngineConfig:
    """config.model (and config.tokenizer) given as Hub ids -> their snapshots' directories;
    a local directory is left as it is. The served name stays the id, as vLLM's."""
    model_id, tokenizer_id = config.model, config.tokenizer
    tokenizer_revision = config.tokenizer_revision
    if is_hub_id(model_id):
        config.model = download(model_id, config.revision, config.download_dir, weights=True,
                                code=config.trust_remote_code)
        if config.served_model_name is None:
            config.served_model_name = model_id
        if tokenizer_id is None and tokenizer_revision not in (None, config.revision):
            tokenizer_id = model_id   # the model's tokenizer at another revision
    if tokenizer_id is not None and is_hub_id(tokenizer_id):
        config.tokenizer = download(tokenizer_id, tokenizer_revision, config.download_dir, weights=False,
                                    code=config.trust_remote_code)
    return config


def download(repo_id: str, revision: str | None, cache_dir: str | None, weights: bool, code: bool) -> str:
    """The local snapshot directory of repo_id at revision: from the cache, else downloaded.
    ConfigError (one line, exit 2) when it is neither cached nor reachable."""
    patterns = list(_CONFIG_AND_TOKENIZER) + (["*.py"] if code else [])   # (remote tokenizer code)
    path = _snapshot(repo_id, revision, cache_dir, patterns + (["*.safetensors"] if weights else []))
    if weights and not glob.glob(os.path.join(path, "*.safetensors")):
        # no safetensors in this revision: the PyTorch checkpoint (loaded with weights_only=True)
        path = _snapshot(repo_id, revision, cache_dir, patterns + ["*.bin"])
    return path


def _snapshot(repo_id: str, revision: str | None, cache_dir: str | None, allow_patterns: list[str]) -> str:
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError, RepositoryNotFoundError
    at = f" at revision {revision!r}" if revision else ""
    try:
        return snapshot_download(repo_id, revision=revision, cache_dir=cache_dir, allow_patterns=allow_patterns)
    except RepositoryNotFoundError:   # (also a private or gated repository without HF_TOKEN)
        raise ConfigError(f"model {repo_id!r}: no such repository on the Hugging Face Hub, or not "
                          "accessible (HF_TOKEN), and no such local directory") from None
    except LocalEntryNotFoundError:
        offline = " (HF_HUB_OFFLINE is set)" if _offline() else ""
        raise ConfigError(f"model {repo_id!r}{at} is not in the Hugging Face cache and the Hub cannot be "
                          f"reached{offline}; download it first, or give a local directory") from None
    except (HfHubHTTPError, OSError, ValueError) as e:   # a revision not found, a network error, a bad id
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ConfigError(f"model {repo_id!r}{at}: {first}") from None


def _offline() -> bool:
    from huggingface_hub import constants
    return bool(constants.HF_HUB_OFFLINE)
