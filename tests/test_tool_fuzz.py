"""Tool-call fuzz (issue 48): for every tool parser, recorded tool-call outputs (nested objects,
strings with braces and escaped quotes, several calls, unicode) re-chunked at random, 10,000
times per parser (seeded): 0 parser exceptions, every call's streamed `arguments` deltas join
into valid JSON, and the streamed calls and content equal the non-streamed parse, which equals
what the model wrote. Some runs cut the output short at a random point (max_tokens): the
arguments streamed so far still join into valid JSON and equal the whole parse of the cut text."""
from __future__ import annotations

import json
import random

import pytest

from frontend.openai.tool_parsers import TOOL_PARSERS
from frontend.openai.tool_parsers.gpt_oss import HarmonyCalls

RUNS = 10_000
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object", "properties": {
    "city": {"type": "string"}, "days": {"type": "integer"}, "scale": {"type": "number"},
    "hot": {"type": "boolean"}, "opts": {"type": "object"}, "tags": {"type": "array"}}}}},
         {"type": "function", "function": {"name": "run", "parameters": {"type": "object", "properties": {
             "code": {"type": "string"}}}}}]

# what the calls say: the recorded outputs below write these
NESTED = {"city": "Ro{m}e \"x\" }]", "opts": {"a": [1, {"b": None, "c": [True, False]}], "d": {}}, "days": 3}
UNICODE = {"city": "Zürich 東京 🌧", "tags": ["ü", "\\", "/", "\n\t"]}
CODE = {"code": 'print("}{")\nif x: {"a": [1]}'}
SIMPLE = {"city": "Rome", "scale": 1.5, "hot": True}


def _j(d: dict) -> str:
    return json.dumps(d, ensure_ascii=False)


# parser -> [(output text, expected content, expected calls [(name, arguments)])]
RECORDED = {
    "hermes": [
        ("I will check. <tool_call>\n" + _j({"name": "get_weather", "arguments": NESTED}) + "\n</tool_call>\n"
         "<tool_call>\n" + json.dumps({"name": "get_weather", "arguments": UNICODE}) + "\n</tool_call>",
         "I will check. ", [("get_weather", NESTED), ("get_weather", UNICODE)]),
        ('<tool_call>{"name":"run","arguments":{"code":' + json.dumps(CODE["code"]) + '}}</tool_call>',
         None, [("run", CODE)]),
        ("No tools needed: <tool_call> is a tag. {\"a\": 1}", "No tools needed: <tool_call> is a tag. {\"a\": 1}", []),
    ],
    "llama3_json": [
        ("<|python_tag|>" + _j({"name": "get_weather", "parameters": NESTED}) + "; "
         + json.dumps({"name": "run", "parameters": CODE}), None, [("get_weather", NESTED), ("run", CODE)]),
        (_j({"name": "get_weather", "arguments": UNICODE}), None, [("get_weather", UNICODE)]),
        ('{"answer": "not a call", "name": "x"}', '{"answer": "not a call", "name": "x"}', []),
    ],
    "mistral": [
        ("Let me look.[TOOL_CALLS]" + _j([{"name": "get_weather", "arguments": NESTED},
                                          {"name": "run", "arguments": CODE}]),
         "Let me look.", [("get_weather", NESTED), ("run", CODE)]),
        ("[TOOL_CALLS]get_weather[ARGS]" + json.dumps(UNICODE) + "[TOOL_CALLS]run[CALL_ID]a1b2c3d4e[ARGS]"
         + _j(CODE), None, [("get_weather", UNICODE), ("run", CODE)]),
        ("Plain [TOOLS] text", "Plain [TOOLS] text", []),
    ],
    "pythonic": [
        ('[get_weather(city="Ro{m}e \\"x\\" }]", opts={"a": [1, {"b": None, "c": [True, False]}], "d": {}}, '
         'days=3), run(code=\'print("}{")\\nif x: {"a": [1]}\')]', None, [("get_weather", NESTED), ("run", CODE)]),
        ('<|python_start|>[get_weather(city="Zürich 東京 🌧", tags=["ü", "\\\\", \'/\', """\n\t"""])]<|python_end|>',
         None, [("get_weather", UNICODE)]),
        ("[1, 2, 3] are numbers", "[1, 2, 3] are numbers", []),
    ],
    "deepseek_v3": [
        ("Checking.<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\n```json\n"
         + _j(NESTED) + "\n```<｜tool▁call▁end｜>\n<｜tool▁call▁begin｜>function<｜tool▁sep｜>run\n```json\n"
         + json.dumps(CODE) + "\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>",
         "Checking.", [("get_weather", NESTED), ("run", CODE)]),
        ("<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>" + _j(UNICODE)
         + "<｜tool▁call▁end｜><｜tool▁calls▁end｜>", None, [("get_weather", UNICODE)]),
    ],
    "qwen3_coder": [
        ("Let me check.\n<tool_call>\n<function=get_weather>\n<parameter=city>\nRo{m}e \"x\" }]\n</parameter>\n"
         "<parameter=opts>\n" + json.dumps(NESTED["opts"]) + "\n</parameter>\n<parameter=days>\n3\n</parameter>\n"
         "</function>\n</tool_call>\n<tool_call>\n<function=run>\n<parameter=code>\n" + CODE["code"]
         + "\n</parameter>\n</function>\n</tool_call>", "Let me check.\n", [("get_weather", NESTED), ("run", CODE)]),
        ("<tool_call>\n<function=get_weather>\n<parameter=city>\nZürich 東京 🌧\n</parameter>\n<parameter=tags>\n"
         + json.dumps(UNICODE["tags"]) + "\n</parameter>\n<parameter=scale>\n1.5\n</parameter>\n<parameter=hot>\n"
         "true\n</parameter>\n</function>\n</tool_call>", None,
         [("get_weather", {"city": UNICODE["city"], "tags": UNICODE["tags"], "scale": 1.5, "hot": True})]),
    ],
}


def _chunks(text: str, rng: random.Random) -> list[str]:
    """`text` cut at random points (between n/40 and n/8 of them, so pieces of any size from one
    character up, every boundary as likely as any other)."""
    n = len(text)
    if n < 2:
        return [text] if text else []
    cuts = sorted(rng.sample(range(1, n), min(n - 1, rng.randint(n // 40 + 1, n // 8 + 1))))
    return [text[i:j] for i, j in zip([0] + cuts, cuts + [n])]


def _run_stream(parser, pieces: list[str]) -> tuple[str, list[tuple[str, str]], list[str]]:
    """(content, [(name, joined arguments)], ids) of a stream fed `pieces`."""
    s = parser.stream()
    content, names, args, ids = [], {}, {}, {}
    for d in [s.feed(p) for p in pieces] + [s.finish()]:
        content.append(d.content)
        for c in d.tool_calls:
            i = c["index"]
            if "id" in c:
                assert i not in names, "a call began twice"
                names[i], ids[i] = c["function"]["name"], c["id"]
            args[i] = args.get(i, "") + c["function"].get("arguments", "")
    assert sorted(names) == list(range(len(names))) and set(args) <= set(names)
    return "".join(content), [(names[i], args.get(i, "")) for i in range(len(names))], [ids[i] for i in
                                                                                       range(len(ids))]


@pytest.mark.parametrize("name", sorted(RECORDED))
def test_tool_parser_fuzz(name):
    parser = TOOL_PARSERS[name](TOOLS)
    outputs = RECORDED[name]
    whole = []
    for text, content, calls in outputs:   # the non-streamed parse reads what the model wrote
        got_content, got_calls = parser.extract(text)
        assert got_content == content, (name, text)
        assert [(c.name, json.loads(c.arguments)) for c in got_calls] == calls, (name, text)
        whole.append((text, got_content, [(c.name, c.arguments) for c in got_calls]))
    rng = random.Random(48)
    invalid = exceptions = mismatches = 0
    cut_cache: dict[tuple[int, int], tuple] = {}
    for run in range(RUNS):
        k = run % len(outputs)
        text, content, calls = whole[k]
        if run % 10 == 9:   # cut short (max_tokens): compared with the whole parse of the same cut text
            cut = rng.randint(1, len(text))
            if (k, cut) not in cut_cache:
                c, cs = parser.extract(text[:cut])
                cut_cache[k, cut] = (c, [(x.name, x.arguments) for x in cs])
            text = text[:cut]
            content, calls = cut_cache[k, cut]
        try:
            got_content, got_calls, ids = _run_stream(parser, _chunks(text, rng))
        except Exception:   # noqa: BLE001 -- counted: the target is none
            exceptions += 1
            continue
        for _, arguments in got_calls:
            try:
                json.loads(arguments)
            except ValueError:
                invalid += 1
        if got_calls != calls or (got_content if got_content.strip() or not calls else None) != content:
            mismatches += 1
    assert (exceptions, invalid, mismatches) == (0, 0, 0), name


# ------------------------------------------------------------------ gpt_oss: the arguments of harmony's call messages

HARMONY_CALLS = [[("get_weather", _j(NESTED)), ("run", json.dumps(CODE))],
                 [("get_weather", json.dumps(UNICODE, indent=2))],
                 [("lookup", "not json at all"), ("get_weather", "")]]


def test_gpt_oss_arguments_fuzz():
    """gpt-oss's calls are harmony messages (the markers are tokens, openai-harmony parses them):
    each message's content streams through HarmonyCalls. Re-chunked, and cut short, the joined
    arguments are valid JSON and equal the whole message's."""
    rng = random.Random(48)
    expected = [[(n, json.loads(a)) if a.strip().startswith("{") else (n, a.strip() or {}) for n, a in messages]
                for messages in HARMONY_CALLS]
    whole = []
    for messages, want in zip(HARMONY_CALLS, expected):
        h = HarmonyCalls()
        for n, a in messages:
            h.message(n)
            h.feed(a)
        h.finish()
        assert [(c.name, json.loads(c.arguments)) for c in h.calls] == want
        whole.append([(c.name, c.arguments) for c in h.calls])
    invalid = mismatches = 0
    for run in range(RUNS):
        k = run % len(HARMONY_CALLS)
        messages, want = HARMONY_CALLS[k], whole[k]
        cut = run % 10 == 9
        if cut:   # the last message cut short
            n, a = messages[-1]
            messages = messages[:-1] + [(n, a[:rng.randint(0, len(a))])]
            h = HarmonyCalls()
            for n, a in messages:
                h.message(n)
                h.feed(a)
            h.finish()
            want = [(c.name, c.arguments) for c in h.calls]
        h = HarmonyCalls()
        args: dict[int, str] = {}
        deltas = []
        for n, a in messages:
            h.message(n)
            deltas += [d for p in _chunks(a, rng) for d in h.feed(p).tool_calls]
        deltas += h.finish().tool_calls
        for d in deltas:
            args[d["index"]] = args.get(d["index"], "") + d["function"].get("arguments", "")
        for a in args.values():
            try:
                json.loads(a)
            except ValueError:
                invalid += 1
        if [(c.name, args.get(i, "")) for i, c in enumerate(h.calls)] != want:
            mismatches += 1
    assert (invalid, mismatches) == (0, 0)


def test_gpt_oss_token_streams_equal_the_whole_parse():
    """With the o200k vocabulary (skipped without it, offline): harmony outputs (analysis, a preamble,
    calls with nested JSON, a call with no arguments) fed to HarmonyOutput in random groups of
    token ids, and cut short: the streamed calls equal parse_output's, their arguments valid JSON."""
    from tests.test_gpt_oss import _encoding_or_skip
    enc = _encoding_or_skip()
    from openai_harmony import Message, Role

    from frontend.openai.harmony import HarmonyOutput, parse_output

    def call(name, args):
        return enc.render(Message.from_role_and_content(Role.ASSISTANT, args).with_channel("commentary")
                          .with_recipient("functions." + name).with_content_type("json"))
    channel = enc.encode("<|channel|>", allowed_special="all")[0]
    analysis = enc.render(Message.from_role_and_content(Role.ASSISTANT, "Two calls.").with_channel("analysis"))
    out = (analysis[analysis.index(channel):]
           + enc.render(Message.from_role_and_content(Role.ASSISTANT, "Checking.").with_channel("commentary"))
           + call("get_weather", _j(NESTED)) + call("run", json.dumps(CODE)) + call("ping", ""))
    rng = random.Random(48)
    for run in range(200):
        ids = out if run % 4 else out[:rng.randint(1, len(out))]
        _, _, whole = parse_output(ids)
        h = HarmonyOutput()
        deltas, i = [], 0
        while i < len(ids):
            k = rng.randint(1, 6)
            deltas += h.add(ids[i:i + k]).get("tool_calls", [])
            i += k
        deltas += h.finish().get("tool_calls", [])
        args: dict[int, str] = {}
        names = {}
        for d in deltas:
            if "id" in d:
                names[d["index"]] = d["function"]["name"]
            args[d["index"]] = args.get(d["index"], "") + d["function"].get("arguments", "")
        assert [(names[i], args[i]) for i in sorted(names)] == [(c.name, c.arguments) for c in whole]
        for a in args.values():
            json.loads(a)
        if ids is out:
            assert [(c.name, json.loads(c.arguments)) for c in whole] == [("get_weather", NESTED), ("run", CODE),
                                                                          ("ping", {})]
