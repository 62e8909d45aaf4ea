"""gpt-oss beyond the architecture parity tests (tests/test_models.py, tests/test_arch_parity.py,
tests/test_arch_tp.py run its tiny model against HF): the MXFP4 checkpoints the released models
ship, dequantized at load."""
from __future__ import annotations

import json
import os

import pytest
import torch

from tests.tiny_models import make_tiny_model
from workers.model_loader import load_model
from workers.models.gpt_oss import FP4_VALUES, dequantize_mxfp4


def quantize_mxfp4(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """w [..., K] (K a multiple of 32) -> (blocks uint8 [..., K/32, 16], scales uint8 [..., K/32]):
    each block of 32 scaled by a power of two that puts its largest magnitude in [4, 8), then
    every value rounded to the nearest FP4 (E2M1) value, two to a byte, low nibble first."""
    x = w.float().reshape(*w.shape[:-1], w.shape[-1] // 32, 32)
    amax = x.abs().amax(-1).clamp(min=2.0 ** -60)
    exp = torch.floor(torch.log2(amax)) - 2          # 6 = 1.5 * 2^2, FP4's largest
    y = x / torch.exp2(exp)[..., None]
    magnitudes = torch.tensor(FP4_VALUES[:8])
    idx = (y.abs()[..., None] - magnitudes).abs().argmin(-1) + 8 * (y < 0)
    blocks = (idx[..., 0::2] | (idx[..., 1::2] << 4)).to(torch.uint8)
    return blocks, (exp + 127).to(torch.uint8)


def test_dequantize_mxfp4_matches_transformers(monkeypatch):
    # every nibble, every scale byte, unpacked a few rows at a time: ours keeps [E, out, in];
    # transformers' helper (the oracle) returns the transpose, HF's [E, in, out]
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    from workers.models import gpt_oss
    monkeypatch.setattr(gpt_oss, "DEQUANT_ROWS", 5)
    g = torch.Generator().manual_seed(0)
    blocks = torch.randint(0, 256, (3, 8, 4, 16), generator=g, dtype=torch.uint8)
    scales = torch.randint(0, 256, (3, 8, 4), generator=g, dtype=torch.uint8)
    for dtype in (torch.float32, torch.bfloat16):
        ours = dequantize_mxfp4(blocks, scales, dtype)
        assert ours.shape == (3, 8, 128) and ours.dtype == dtype
        want = convert_moe_packed_tensors(blocks, scales, dtype=dtype).transpose(1, 2)
        assert torch.equal(ours, want)
    with pytest.raises(ValueError, match="do not match"):
        dequantize_mxfp4(blocks, scales[..., :3], torch.float32)


def _mxfp4_checkpoint(src: str, dst: str) -> dict[str, torch.Tensor]:
    """src's tiny gpt-oss with its expert weights made MXFP4-exact (rewritten in src too), and
    dst the same model as the released checkpoints store it: `*_blocks` / `*_scales` in
    [E, out, in] and `quantization_config.quant_method == "mxfp4"`. Returns src's tensors."""
    from safetensors.torch import load_file, save_file
    weights = load_file(os.path.join(src, "model.safetensors"))
    quantized = {}
    for name in list(weights):
        if name.endswith((".experts.gate_up_proj", ".experts.down_proj")):
            blocks, scales = quantize_mxfp4(weights[name].transpose(1, 2))   # HF's [E, in, out] -> [E, out, in]
            weights[name] = dequantize_mxfp4(blocks, scales, torch.float32).transpose(1, 2).contiguous()
            quantized[f"{name}_blocks"], quantized[f"{name}_scales"] = blocks, scales
    save_file(weights, os.path.join(src, "model.safetensors"), metadata={"format": "pt"})
    rest = {n: t for n, t in weights.items() if not n.endswith((".experts.gate_up_proj", ".experts.down_proj"))}
    os.makedirs(dst, exist_ok=True)
    save_file({**rest, **quantized}, os.path.join(dst, "model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(src, "config.json")) as f:
        config = json.load(f)
    config["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": [
        "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]}
    with open(os.path.join(dst, "config.json"), "w") as f:
        json.dump(config, f)
    return weights


def test_mxfp4_checkpoint_loads_as_its_dequantized_weights(tmp_path):
    # the same weights as an fp32 checkpoint and as an MXFP4 one (blocks before scales, as the
    # files sort, and after): every parameter of the loaded models is equal, in fp32 and bf16
    src = make_tiny_model(str(tmp_path / "fp32"), "gpt_oss", intermediate_size=64)
    weights = _mxfp4_checkpoint(src, str(tmp_path / "mxfp4"))
    for dtype in (torch.float32, torch.bfloat16):
        plain = load_model(src, dtype, "cpu")
        packed = load_model(str(tmp_path / "mxfp4"), dtype, "cpu")
        ours = dict(packed.named_parameters())
        for name, p in plain.named_parameters():
            assert torch.equal(ours[name], p), name
    # the experts really are the checkpoint's: w13 is gate_up_proj's gate columns, then its up columns
    w13 = dict(plain.named_parameters())["model.layers.1.mlp.experts.w13_weight"]
    gate_up = weights["model.layers.1.mlp.experts.gate_up_proj"].to(torch.bfloat16)   # [E, H, 2I]
    assert torch.equal(w13, torch.cat([gate_up[..., 0::2], gate_up[..., 1::2]], -1).transpose(1, 2))
    # scales before blocks (another file order) load alike; a lone half is an error
    from safetensors.torch import load_file
    packed_sd = load_file(str(tmp_path / "mxfp4" / "model.safetensors"))
    model = load_model(str(tmp_path / "mxfp4"), torch.float32, "cpu", load_format="dummy")
    model.load_weights(sorted(packed_sd.items(), reverse=True))
    want = dict(load_model(src, torch.float32, "cpu").named_parameters())
    for name, p in model.named_parameters():
        assert torch.equal(want[name], p), name
    lone = [(n, t) for n, t in packed_sd.items() if not n.endswith("down_proj_scales")]
    with pytest.raises(ValueError, match="without their blocks or scales"):
        model.load_weights(lone)


def test_unsupported_quantization_is_refused(tmp_path):
    src = make_tiny_model(str(tmp_path / "m"), "gpt_oss")
    with open(os.path.join(src, "config.json")) as f:
        config = json.load(f)
    config["quantization_config"] = {"quant_method": "awq"}
    with open(os.path.join(src, "config.json"), "w") as f:
        json.dump(config, f)
    with pytest.raises(ValueError, match="awq"):
        load_model(src, torch.float32, "cpu", load_format="dummy")


def test_bench_preset_shape():
    # gpt-oss-20b's published size (20.9 B with bf16 experts), alternating layer types
    from bench.presets import PRESETS, num_params
    cfg = PRESETS["gpt-oss-20b"]
    assert round(num_params(cfg) / 1e9, 1) == 20.9
    assert cfg["layer_types"][:2] == ["sliding_attention", "full_attention"] and len(cfg["layer_types"]) == 24


# ------------------------------------------------------------ harmony (frontend/openai/harmony.py)
# openai-harmony loads the o200k vocabulary at first use (downloading it when not cached; nothing
# can be downloaded here): the tests of what needs it run only where TIKTOKEN_ENCODINGS_BASE holds
# o200k_base.tiktoken, the others build harmony's messages and parse them without it.

def _encoding_or_skip():
    from frontend.openai import harmony
    try:
        return harmony.encoding()
    except harmony.HarmonyUnavailable as e:
        pytest.skip(f"no o200k vocabulary offline (TIKTOKEN_ENCODINGS_BASE unset or empty): {e}")


TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather of a city",
                                           "parameters": {"type": "object",
                                                          "properties": {"city": {"type": "string"}}}}}]


def test_harmony_messages_from_a_chat():
    from openai_harmony import Role

    from frontend.openai.harmony import harmony_messages
    chat = [{"role": "system", "content": "Be brief."},
            {"role": "user", "content": [{"type": "text", "text": "Weather in "}, {"type": "text", "text": "Rome?"}]},
            {"role": "assistant", "reasoning_content": "Needs the tool.",
             "tool_calls": [{"id": "call_1", "type": "function",
                             "function": {"name": "get_weather", "arguments": '{"city": "Rome"}'}}]},
            {"role": "tool", "tool_call_id": "call_1", "content": '{"temp": 21}'},
            {"role": "assistant", "content": "21 degrees."}]
    msgs = harmony_messages(chat, TOOLS, "high", today="2026-11-28")
    system, dev, user, analysis, call, result, final = msgs
    assert system.author.role == Role.SYSTEM
    assert system.content[0].reasoning_effort.value == "High"
    assert system.content[0].conversation_start_date == "2026-11-28"
    assert dev.author.role == Role.DEVELOPER and dev.content[0].instructions == "Be brief."
    [tool] = dev.content[0].tools["functions"].tools
    assert tool.name == "get_weather" and tool.parameters["properties"] == {"city": {"type": "string"}}
    assert user.author.role == Role.USER and user.content[0].text == "Weather in Rome?"
    assert (analysis.channel, analysis.content[0].text) == ("analysis", "Needs the tool.")
    assert (call.channel, call.recipient, call.content_type) == ("commentary", "functions.get_weather", "json")
    assert call.content[0].text == '{"city": "Rome"}'
    assert result.author.role == Role.TOOL and result.author.name == "functions.get_weather"
    assert (result.channel, result.recipient, result.content[0].text) == ("commentary", "assistant", '{"temp": 21}')
    assert (final.channel, final.content[0].text) == ("final", "21 degrees.")
    with pytest.raises(ValueError, match="reasoning_effort"):
        harmony_messages(chat, None, "extreme")
    with pytest.raises(ValueError, match="role"):
        harmony_messages([{"role": "narrator", "content": "x"}])


def test_harmony_output_channels():
    from openai_harmony import Message, Role

    from frontend.openai.harmony import output_fields
    out = [Message.from_role_and_content(Role.ASSISTANT, "Think. ").with_channel("analysis"),
           Message.from_role_and_content(Role.ASSISTANT, "More.").with_channel("analysis"),
           Message.from_role_and_content(Role.ASSISTANT, "Let me check.").with_channel("commentary"),
           Message.from_role_and_content(Role.ASSISTANT, '{"city": "Rome"}').with_channel("commentary")
           .with_recipient("functions.get_weather").with_content_type("<|constrain|>json"),
           Message.from_role_and_content(Role.ASSISTANT, "not json").with_channel("commentary")
           .with_recipient("functions.echo")]
    reasoning, content, calls = output_fields(out)
    assert reasoning == "Think. More." and content == "Let me check."
    # arguments that are not JSON come as a JSON string: a client's json.loads(arguments) always reads them
    assert [(c.name, c.arguments) for c in calls] == [("get_weather", '{"city": "Rome"}'), ("echo", '"not json"')]
    final = [Message.from_role_and_content(Role.ASSISTANT, "Hi!").with_channel("final")]
    assert output_fields(final) == (None, "Hi!", [])


def test_harmony_chat_without_the_vocabulary_is_a_clear_500(tmp_path, monkeypatch):
    # a gpt-oss server (--reasoning-parser openai_gptoss) offline, no o200k vocabulary: a chat gets
    # a 500 saying what is missing; the server keeps serving (a completion after it). A constrained
    # chat is a 400 (a grammar from the first token leaves no channels to parse)
    from frontend.openai import harmony
    from tests.conftest import run_fake
    from tests.test_tool_parsers import _ScriptedLLM
    monkeypatch.setenv("TIKTOKEN_ENCODINGS_BASE", str(tmp_path))   # empty: fails at once, offline
    monkeypatch.setattr(harmony, "_ENCODING", None)

    async def scenario(session, url, llm):
        async with session.post(url + "/v1/chat/completions", json={
                "model": "fake", "messages": [{"role": "user", "content": "hi"}]}) as r:
            chat = r.status, await r.json()
        async with session.post(url + "/v1/chat/completions", json={
                "model": "fake", "messages": [{"role": "user", "content": "hi"}],
                "response_format": {"type": "json_object"}}) as r:
            constrained = r.status, await r.json()
        async with session.post(url + "/v1/completions", json={"model": "fake", "prompt": "hi",
                                                                "max_tokens": 4}) as r:
            completion = r.status, await r.json()
        return chat, constrained, completion

    (status, body), (k_status, k_body), (c_status, c_body) = run_fake(_ScriptedLLM(reasoning_parser="openai_gptoss"), scenario)
    assert status == 500 and "o200k_base" in body["error"]["message"]
    assert "TIKTOKEN_ENCODINGS_BASE" in body["error"]["message"]
    assert k_status == 400 and k_body["error"]["param"] == "response_format"
    assert c_status == 200 and c_body["choices"][0]["text"]


def test_harmony_chat_through_the_api_server():
    # with the vocabulary: the prompt is harmony's rendering, the output's channels become
    # reasoning_content, content and tool_calls, whole and streamed alike
    enc = _encoding_or_skip()
    from openai_harmony import Message, Role

    from frontend.openai.harmony import render_prompt
    from tests.conftest import run_fake
    from tests.test_tool_parsers import _ScriptedLLM
    channel, call_end = (enc.encode(t, allowed_special="all")[0] for t in ("<|channel|>", "<|call|>"))
    analysis = enc.render(Message.from_role_and_content(Role.ASSISTANT, "User wants weather.").with_channel("analysis"))
    # the prompt ends with "<|start|>assistant": the output starts at the first message's channel
    out = (analysis[analysis.index(channel):]
           + enc.render(Message.from_role_and_content(Role.ASSISTANT, '{"city": "Rome"}').with_channel("commentary")
                        .with_recipient("functions.get_weather").with_content_type("json"))[:-1] + [call_end])
    chat = [{"role": "user", "content": "Weather in Rome?"}]
    prompts = []

    class HarmonyLLM(_ScriptedLLM):
        def __init__(self, **config):
            super().__init__(**config)
            self.config.vocab_size = 201088   # o200k_harmony's ids

        async def generate(self, prompt_token_ids, params, request_id, **options):
            from frontend.outputs import CompletionOutput, RequestOutput
            prompts.append(list(prompt_token_ids))
            for i, t in enumerate(out):
                last = i == len(out) - 1
                yield RequestOutput(request_id, None, prompt_token_ids, [CompletionOutput(
                    0, enc.decode([t]), [t], "stop" if last else None)], finished=last)

    body = {"model": "fake", "messages": chat, "tools": TOOLS}

    async def scenario(session, url, llm):
        async with session.post(url + "/v1/chat/completions", json=body) as r:
            whole = await r.json()
        async with session.post(url + "/v1/chat/completions", json={**body, "stream": True}) as r:
            deltas = [json.loads(line[6:]) async for line in r.content if line.startswith(b"data: {")]
        return whole, deltas

    whole, deltas = run_fake(HarmonyLLM(reasoning_parser="openai_gptoss", enable_auto_tool_choice=True,
                                        tool_call_parser="gpt_oss"), scenario)
    assert prompts[0] == render_prompt(chat, TOOLS)
    assert whole["choices"][0]["finish_reason"] == "tool_calls"
    msg = whole["choices"][0]["message"]
    assert msg["reasoning_content"] == "User wants weather."
    assert [c["function"] for c in msg["tool_calls"]] == [{"name": "get_weather", "arguments": '{"city": "Rome"}'}]
    streamed = "".join(c["delta"].get("reasoning_content") or "" for d in deltas for c in d["choices"])
    from tests.test_tool_parsers import joined_calls
    calls = joined_calls([t for d in deltas for c in d["choices"] for t in c["delta"].get("tool_calls") or []])
    assert streamed == msg["reasoning_content"] and calls == [c["function"] for c in msg["tool_calls"]]


def test_harmony_output_without_its_end_token():
    # the engine stops on <|return|> and may leave it out, max_tokens may cut the answer: the
    # last message counts with what it has
    enc = _encoding_or_skip()
    from openai_harmony import Message, Role

    from frontend.openai.harmony import parse_output
    channel = enc.encode("<|channel|>", allowed_special="all")[0]
    analysis = enc.render(Message.from_role_and_content(Role.ASSISTANT, "Easy.").with_channel("analysis"))
    final = enc.render(Message.from_role_and_content(Role.ASSISTANT, "It is sunny.").with_channel("final"))
    out = analysis[analysis.index(channel):] + final
    assert parse_output(out) == ("Easy.", "It is sunny.", [])
    assert parse_output(out[:-1]) == ("Easy.", "It is sunny.", [])
    assert parse_output(out[:-3])[0] == "Easy."
