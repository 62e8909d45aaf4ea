"""Beam search (`use_beam_search`, `length_penalty`), as vLLM does it: a separate path in the API
server on top of the engine, not a sampler mode. Each step asks the engine for one token of
every live beam with its top 2 x width logprobs (one request per beam: prefix caching makes the
shared prefix free), expands each beam by those tokens, and keeps the best `width` by score; a
beam that reaches an end token (EOS, or one of the request's stop_token_ids) is complete. At the
end (max_tokens) the live beams join the complete ones and the best `width` are the answer's
choices, best first.

    score = cumulative logprob / (sequence length ** length_penalty)

with vLLM's sequence length: the prompt's and the output's tokens, the end token not counted."""
from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

from frontend.outputs import CompletionOutput, Logprob, RequestOutput
from ipc.sampling_params import SamplingParams


@dataclass
class Beam:
    tokens: list[int]                       # the prompt's and the output's
    cumulative_logprob: float = 0.0
    logprobs: list[dict[int, Logprob]] = field(default_factory=list)   # each output token's step
    finish_reason: str | None = None


def beam_score(beam: Beam, end_ids: frozenset[int], length_penalty: float) -> float:
    """vLLM's get_beam_search_score."""
    n = len(beam.tokens)
    if beam.finish_reason == "stop" and beam.tokens[-1] in end_ids:
        n -= 1
    return beam.cumulative_logprob / (n ** length_penalty)


def step_params(params: SamplingParams, width: int) -> SamplingParams:
    """One token of a beam, with the logprobs of its 2 x width best continuations (more when the
    request asked for more)."""
    return SamplingParams(n=1, max_tokens=1, temperature=0.0, ignore_eos=True,
                          logprobs=max(2 * width, params.logprobs or 0))


async def _step(generate: Callable, tokens: list[int], params: SamplingParams, request_id: str,
                extra: dict) -> dict[int, Logprob]:
    """The logprobs of the next token after `tokens` (the engine's top ones)."""
    top: dict[int, Logprob] = {}
    async for out in generate(tokens, params, request_id, **extra):
        for o in out.outputs:
            for d in o.logprobs or ():
                top.update(d)
    return top


async def beam_search(generate: Callable, prompt: list[int], params: SamplingParams, length_penalty: float,
                      end_ids: frozenset[int], max_tokens: int, request_id: str, extra: dict,
                      decode: Callable[[list[int]], str]) -> AsyncIterator[RequestOutput]:
    """The request's answer, once (finished): `params.n` choices, the best beams."""
    width = params.n
    step = step_params(params, width)
    live = [Beam(list(prompt))]
    done: list[Beam] = []
    for k in range(max_tokens):
        tops = await asyncio.gather(*[_step(generate, b.tokens, step, f"{request_id}-beam{k}-{j}", extra)
                                      for j, b in enumerate(live)])
        grown: list[Beam] = []
        for beam, top in zip(live, tops):
            for token, lp in top.items():
                child = Beam(beam.tokens + [token], beam.cumulative_logprob + lp.logprob, beam.logprobs + [top])
                if token in end_ids and not params.ignore_eos:
                    child.finish_reason = "stop"
                    done.append(child)
                else:
                    grown.append(child)
        grown.sort(key=lambda b: beam_score(b, end_ids, length_penalty), reverse=True)
        live = grown[:width]
        if not live:
            break
    for b in live:
        b.finish_reason = "length"
    best = sorted(done + live, key=lambda b: beam_score(b, end_ids, length_penalty), reverse=True)[:width]
    yield RequestOutput(request_id, None, list(prompt),
                        [_choice(i, b, len(prompt), params, end_ids, decode) for i, b in enumerate(best)],
                        finished=True)


def _choice(index: int, beam: Beam, prompt_len: int, params: SamplingParams, end_ids: frozenset[int],
            decode: Callable[[list[int]], str]) -> CompletionOutput:
    out = beam.tokens[prompt_len:]
    logprobs = beam.logprobs
    if beam.finish_reason == "stop" and not params.include_stop_str_in_output:
        out, logprobs = out[:-1], logprobs[:-1]   # the end token is not text (as the engine's EOS)
    kept = None
    if params.logprobs is not None:   # the chosen token and the top `logprobs` of each step
        kept = [{t: lp for t, lp in top.items() if t == tok or (lp.rank is not None and lp.rank <= params.logprobs)}
                for tok, top in zip(out, logprobs)]
    return CompletionOutput(index, decode(out), out, beam.finish_reason, None, kept, beam.cumulative_logprob)


def check_beam_search(params: SamplingParams, structured: bool, images: bool) -> None:
    """What beam search cannot be combined with (a ValueError naming it)."""
    if structured:
        raise ValueError("use_beam_search cannot be combined with a constraint on the output "
                         "(response_format, structured_outputs, tool_choice required or named)")
    if images:
        raise ValueError("use_beam_search does not take images yet")
    if params.n < 1:
        raise ValueError("use_beam_search needs n >= 1 (the beam width)")

