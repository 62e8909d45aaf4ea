"""Grammar sources for structured outputs, shared by the API server (which checks a request's
constraint before it is sent) and the engine core (which compiles and applies it): the EBNF for
JSON schemas and choices, the cache key, xgrammar's error text, and where a prompt's thinking
stands. The compiling and the matchers are the engine core's (engine_core/structured_output.py)."""
from __future__ import annotations

import json
import re

from ipc.sampling_params import StructuredOutputsParams

# JSON grammars allow at most this many whitespace characters in a row (between tokens of the
# JSON structure): enough for indented output, too few for a weak model to loop on spaces.
MAX_JSON_WHITESPACE = 4
# the tokens that end the thinking, per --reasoning-parser
REASONING_END = {"qwen3": "</think>", "deepseek_r1": "</think>"}
REASONING_START = {"qwen3": "<think>", "deepseek_r1": "<think>"}


def grammar_key(params: StructuredOutputsParams) -> tuple[str, str]:
    """(kind, source): what a compiled grammar is cached by."""
    kind, value = params.kind()
    if kind == "json":
        # not sort_keys: properties are generated in the schema's order (a pydantic model's field order)
        value = json.dumps(json.loads(value) if isinstance(value, str) else value)
        if params.disable_any_whitespace:
            kind = "json_compact"
    elif kind == "choice":
        value = json.dumps(value)
    elif kind == "json_object":
        value = ""
    return kind, value


def compile_grammar(compiler, kind: str, source: str):
    """One xgrammar CompiledGrammar; raises ValueError with xgrammar's reason if it cannot compile."""
    try:
        if kind in ("json", "json_compact"):
            json.loads(source)
            return compiler.compile_grammar(json_schema_grammar(source, kind == "json"))
        if kind == "json_object":
            return compiler.compile_grammar(json_schema_grammar('{"type": "object"}', True, strict_mode=False))
        if kind == "regex":
            return compiler.compile_regex(source)
        if kind == "choice":
            return compiler.compile_grammar(choice_grammar(json.loads(source)))
        if kind == "grammar":
            return compiler.compile_grammar(source)
    except (RuntimeError, ValueError, TypeError) as e:
        reason = xgrammar_reason(e)
        raise ValueError(f"structured_outputs: the {kind.removesuffix('_compact')} constraint does not "
                         f"compile: {reason}") from None
    raise ValueError(f"unknown constraint kind {kind!r}")


# xgrammar 0.2.8 writes a length-bounded string's characters (minLength / maxLength) as
# [^"\\\r\n], which lets raw control characters through: invalid JSON. They get the class of
# its unbounded strings instead.
_LOOSE_STRING_CHAR = r'[^\"\\\r\n]'
_JSON_STRING_CHAR = r'[^\0-\x1f\"\\]'


def json_schema_grammar(schema: str, any_whitespace: bool, strict_mode: bool = True) -> str:
    """The EBNF of a JSON schema (whitespace bounded, see MAX_JSON_WHITESPACE). ValueError for a
    schema with a keyword the grammar would silently not enforce."""
    import xgrammar as xgr
    why = unenforced_keyword(json.loads(schema))
    if why:
        raise ValueError(why)
    grammar = xgr.Grammar.from_json_schema(schema, any_whitespace=any_whitespace, strict_mode=strict_mode,
                                           max_whitespace_cnt=MAX_JSON_WHITESPACE if any_whitespace else None)
    return str(grammar).replace(_LOOSE_STRING_CHAR, _JSON_STRING_CHAR)


# Keywords xgrammar accepts but does not enforce (its output may break them while finishing with
# "stop"); vLLM's has_xgrammar_unsupported_json_features lists most of them.
_UNENFORCED = ("contains", "minContains", "maxContains", "not", "if", "then", "else", "dependentRequired",
               "dependentSchemas", "unevaluatedItems")
# where a schema holds subschemas: one, a list of them, or a map of names to them (those under
# _UNENFORCED keywords need no visit)
_SUBSCHEMA = ("items", "additionalProperties", "propertyNames")
_SUBSCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems", "items")
_SUBSCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")


_JSON_TYPES = {"string": (str,), "integer": (int,), "number": (int, float), "boolean": (bool,),
               "null": (type(None),), "object": (dict,), "array": (list,)}


def _of_type(value, type_name) -> bool:
    if type_name == "integer" and isinstance(value, float):
        return value.is_integer()
    if isinstance(value, bool) and type_name in ("integer", "number"):
        return False
    return isinstance(value, _JSON_TYPES.get(type_name, object))


def unenforced_keyword(schema, path: str = "#") -> str | None:
    """What in a JSON schema the grammar would not enforce, or a part that admits no value (the
    output was then empty or broke the schema, and said "stop"), named by its path; None: nothing."""
    if not isinstance(schema, dict):
        return None
    for key in _UNENFORCED:
        if key in schema:
            return f"{path} uses {key!r}, which constrained decoding cannot enforce"
    if schema.get("uniqueItems") is True:
        return f"{path} uses 'uniqueItems', which constrained decoding cannot enforce"
    if isinstance(schema.get("allOf"), list) and len(schema["allOf"]) > 1:
        return f"{path} uses 'allOf' with {len(schema['allOf'])} schemas, which constrained decoding cannot enforce"
    props = schema.get("properties") if isinstance(schema.get("properties"), dict) else {}
    if isinstance(schema.get("required"), list) and schema.get("additionalProperties") in (None, False) \
            and not schema.get("patternProperties"):
        missing = [r for r in schema["required"] if r not in props]
        if missing:
            return f"{path} requires {missing[0]!r}, which its 'properties' do not define"
    why = _admits_nothing(schema)
    if why:
        return f"{path} admits no value: {why}"
    for key in _SUBSCHEMA:
        why = unenforced_keyword(schema.get(key), f"{path}/{key}")
        if why:
            return why
    for key in _SUBSCHEMA_LISTS:
        if isinstance(schema.get(key), list):
            for i, sub in enumerate(schema[key]):
                why = unenforced_keyword(sub, f"{path}/{key}/{i}")
                if why:
                    return why
    for key in _SUBSCHEMA_MAPS:
        if isinstance(schema.get(key), dict):
            for name, sub in schema[key].items():
                why = unenforced_keyword(sub, f"{path}/{key}/{name}")
                if why:
                    return why
    return None


def _admits_nothing(schema: dict) -> str | None:
    """Why a schema's own keywords (not its subschemas) admit no value, if they do."""
    for key in ("anyOf", "oneOf", "allOf", "enum"):
        if schema.get(key) == []:
            return f"an empty {key!r}"
    types = schema.get("type")
    types = [types] if isinstance(types, str) else types
    if not isinstance(types, list) or not all(isinstance(t, str) for t in types):
        return None
    for key, values in (("enum", schema.get("enum")), ("const", [schema["const"]] if "const" in schema else None)):
        if isinstance(values, list) and values and \
                not any(_of_type(v, t) for v in values for t in types):
            return f"no {key!r} value is of its 'type' {schema['type']!r}"
    return None


_LOG_PREFIX = re.compile(r"^\[[\d:]+\] [^ ]+:\d+: ")


def xgrammar_reason(e: Exception) -> str:
    """xgrammar's message without its C++ log prefix ("[21:10:27] /project/cpp/x.cc:83: ")."""
    lines = str(e).strip().splitlines()
    return _LOG_PREFIX.sub("", lines[0]) if lines else type(e).__name__


def choice_grammar(choices: list[str]) -> str:
    """EBNF whose language is exactly the given strings (JSON string escapes are EBNF's)."""
    return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)


def prompt_ended_thinking(ids: list[int], start: list[int], end: list[int]) -> bool:
    """Whether a prompt's last <think> is closed (a template that turned thinking off, or a
    continued message that closed it): its output's constraint applies from the first token,
    and the output is all content (the API server's reasoning parser agrees)."""
    return prompt_thinking(ids, start, end) == "closed"


def prompt_thinking(ids: list[int], start: list[int], end: list[int]) -> str | None:
    """"closed" when a prompt's last <think> is closed, "open" when it is not (the output starts
    inside the thinking), None when the prompt has no <think>."""
    last_start = _rfind(ids, start)
    if last_start < 0:
        return None
    return "closed" if _rfind(ids, end) > last_start else "open"


def _rfind(ids: list[int], pattern: list[int]) -> int:
    n = len(pattern)
    for i in range(len(ids) - n, -1, -1):
        if ids[i:i + n] == pattern:
            return i
    return -1
