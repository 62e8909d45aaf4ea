"""The engine's command-line options, one flag per EngineConfig field: shared by `loom serve`,
`loom bench` and `LLM(...)` (vLLM's engine/arg_utils.py)."""
from __future__ import annotations

import argparse
import dataclasses

from ipc.config import EngineConfig


class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
    """Defaults shown after every flag's help; descriptions (module docstrings) kept as written."""


class LoomParser(argparse.ArgumentParser):
    """Every flag's default is shown in --help; a usage mistake is one line on stderr and exit 2
    (argparse's full usage text would bury it). Sub-commands are LoomParsers too."""

    def __init__(self, *args, **kwargs):
        kwargs["formatter_class"] = _HelpFormatter
        kwargs.setdefault("allow_abbrev", False)   # --chat-template read as --chat-template-content-format
        super().__init__(*args, **kwargs)

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


# EngineConfig fields that are not command-line options
_INTERNAL = {"model", "model_max_len", "vocab_size", "eos_token_ids", "mm_max_item_tokens", "mm_encoder_budget",
             "mm_modality", "stepwise_prompt_tokens", "default_sampling_params", "data_parallel_rank"}


def add_engine_args(p, defaults: dict | None = None, skip: set[str] = frozenset()) -> None:
    """One flag per EngineConfig field, so `loom serve`, `loom bench` and `LLM(...)` take the same
    options; help and choices come from the field (ipc/config.py `option`). `defaults` overrides
    a field's default (bench: None where it picks its own)."""
    for f in dataclasses.fields(EngineConfig):
        if f.name in _INTERNAL or f.name in skip:
            continue
        flags = ["--" + f.name.replace("_", "-"), *f.metadata.get("aliases", ())]
        default = (defaults or {}).get(f.name, f.default)
        help_text = f.metadata.get("help", "") + " (default: %(default)s)"
        if f.type in ("bool", bool):
            p.add_argument(*flags, action=argparse.BooleanOptionalAction, default=default, help=f.metadata.get("help"))
        elif f.type in ("dict", dict):  # vLLM's two forms: --flag '{"image": 2}' and --flag.image 2
            p.add_argument(*flags, type=_json_object, default=f.default_factory(), help=help_text)
            for key in _DICT_KEYS.get(f.name, ()):
                p.add_argument(f"{flags[0]}.{key}", dest=f.name, action=_DictKey, const=key, type=int,
                               metavar="N", help=f"same as {flags[0]} '{{\"{key}\": N}}'")
        elif str(f.type).startswith("list[int]"):
            p.add_argument(*flags, type=int, nargs="+", default=default, metavar="N", help=help_text)
        else:
            kind = {"int": int, "float": float, "int | None": int, "float | None": float}.get(str(f.type), str)
            p.add_argument(*flags, type=kind, default=default, choices=f.metadata.get("choices"), help=help_text)


_DICT_KEYS = {"limit_mm_per_prompt": ("image", "video", "audio")}


def _json_object(text: str) -> dict:
    import json
    try:
        value = json.loads(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not JSON: {text!r}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"expected a JSON object, got {text!r}")
    return value


class _DictKey(argparse.Action):
    """--flag.KEY VALUE: one key of a dict-valued option."""

    def __call__(self, parser, namespace, value, option_string=None):
        merged = dict(getattr(namespace, self.dest) or {})
        merged[self.const] = value
        setattr(namespace, self.dest, merged)


def engine_config_from_args(args: argparse.Namespace) -> EngineConfig:
    names = {f.name for f in dataclasses.fields(EngineConfig)} - _INTERNAL
    return EngineConfig(model=args.model, **{n: getattr(args, n) for n in names})
