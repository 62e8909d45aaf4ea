"""A request's constraint on its output, from OpenAI's and vLLM's fields, checked before it runs:
response_format (json_object, json_schema), structured_outputs and the older guided_* fields,
and for chat the tools that tool_choice "required" or a named tool forces (as vLLM, a grammar
over the tools' parameter schemas). Every mistake is an APIError(400) naming the field."""
from __future__ import annotations

import functools
import json
from typing import Any

from frontend.openai.chat_output import ToolUse
from frontend.openai.protocol import APIError
from frontend.openai.tool_parsers import TOOL_PARSERS
from ipc.sampling_params import StructuredOutputsParams

_SO_FIELDS = ("json", "regex", "choice", "grammar", "json_object", "disable_any_whitespace")
_GUIDED = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice", "guided_grammar": "grammar"}


def may_constrain(req) -> bool:
    """Whether request_constraint or a chat's tool_use may find a grammar for xgrammar to compile
    (else finding none is cheap: no thread hop for it)."""
    return (req.response_format is not None or req.structured_outputs is not None
            or any(getattr(req, f) is not None for f in _GUIDED)
            or bool(getattr(req, "tools", None)) or getattr(req, "tool_choice", None) not in (None, "none"))


def request_constraint(req) -> StructuredOutputsParams | None:
    """The constraint of response_format / structured_outputs / guided_*: at most one of them."""
    found: list[tuple[str, StructuredOutputsParams]] = []
    rf = req.response_format
    if rf is not None:
        c = _response_format(rf)
        if c is not None:
            found.append(("response_format", c))
    if req.structured_outputs is not None:
        found.append(("structured_outputs", _structured_outputs(req.structured_outputs)))
    guided = {f: getattr(req, f) for f in _GUIDED if getattr(req, f) is not None}
    if guided:
        found.append((", ".join(guided), StructuredOutputsParams(**{_GUIDED[f]: v for f, v in guided.items()})))
    if len(found) > 1:
        raise APIError(f"give one constraint on the output, not several: {' and '.join(n for n, _ in found)}",
                       400, found[1][0].split(",")[0])
    if not found:
        return None
    name, constraint = found[0]
    check_constraint(constraint, name.split(",")[0])
    return constraint


def _response_format(rf: dict) -> StructuredOutputsParams | None:
    kind = rf.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return StructuredOutputsParams(json_object=True)
    if kind == "json_schema":
        spec = rf.get("json_schema")
        if not isinstance(spec, dict):
            raise APIError("response_format json_schema needs a 'json_schema' object with a 'schema'", 400,
                           "response_format")
        schema = spec.get("schema", spec.get("json_schema"))
        if not isinstance(schema, dict):
            raise APIError("response_format json_schema.schema must be a JSON schema object", 400, "response_format")
        return StructuredOutputsParams(json=schema)
    raise APIError(f"response_format type must be 'text', 'json_object' or 'json_schema', got {kind!r}", 400,
                   "response_format")


def _structured_outputs(so: dict) -> StructuredOutputsParams:
    unknown = sorted(k for k, v in so.items() if k not in _SO_FIELDS and v is not None)
    if unknown:
        raise APIError(f"structured_outputs: unsupported field(s) {unknown}; use one of "
                       f"{', '.join(_SO_FIELDS[:5])}", 400, "structured_outputs")
    kw = {k: v for k, v in so.items() if v is not None}
    try:
        return StructuredOutputsParams(**kw)
    except TypeError as e:
        raise APIError(f"structured_outputs: {e}", 400, "structured_outputs") from None


def check_constraint(c: StructuredOutputsParams, param: str) -> None:
    """400 for a constraint that cannot compile, before it reaches the engine (which checks again).
    xgrammar builds the grammar without the tokenizer here: cheap, and the same parser."""
    from ipc.grammar import grammar_key, xgrammar_reason
    try:
        if c.json is not None and not isinstance(c.json, (str, dict)):
            raise ValueError("json must be a JSON schema (an object or its JSON text)")
        if c.json is not None and not isinstance(json.loads(c.json) if isinstance(c.json, str) else c.json, dict):
            raise ValueError("json must be a JSON schema object")
        reason = _grammar_error(*grammar_key(c))
    except (RuntimeError, ValueError, TypeError) as e:
        reason = xgrammar_reason(e)
    if reason is not None:
        raise APIError(f"{param}: the constraint is invalid: {reason}", 400, param) from None


@functools.lru_cache(maxsize=256)
def _grammar_error(kind: str, source: str) -> str | None:
    """Why xgrammar cannot build this grammar (None: it can), per (kind, source): an offline
    batch, or API traffic, repeats one schema (0.45 ms a parse of a 3-property schema)."""
    import xgrammar as xgr
    from ipc.grammar import choice_grammar, json_schema_grammar, xgrammar_reason
    try:
        if kind in ("json", "json_compact"):
            json_schema_grammar(source, kind == "json")
        elif kind == "regex":
            xgr.Grammar.from_regex(source)
        elif kind == "grammar":
            xgr.Grammar.from_ebnf(source)
        elif kind == "choice":
            xgr.Grammar.from_ebnf(choice_grammar(json.loads(source)))
    except (RuntimeError, ValueError, TypeError) as e:
        return xgrammar_reason(e)
    return None


# ------------------------------------------------------------------ tools (chat)

def tool_use(req, config) -> tuple[ToolUse, StructuredOutputsParams | None]:
    """How the request uses its tools, and the grammar that required / named choices impose."""
    tools = check_tools(req.tools)
    choice: Any = req.tool_choice
    if choice is None:
        choice = "auto" if tools else "none"
    if choice == "none":
        return ToolUse("none"), None
    if not tools:
        raise APIError("when 'tool_choice' is given (other than 'none'), 'tools' must be a non-empty list", 400,
                       "tool_choice")
    if choice == "auto":
        if not (config.enable_auto_tool_choice and config.tool_call_parser):
            raise APIError('"auto" tool choice requires --enable-auto-tool-choice and --tool-call-parser to be set',
                           400, "tool_choice")
        return ToolUse("auto", parser=TOOL_PARSERS[config.tool_call_parser](tools)), None
    if choice == "required":
        defs, params = _lift_defs(tools)
        items = [{"type": "object", "properties": {"name": {"type": "string", "enum": [t["name"]]},
                                                    "parameters": p},
                  "required": ["name", "parameters"]} for t, p in zip(tools, params)]
        schema: dict = {"type": "array", "minItems": 1, "items": items[0] if len(items) == 1 else {"anyOf": items}}
        if req.parallel_tool_calls is False:
            schema["maxItems"] = 1
        if defs:
            schema["$defs"] = defs
        return ToolUse("required"), StructuredOutputsParams(json=schema)
    if isinstance(choice, dict) and choice.get("type") == "function" and isinstance(choice.get("function"), dict):
        name = choice["function"].get("name")
        tool = next((t for t in tools if t["name"] == name), None)
        if tool is None:
            raise APIError(f"tool_choice names the tool {name!r}, which is not in 'tools' "
                           f"({', '.join(t['name'] for t in tools)})", 400, "tool_choice")
        return ToolUse("named", name=name), StructuredOutputsParams(json=tool["parameters"])
    raise APIError("'tool_choice' must be 'none', 'auto', 'required' or "
                   '{"type": "function", "function": {"name": ...}}', 400, "tool_choice")


def _lift_defs(tools: list[dict]) -> tuple[dict, list[dict]]:
    """The tools' "$defs" (as pydantic emits them, referenced as "#/$defs/X") moved to the root
    of the schema that embeds every tool's parameters, where those references point; and each
    tool's parameters without them. As vLLM, a name defined differently by two tools is a 400."""
    defs: dict = {}
    params = []
    for t in tools:
        p = dict(t["parameters"])
        own = p.pop("$defs", None) or {}
        if not isinstance(own, dict):
            raise APIError(f"the parameters of tool {t['name']!r}: '$defs' must be an object", 400, "tools")
        for name, d in own.items():
            if defs.setdefault(name, d) != d:
                raise APIError(f"tools define {name!r} in '$defs' differently; tool_choice 'required' needs "
                               "one definition per name", 400, "tools")
        params.append(p)
    return defs, params


def check_tools(tools: list | None) -> list[dict]:
    """[{"name", "parameters"}] of the request's tools (each checked)."""
    out = []
    for i, t in enumerate(tools or []):
        fn = t.get("function") if isinstance(t, dict) else None
        if not isinstance(t, dict) or t.get("type", "function") != "function" or not isinstance(fn, dict):
            raise APIError(f'tools[{i}] must be {{"type": "function", "function": {{"name": ..., '
                           f'"parameters": ...}}}}', 400, "tools")
        if not isinstance(fn.get("name"), str) or not fn["name"]:
            raise APIError(f"tools[{i}].function.name must be a non-empty string", 400, "tools")
        params = fn.get("parameters")
        if params is None:
            params = {"type": "object", "properties": {}}
        if not isinstance(params, dict):
            raise APIError(f"tools[{i}].function.parameters must be a JSON schema object", 400, "tools")
        out.append({"name": fn["name"], "parameters": params})
    return out
