"""Turning engine outputs into /v1/completions and /v1/chat/completions responses (whole or
streamed), the way vLLM's serving_completion / serving_chat do.

One GenerationContext per HTTP request carries what every step needs (the parsed request, its
sampling parameters, the tokenized prompts, what each choice has produced so far); the helpers
take it instead of a long argument list.
"""
from __future__ import annotations

import asyncio
import functools
import logging
from dataclasses import dataclass, field
from typing import Any, AsyncIterator

import msgspec
from aiohttp import web

from frontend.errors import EngineDeadError, engine_dead_message
from frontend.openai.protocol import (SSE_DONE, TEXT_SLOT, APIError, ChunkFrame, chat_choice, chat_chunk,
                               chat_chunk_choice, chat_logprobs, chat_response, chunk_template, completion_choice,
                               completion_logprobs, completion_response, encode_json, error_body,
                               merge_completion_logprobs, prompt_logprobs_json, sse, usage)
from frontend.openai.chat_output import ChatOutput, ToolUse
from frontend.outputs import RequestFault
from ipc.sampling_params import SamplingParams

logger = logging.getLogger("loom.api")
_END = object()


@dataclass
class Prompt:
    text: str | None            # None: given as token ids (decoded only when echoed)
    token_ids: list[int]


@dataclass
class Choice:
    """What one choice has produced so far."""
    text: list[str] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    num_tokens: int = 0
    finish_reason: str | None = None
    stop_reason: Any = None
    logprobs: list = field(default_factory=list)   # completions: rendered parts; chat: content items
    prompt_logprobs: list | None = None
    text_offset: int = 0
    started: bool = False
    output: ChatOutput | None = None   # chat: its reasoning_content / content / tool_calls

    @property
    def api_finish_reason(self) -> str | None:
        """OpenAI's "tool_calls" when a chat choice that ended normally called tools."""
        if self.finish_reason == "stop" and self.output is not None and self.output.tool_calls:
            return "tool_calls"
        return self.finish_reason


@dataclass
class GenerationContext:
    """One completions or chat request, from its parsed body to its last byte."""
    request: web.Request
    req: Any                          # CompletionRequest | ChatCompletionRequest
    chat: bool
    rid: str
    created: int
    model: str
    params: SamplingParams
    prompts: list[Prompt]
    include_usage: bool = False       # stream_options.include_usage
    continuous_usage: bool = False    # stream_options.continuous_usage_stats
    prompt_tokens_details: bool = False  # --enable-prompt-tokens-details
    decode: Any = None                # token id -> text (first echoed prompt token)
    echo_texts: list[str] | None = None  # per prompt, text prepended to each of its choices
    role: str = "assistant"           # chat: the answer's role
    choices: list[Choice] = field(default_factory=list)
    num_cached_tokens: dict[int, int] = field(default_factory=dict)   # per prompt
    tools: ToolUse | None = None      # chat: how the request uses its tools
    reasoning: Any = None             # chat: the --reasoning-parser (frontend/reasoning)
    on_tool_parse: Any = None         # callable(ChatOutput, streaming): counts tool-parser invocations
    harmony: bool = False             # chat: a gpt-oss output, parsed by channel (frontend/openai/harmony.py)
    _frame: Any = None                # its stream chunks' fixed bytes (protocol.ChunkFrame), made at the first
    _text_chunks: dict = field(default_factory=dict)   # choice index -> its text-only chunk, cut at the text

    def __post_init__(self):
        self.choices = [Choice() for _ in range(self.n * len(self.prompts))]
        if self.chat:
            for c in self.choices:
                c.output = ChatOutput(self.tools or ToolUse(), self.reasoning, self.harmony)

    @property
    def n(self) -> int:
        return self.params.n

    @property
    def echo_only(self) -> bool:
        """Completions echo with max_tokens 0: the prompt (and its logprobs) alone, as vLLM."""
        return not self.chat and bool(self.req.echo) and self.req.max_tokens == 0

    @property
    def may_be_large(self) -> bool:
        """Whether the answer may run to megabytes: logprobs of every token, or many prompts."""
        return self.params.logprobs is not None or self.params.prompt_logprobs is not None or len(self.prompts) > 64

    @property
    def as_ids(self) -> bool:
        return bool(self.req.return_tokens_as_token_ids)

    @property
    def return_token_ids(self) -> bool:
        return bool(self.req.return_token_ids)

    def usage(self, k: int | None = None) -> dict:
        """Usage of the whole request, or (continuous_usage_stats) of choice k's prompt and tokens so far."""
        if k is not None:
            return usage(len(self.prompts[k // self.n].token_ids), self.choices[k].num_tokens)
        cached = sum(self.num_cached_tokens.values()) if self.prompt_tokens_details else None
        return usage(sum(len(p.token_ids) for p in self.prompts), sum(c.num_tokens for c in self.choices), cached)

    # ------------------------------------------------------------ completions

    def completion_delta(self, i: int, out) -> list[tuple[int, dict, Choice]]:
        """Apply one RequestOutput of prompt i; returns [(choice index, choice dict for a chunk, state)]."""
        res = []
        self.num_cached_tokens[i] = out.num_cached_tokens
        for c in out.outputs:
            k = i * self.n + c.index
            choice = self._completion_choice(i, k, c)
            if choice is not None:
                res.append((k, choice, self.choices[k]))
        return res

    def completion_events(self, item: tuple[int, Any]) -> bytes:
        """The stream's chunks of one output (prompt i's: item is (i, RequestOutput)), one per choice
        with something to send, as completion_delta's choices encoded one per chunk. A text-only
        chunk (the stream's usual one) is its choice's template with the text's JSON spliced in."""
        i, out = item
        self.num_cached_tokens[i] = out.num_cached_tokens
        plain = self._plain_text_chunks
        chunks = []
        for c in out.outputs:
            k = i * self.params.n + c.index
            st = self.choices[k]
            if plain and st.started and c.text and c.finish_reason is None:
                st.text.append(c.text)
                st.token_ids.extend(c.token_ids)
                st.num_tokens += len(c.token_ids)
                chunks.append(self._text_chunk(k, c.text))
                continue
            choice = self._completion_choice(i, k, c)
            if choice is not None:
                chunks.append(self.completion_chunk([choice], self.usage(k) if self.continuous_usage else None))
        return chunks[0] if len(chunks) == 1 else b"".join(chunks)

    @functools.cached_property
    def _plain_text_chunks(self) -> bool:
        """Whether a started choice's chunk with text and no finish carries nothing but its text
        (no logprobs, token ids or usage): then its bytes are a template's (_text_chunk)."""
        return (self.params.logprobs is None and not self.return_token_ids and not self.continuous_usage
                and not self.echo_only)

    def _text_chunk(self, k: int, text: str) -> bytes:
        cut = self._text_chunks.get(k)
        if cut is None:
            if self.chat:
                choice = chat_chunk_choice(k, {"content": TEXT_SLOT}, None, None, None, token_ids=None)
                chunk = self.chat_chunk([choice])
            else:
                choice = completion_choice(k, TEXT_SLOT, None, None, None, prompt_token_ids=None, token_ids=None)
                chunk = self.completion_chunk([choice])
            cut = self._text_chunks[k] = chunk_template(chunk)
        return cut[0] + encode_json(text) + cut[1]

    def _completion_choice(self, i: int, k: int, c) -> dict | None:
        """Apply choice k's delta `c` (of prompt i); its choice dict for a chunk, or None (nothing to send)."""
        prompt = self.prompts[i]
        st = self.choices[k]
        text, ids, entries = c.text, list(c.token_ids), c.logprobs or []
        prompt_token_ids = None
        if not st.started:
            st.started = True
            st.prompt_logprobs = c.prompt_logprobs
            if self.return_token_ids:
                prompt_token_ids = prompt.token_ids
            if self.req.echo:
                echo = "" if self.return_token_ids else self.echo_texts[i]
                plp = c.prompt_logprobs or [None] * len(prompt.token_ids)
                if self.echo_only:
                    text, ids, entries = echo, prompt.token_ids, plp
                else:
                    text, ids, entries = echo + text, prompt.token_ids + ids, plp + entries
        elif self.echo_only:
            text, ids, entries = "", [], []
        st.text.append(text)
        st.token_ids.extend(c.token_ids)
        st.num_tokens += len(c.token_ids)
        lp = None
        if self.params.logprobs is not None and ids:
            lp, st.text_offset = completion_logprobs(ids, entries, self.params.logprobs, st.text_offset,
                                                     self.as_ids, self.decode)
            st.logprobs.append(lp)
        if c.finish_reason is not None:
            st.finish_reason, st.stop_reason = c.finish_reason, c.stop_reason
        check_choice(st)
        if not text and lp is None and st.finish_reason is None and not (self.return_token_ids and c.token_ids):
            return None
        return completion_choice(k, text, st.finish_reason, st.stop_reason, lp, prompt_token_ids=prompt_token_ids,
                                 token_ids=list(c.token_ids) if self.return_token_ids else None)

    def completion_body(self) -> dict:
        choices = []
        for k, c in enumerate(self.choices):
            check_choice(c)
            lp = merge_completion_logprobs(c.logprobs) if self.params.logprobs is not None else None
            choices.append(completion_choice(
                k, "".join(c.text), c.finish_reason, c.stop_reason, lp,
                prompt_logprobs=prompt_logprobs_json(c.prompt_logprobs) if self.req.prompt_logprobs is not None
                else None,
                prompt_token_ids=self.prompts[k // self.n].token_ids if self.return_token_ids else None,
                token_ids=c.token_ids if self.return_token_ids else None))
        return completion_response(self.rid, self.created, self.model, choices, self.usage())

    def completion_chunk(self, choices: list[dict], usage_: dict | None = None) -> bytes:
        if self._frame is None:
            self._frame = ChunkFrame(self.rid, "text_completion", self.created, self.model)
        return self._frame.sse(choices, usage_)

    # ------------------------------------------------------------ chat

    def chat_delta(self, out) -> list[tuple[int, dict, Choice]]:
        res = []
        self.num_cached_tokens[0] = out.num_cached_tokens
        for c in out.outputs:
            st = self.choices[c.index]
            if not st.started:
                st.started = True
                st.prompt_logprobs = c.prompt_logprobs
            st.text.append(c.text)
            st.token_ids.extend(c.token_ids)
            st.num_tokens += len(c.token_ids)
            lp = None
            if self.params.logprobs is not None and c.logprobs:
                lp = chat_logprobs(c.token_ids, c.logprobs, self.params.logprobs, self.as_ids)
                st.logprobs.extend(lp["content"])
            if c.finish_reason is not None:
                st.finish_reason, st.stop_reason = c.finish_reason, c.stop_reason
            check_choice(st)
            if not self.req.stream:
                continue   # the message is made whole in chat_body
            delta = self._chat_output_delta(st, c.text, c.token_ids)
            if not delta and lp is None and st.finish_reason is None and not (self.return_token_ids and c.token_ids):
                continue
            res.append((c.index, chat_chunk_choice(
                c.index, delta, st.api_finish_reason, st.stop_reason, lp,
                token_ids=list(c.token_ids) if self.return_token_ids else None), st))
        return res

    def chat_events(self, item: tuple[int, Any]) -> bytes:
        """The stream's chunks of one output (item: (0, RequestOutput)), one per choice with something
        to send; a content-only chunk is its choice's template with the text's JSON spliced in."""
        plain = self._plain_text_chunks
        chunks = []
        for k, choice, st in self.chat_delta(item[1]):
            delta = choice["delta"]
            if (plain and choice["finish_reason"] is None and len(delta) == 1 and type(delta.get("content")) is str
                    and delta["content"]):
                chunks.append(self._text_chunk(k, delta["content"]))
            else:
                chunks.append(self.chat_chunk([choice], self.usage(k) if self.continuous_usage else None))
        return chunks[0] if len(chunks) == 1 else b"".join(chunks)

    def _chat_output_delta(self, st: Choice, text: str, token_ids=()) -> dict:
        """The delta fields (reasoning_content, content, tool_calls) this text makes sendable."""
        out = st.output
        delta = out.add(text, token_ids)
        if out.tools.mode == "auto" and self.on_tool_parse is not None:
            self.on_tool_parse(out, True)
        if st.finish_reason is not None:
            for key, value in out.finish().items():
                delta[key] = delta.get(key, "") + value if isinstance(value, str) else value
        return delta

    def chat_body(self) -> dict:
        echo = self.echo_texts[0] if self.echo_texts else ""
        choices = []
        for k, c in enumerate(self.choices):
            check_choice(c)
            c.output.text = "".join(c.text)
            c.output.token_ids = list(c.token_ids)
            message = c.output.message()
            message["role"] = self.role
            if echo and isinstance(message["content"], str):
                message["content"] = echo + message["content"]
            if self.on_tool_parse is not None:
                self.on_tool_parse(c.output, False)
            choices.append(chat_choice(k, message, c.api_finish_reason, c.stop_reason,
                                       {"content": c.logprobs} if self.params.logprobs is not None else None,
                                       token_ids=c.token_ids if self.return_token_ids else None))
        first = self.choices[0] if self.choices else None
        return chat_response(
            self.rid, self.created, self.model, choices, self.usage(),
            prompt_logprobs=prompt_logprobs_json(first.prompt_logprobs)
            if first is not None and self.req.prompt_logprobs is not None else None,
            prompt_token_ids=self.prompts[0].token_ids if self.return_token_ids else None)

    def chat_chunk(self, choices: list[dict], usage_: dict | None = None, **extra) -> bytes:
        if extra:
            return sse(chat_chunk(self.rid, self.created, self.model, choices, usage_, **extra))
        if self._frame is None:
            self._frame = ChunkFrame(self.rid, "chat.completion.chunk", self.created, self.model)
        return self._frame.sse(choices, usage_)

    def chat_begin(self) -> bytes:
        """The role event of every choice (and, with echo, the echoed text), as vLLM starts a stream."""
        extra = {"prompt_token_ids": self.prompts[0].token_ids} if self.return_token_ids else {}
        u = self.usage(0) if self.continuous_usage else None
        out = [self.chat_chunk([chat_chunk_choice(k, {"role": self.role, "content": ""})], u, **extra)
               for k in range(len(self.choices))]
        if self.echo_texts and self.echo_texts[0]:
            out += [self.chat_chunk([chat_chunk_choice(k, {"content": self.echo_texts[0]})], u)
                    for k in range(len(self.choices))]
        return b"".join(out)


_PARAM_NAMES = set(SamplingParams.__struct_fields__) | {"prompt", "messages", "model"}


def value_error(e: ValueError) -> APIError:
    """A RequestError (ipc/validation.py) or the engine's refusal of a request -> 400."""
    msg = str(e)
    param = getattr(e, "param", None)
    if param is None:
        word = msg.split(" ", 1)[0]
        param = word if word in _PARAM_NAMES else None
    return APIError(msg, 400, param)


def check_choice(choice: Choice) -> None:
    """A choice the engine finished with an error fails the request: a 400 when its own parameters
    made it fail (RequestFault), else a 500."""
    if choice.finish_reason == "error":
        if isinstance(choice.stop_reason, RequestFault):
            raise APIError(f"The request failed: {choice.stop_reason}", 400)
        raise APIError(f"The request failed in the engine: {choice.stop_reason}", 500)


# ---------------------------------------------------------------- driving the streams

async def merge(gens: list[AsyncIterator]) -> AsyncIterator[tuple[int, Any]]:
    """(index of the generator, item) from several generators as items come."""
    if len(gens) == 1:   # (callers take a single prompt's stream through _Indexed, one layer less)
        async for item in _Indexed(gens[0]):
            yield item
        return
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(i: int, gen: AsyncIterator) -> None:
        try:
            async for item in gen:
                queue.put_nowait((i, item, None))
        except Exception as e:  # noqa: BLE001  (handed to the consumer)
            queue.put_nowait((i, None, e))
        finally:
            await gen.aclose()
        queue.put_nowait((i, _END, None))

    tasks = [asyncio.create_task(pump(i, g)) for i, g in enumerate(gens)]
    try:
        remaining = len(tasks)
        while remaining:
            i, item, err = await queue.get()
            if err is not None:
                raise err
            if item is _END:
                remaining -= 1
                continue
            yield i, item
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


class _Indexed:
    """One generator's items as (0, item): merge() of a single prompt, the common case, without an
    async generator of its own between the engine's outputs and the response (a frame per token)."""

    __slots__ = ("gen",)

    def __init__(self, gen):
        self.gen = gen

    def __aiter__(self):
        return self

    async def __anext__(self):
        return 0, await self.gen.__anext__()

    async def aclose(self) -> None:
        await self.gen.aclose()

    def push(self, sink) -> bool:
        """sink((0, output)) for each output, where the generator can push them (AsyncLLM's RequestStream)."""
        push = getattr(self.gen, "push", None)
        return push is not None and push(lambda out: sink((0, out)))


def merged(gens: list[AsyncIterator]):
    """merge(gens), where one generator is wrapped instead of driven (what start() returns)."""
    return _Indexed(gens[0]) if len(gens) == 1 else merge(gens)


async def first_output(stream: AsyncIterator):
    """The first output, before any byte of the response goes out: a rejected request is still a 400."""
    try:
        return await stream.__anext__()
    except StopAsyncIteration:
        return _END
    except ValueError as e:
        raise value_error(e) from None


async def outputs(first, stream: AsyncIterator):
    """`first` (from first_output), then the rest of the stream."""
    item = first
    while item is not _END:
        yield item
        try:
            item = await stream.__anext__()
        except StopAsyncIteration:
            return


class SSEResponse(web.StreamResponse):
    """A text/event-stream response whose events can also be written without an await, from a
    callback (push): while its connection's write buffer is under the transport's high-water mark,
    an output's events are one transport.write (the HTTP chunk framed here, as aiohttp's chunked
    writer frames it). aiohttp's own write goes through two coroutines and a _writelines per chunk."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self._writer = self._protocol = self._transport = None   # once its headers are out

    async def prepare(self, request: web.BaseRequest):
        writer = await super().prepare(request)
        # headers written (StreamResponse sends them at prepare), no compression, no fixed length:
        # the body is plain chunks (or, to an HTTP/1.0 client, plain bytes)
        if (writer is not None and writer.output_size > 0 and not self.compression and writer.length is None
                and writer.transport is not None):
            self._writer, self._protocol, self._transport = writer, request.protocol, writer.transport
        return writer

    @property
    def can_push(self) -> bool:
        return self._writer is not None

    def push(self, emit, item) -> bool:
        """emit(item)'s bytes to the connection in this turn of the loop; False (emit not called)
        while its buffer is full: the caller hands the item to a task that waits for the connection."""
        if self._protocol.writing_paused:
            return False
        transport = self._transport
        if transport.is_closing():
            raise ConnectionResetError("Cannot write to closing transport")
        data = emit(item)
        if data:
            if self._writer.chunked:
                data = b"%x\r\n%b\r\n" % (len(data), data)
            self._writer.output_size += len(data)   # (what aiohttp counts: the response's body_length)
            transport.write(data)
        return True


async def sse_response(request: web.Request) -> SSEResponse:
    resp = SSEResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache",
                                "X-Accel-Buffering": "no"})
    await resp.prepare(request)
    return resp


def openai_error_event(message: str, status: int, param: str | None = None) -> bytes:
    return sse(error_body(message, status, param))


async def pump_sse(resp: SSEResponse, stream, first, emit, final, begin: bytes = b"",
                   error_event=openai_error_event, done: bytes = SSE_DONE) -> web.StreamResponse:
    """Write `begin` and the first output's events (`emit(item) -> bytes`) in one write, then every
    other output's, then `final()`'s events (usage) and `done` with the end of the body in one
    write; an error becomes `error_event(message, status, param)` instead of `final()`'s (each
    API its own shape). A dead client (write fails) ends it: the caller's finally closes the
    stream, which aborts.
    Where the stream can push (AsyncLLM's, one prompt), the outputs after the first are emitted and
    written in the turn of the loop that made them (SSEResponse.push), and this task is
    woken only for those its connection could not take at once (it waits for the connection
    here) and for the end."""
    unsent = begin
    try:
        if first is not _END:
            unsent += emit(first)
            if unsent:
                await resp.write(unsent)
            unsent = b""
            push = getattr(stream, "push", None)
            if push is not None and resp.can_push:
                push(functools.partial(resp.push, emit))
            async for item in stream:
                data = emit(item)
                if data:
                    await resp.write(data)
        tail = final()
    except ConnectionResetError:
        logger.debug("client went away mid-stream")
        return resp
    except EngineDeadError as e:
        tail = error_event(engine_dead_message(e), 503)
    except APIError as e:
        tail = error_event(e.message, e.status, e.param)
    except ValueError as e:
        err = value_error(e)
        tail = error_event(err.message, 400, err.param)
    except (asyncio.CancelledError, GeneratorExit):
        raise
    except Exception:  # noqa: BLE001
        logger.exception("error while streaming")
        tail = error_event("Internal server error (see the server log)", 500)
    try:
        await resp.write_eof(unsent + tail + done)
    except ConnectionResetError:
        pass
    return resp


async def chat_answer(ctx: GenerationContext, stream, first) -> dict:
    """A chat's whole answer, the body /v1/chat/completions sends: what /v1/responses and
    /v1/messages translate into their own shapes."""
    async for _, out in outputs(first, stream):
        ctx.chat_delta(out)
    return ctx.chat_body()


def translate(body: dict, cls: type):
    """A request of another API, translated (as JSON), as the struct the chat path takes; a
    mistyped field is a 400 naming it."""
    try:
        return msgspec.convert(body, cls)
    except msgspec.ValidationError as e:
        raise APIError(f"Invalid request: {e}", 400) from None


def chat_deltas(ctx: GenerationContext, out) -> list[dict]:
    """The stream deltas (reasoning_content, content, tool_calls) of one output of a chat."""
    return [choice["delta"] for _, choice, _ in ctx.chat_delta(out)]
