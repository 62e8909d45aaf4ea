"""The OpenAI-compatible HTTP server (aiohttp on uvloop), one per API-server process.

Endpoints: POST /v1/completions, POST /v1/chat/completions (stream or not),
GET /v1/models, GET /health, GET /metrics (Prometheus), GET /version, POST /tokenize, POST /detokenize,
and with --enable-control-endpoints POST /reset_prefix_cache, /sleep?level=,
/wake_up?tags=, /pause?mode=&clear_cache=, /resume, /collective_rpc and GET
/is_sleeping, /is_paused. Every response carries X-Loom-Server-Index (which
API-server process answered).

Tokenization and chat templating run in a one-thread executor, never on the
event loop, so /health and streaming stay responsive under big prompts.

Client disconnects: the server runs with aiohttp's handler_cancellation, so a
dropped connection cancels the handler; the cancellation reaches the
AsyncLLM.generate() iterator, which aborts the request in the engine. A
failed write (ConnectionResetError) ends the stream the same way.
"""
from __future__ import annotations

import asyncio
import functools
import hmac
import logging
import socket
from concurrent.futures import ThreadPoolExecutor
from typing import Any, AsyncIterator

from aiohttp import web

from frontend.errors import EngineDeadError
from frontend.processing import check_prompt
from frontend.protocol import (SSE_DONE, APIError, ChatCompletionRequest, CompletionRequest, DetokenizeRequest,
                               TokenizeRequest, build_sampling_params, chat_choice, chat_chunk, chat_chunk_choice,
                               chat_logprobs, chat_response, check_model, completion_choice, completion_chunk,
                               completion_logprobs, completion_prompts, completion_response, dumps, encode_prompts,
                               error_body, merge_completion_logprobs, models_response, normalize_messages, now,
                               parse_request, random_id, render_chat, sse, stream_include_usage, usage)
from frontend.chat_output import ChatOutput, ToolUse
from frontend.constraints import check_constraint, request_constraint, tool_use
from frontend.reasoning import REASONING_PARSERS
from ipc.sampling_params import SamplingParams, StructuredOutputsParams
from metrics.http import HttpMetrics
from metrics.registry import Builder, render as render_metrics

logger = logging.getLogger("loom.api")

MAX_BODY_BYTES = 64 * 1024 * 1024
_END = object()
SERVER_KEY: web.AppKey["OpenAIServer"] = web.AppKey("openai_server")
_OPEN_PATHS = ("/health", "/metrics")  # no API key needed (as in vLLM: probes and scrapers)
_PARAM_NAMES = set(SamplingParams.__struct_fields__) | {"prompt", "messages", "model"}


def _version() -> str:
    try:
        from importlib.metadata import version
        return version("loom")
    except Exception:
        return "0.1.0"


def _json(obj: Any, status: int = 200, headers: dict | None = None) -> web.Response:
    return web.Response(body=dumps(obj), status=status, content_type="application/json", headers=headers)


def _error_response(e: APIError, headers: dict | None = None) -> web.Response:
    return _json(e.body(), e.status, headers)


def _value_error(e: ValueError) -> APIError:
    """A ValueError from check_prompt / SamplingParams.validate / the engine -> 400."""
    msg = str(e)
    param = getattr(e, "param", None)
    if param is None:
        word = msg.split(" ", 1)[0]
        param = word if word in _PARAM_NAMES else None
    return APIError(msg, 400, param)


# ---- control endpoints: helpers (--enable-control-endpoints) ----------------------------------

import re as _re  # noqa: E402

import msgspec as _msgspec  # noqa: E402

from engine_core.control import PAUSE_MODES, SLEEP_TAGS  # noqa: E402

SERVER_INDEX_HEADER = "X-Loom-Server-Index"
# collective_rpc methods that are remote but would desync the engine's own state: use the endpoints
_RPC_DENIED = {"sleep": "use POST /sleep", "wake_up": "use POST /wake_up",
               "initialize_cache": "the KV cache is the engine's", "shutdown": "use SIGTERM on `loom serve`"}
# "ValueError: msg", or "RuntimeError: worker 0: ValueError: msg" from a worker
_FAILURE = _re.compile(r"^(?:(?:WorkerError|RuntimeError): worker \d+: )?(\w+): (.*)\Z", _re.DOTALL)


class CollectiveRPCRequest(_msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    method: str
    args: list = []
    kwargs: dict[str, Any] = {}
    timeout: float | None = None


def _query_choice(request: web.Request, name: str, choices, default: str) -> str:
    value = request.query.get(name, default)
    if value not in choices:
        raise APIError(f"'{name}' must be one of {', '.join(map(str, choices))}; got {value!r}", 400, name)
    return value


def _query_bool(request: web.Request, name: str, default: bool) -> bool:
    value = request.query.get(name)
    if value is None:
        return default
    low = value.strip().lower()
    if low in ("1", "true", "yes", "on"):
        return True
    if low in ("0", "false", "no", "off"):
        return False
    raise APIError(f"'{name}' must be true or false; got {value!r}", 400, name)


def _remote_worker_method(name: str) -> bool:
    from workers.worker import Worker  # light: the model runner is imported only when a Worker is built
    return not name.startswith("_") and getattr(getattr(Worker, name, None), "_loom_remote", False) is True


async def _merge(gens: list[AsyncIterator]) -> AsyncIterator[tuple[int, Any]]:
    """(index of the generator, item) from several generators as items come."""
    if len(gens) == 1:
        gen = gens[0]
        try:
            async for item in gen:
                yield 0, item
        finally:
            await gen.aclose()
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


class _Choice:
    """What one choice has produced so far."""
    __slots__ = ("text", "num_tokens", "finish_reason", "stop_reason", "logprobs", "text_offset", "started",
                 "output")

    def __init__(self, text_offset: int = 0, output: ChatOutput | None = None):
        self.output = output  # chat: its reasoning / content / tool calls
        self.text: list[str] = []
        self.num_tokens = 0
        self.finish_reason: str | None = None
        self.stop_reason = None
        self.logprobs: list = []
        self.text_offset = text_offset
        self.started = False


class OpenAIServer:
    def __init__(self, llm, api_key: str | None = None, enable_control_endpoints: bool = False,
                 tokenizer_threads: int = 1):
        self.llm = llm
        self.config = llm.config
        self.tokenizer = llm.tokenizer
        self.api_key = api_key
        self.enable_control_endpoints = enable_control_endpoints
        self.model_name = self.config.model_name
        self.created = now()
        parser = getattr(self.config, "reasoning_parser", None)
        self.reasoning_parser = REASONING_PARSERS[parser]() if parser else None
        self.tool_parser_invocations = Builder().counter(
            "vllm:tool_call_parser_invocations", "Total number of ToolParser invocations. Non-streaming increments "
            "once per choice; streaming increments once per delta.", ("model_name", "mode", "outcome", "request_type"))
        for mode in ("streaming", "non_streaming"):
            for outcome in ("tool_call", "no_tool_call"):
                for request_type in ("chat_completions", "responses", "other"):
                    self.tool_parser_invocations.labels(self.model_name, mode, outcome, request_type)
        # One thread: a HF fast tokenizer is not safe to share between threads, and ordering is kept.
        self.executor = ThreadPoolExecutor(tokenizer_threads, thread_name_prefix="loom-tokenize")

    # ------------------------------------------------------------ plumbing

    async def _off_loop(self, fn, *args, **kwargs):
        return await asyncio.get_running_loop().run_in_executor(
            self.executor, functools.partial(fn, *args, **kwargs))

    def _check_alive(self) -> None:
        if self.llm.is_dead:
            raise APIError(f"The engine is dead: {self.llm.dead_reason or 'unknown reason'}", 503)

    def _check_model(self, name: str | None) -> None:
        check_model(name, self.model_name, getattr(self.config, "model", None))

    def _check_prompt(self, ids: list[int], params: SamplingParams, index: int | None = None) -> None:
        try:
            check_prompt(self.config, ids, params)
        except ValueError as e:
            err = _value_error(e)
            if index is not None and index > 0:
                err.message = f"prompt[{index}]: {err.message}"
                err.args = (err.message,)
            raise err from None

    @web.middleware
    async def _middleware(self, request: web.Request, handler):
        try:
            if self.api_key is not None and request.path not in _OPEN_PATHS:
                auth = request.headers.get("Authorization", "")
                token = auth[7:] if auth[:7].lower() == "bearer " else ""
                if not hmac.compare_digest(token.encode(), self.api_key.encode()):
                    raise APIError("Incorrect or missing API key: send 'Authorization: Bearer <key>'.", 401,
                                   type="AuthenticationError")
            return await handler(request)
        except APIError as e:
            return _error_response(e)
        except web.HTTPException as e:
            if e.status < 400:
                raise
            headers = {"Allow": e.headers["Allow"]} if "Allow" in e.headers else None
            msg = e.reason
            if e.status == 404:
                msg = f"Not found: {request.method} {request.path}"
            elif e.status == 405:
                msg = f"Method {request.method} is not allowed on {request.path}"
            return _error_response(APIError(msg, e.status), headers)
        except EngineDeadError as e:
            return _error_response(APIError(f"The engine is dead: {e or self.llm.dead_reason}", 503))
        except (asyncio.CancelledError, ConnectionResetError):
            raise
        except Exception as e:  # noqa: BLE001
            logger.exception("error handling %s %s", request.method, request.path)
            return _error_response(APIError(f"Internal server error: {type(e).__name__}: {e}", 500))

    async def _body(self, request: web.Request, cls):
        try:
            raw = await request.read()
        except web.HTTPRequestEntityTooLarge:
            raise APIError(f"The request body is larger than {MAX_BODY_BYTES} bytes.", 413) from None
        return parse_request(raw, cls)

    async def _first(self, stream: AsyncIterator):
        """The first output, before any byte of the response goes out: a rejected request is still a 400."""
        try:
            return await stream.__anext__()
        except StopAsyncIteration:
            return _END
        except ValueError as e:
            raise _value_error(e) from None

    @staticmethod
    async def _outputs(first, stream: AsyncIterator):
        """`first` (from _first), then the rest of the stream."""
        item = first
        while item is not _END:
            yield item
            try:
                item = await stream.__anext__()
            except StopAsyncIteration:
                return

    # ------------------------------------------------------------ simple endpoints

    async def health(self, request: web.Request) -> web.Response:
        if self.llm.is_dead:
            return _json(error_body(f"The engine is dead: {self.llm.dead_reason or 'unknown reason'}", 503), 503)
        return web.Response(status=200)

    async def metrics(self, request: web.Request) -> web.Response:
        """Prometheus exposition (all API servers' values under `loom serve`); open like /health."""
        body, content_type = await asyncio.get_running_loop().run_in_executor(
            None, render_metrics, request.headers.get("Accept"))
        return web.Response(body=body, headers={"Content-Type": content_type})

    async def version(self, request: web.Request) -> web.Response:
        return _json({"version": _version()})

    async def models(self, request: web.Request) -> web.Response:
        return _json(models_response(self.model_name, self.config.model, self.config.max_model_len, self.created))

    async def model(self, request: web.Request) -> web.Response:
        name = request.match_info["model"]
        self._check_model(name)
        return _json(models_response(self.model_name, self.config.model, self.config.max_model_len,
                                     self.created)["data"][0])

    async def tokenize(self, request: web.Request) -> web.Response:
        req: TokenizeRequest = await self._body(request, TokenizeRequest)
        self._check_model(req.model)
        if (req.prompt is None) == (req.messages is None):
            raise APIError("give exactly one of 'prompt' (a string) or 'messages'", 400, "prompt")
        if req.prompt is not None:
            add_special = True if req.add_special_tokens is None else req.add_special_tokens
            [(_, ids)] = await self._off_loop(encode_prompts, self.tokenizer, [req.prompt], add_special)
        else:
            messages = normalize_messages(req.messages)
            _, ids = await self._off_loop(
                render_chat, self.tokenizer, messages,
                add_generation_prompt=True if req.add_generation_prompt is None else req.add_generation_prompt,
                continue_final_message=bool(req.continue_final_message),
                chat_template_kwargs=req.chat_template_kwargs,
                add_special_tokens=bool(req.add_special_tokens))
        out = {"tokens": ids, "count": len(ids), "max_model_len": self.config.max_model_len}
        if req.return_token_strs:
            out["token_strs"] = await self._off_loop(self.tokenizer.convert_ids_to_tokens, ids)
        return _json(out)

    async def detokenize(self, request: web.Request) -> web.Response:
        req: DetokenizeRequest = await self._body(request, DetokenizeRequest)
        self._check_model(req.model)
        vocab = self.config.vocab_size or len(self.tokenizer)
        bad = [t for t in req.tokens if not 0 <= t < max(vocab, len(self.tokenizer))]
        if bad:
            raise APIError(f"token ids out of the vocabulary: {bad[:8]}", 400, "tokens")
        text = await self._off_loop(self.tokenizer.decode, req.tokens)
        return _json({"prompt": text})

    async def reset_prefix_cache(self, request: web.Request) -> web.Response:
        self._check_alive()
        ok = await self.llm.call_utility("reset_prefix_cache")
        return _json({"success": bool(ok) if ok is not None else True})

    # ---- control endpoints (--enable-control-endpoints; the engine core owns the state, so every
    # API server answers the same). Engine-side ValueErrors are the caller's fault: 400; else 500.

    async def _control(self, method: str, *args, param: str | None = None,
                       client_errors: tuple[str, ...] = ("ValueError",)):
        self._check_alive()
        try:
            # no timeout: pause?mode=wait answers only once the requests in flight have finished
            return await self.llm.call_utility(method, *args)
        except EngineDeadError:
            raise
        except RuntimeError as e:
            m = _FAILURE.match(str(e))
            if m and m.group(1) in client_errors:
                raise APIError(m.group(2), 400, param) from None
            raise APIError(f"{method} failed in the engine: {e}", 500) from None

    async def sleep(self, request: web.Request) -> web.Response:
        level = int(_query_choice(request, "level", ("0", "1", "2"), "1"))
        await self._control("sleep", level, param="level")
        return _json({"status": "ok"})

    async def wake_up(self, request: web.Request) -> web.Response:
        tags = [t for v in request.query.getall("tags", []) for t in v.split(",") if t]
        bad = [t for t in tags if t not in SLEEP_TAGS]
        if bad:
            raise APIError(f"unknown tags {bad}; 'tags' must be among {', '.join(SLEEP_TAGS)}", 400, "tags")
        await self._control("wake_up", tags or None, param="tags")
        return _json({"status": "ok"})

    async def is_sleeping(self, request: web.Request) -> web.Response:
        return _json({"is_sleeping": bool(await self._control("is_sleeping"))})

    async def pause(self, request: web.Request) -> web.Response:
        mode = _query_choice(request, "mode", PAUSE_MODES, "abort")
        clear_cache = _query_bool(request, "clear_cache", False)
        await self._control("pause", mode, clear_cache, param="mode")
        return _json({"status": "ok"})

    async def resume(self, request: web.Request) -> web.Response:
        await self._control("resume")
        return _json({"status": "ok"})

    async def is_paused(self, request: web.Request) -> web.Response:
        return _json({"is_paused": bool(await self._control("is_paused"))})

    async def collective_rpc(self, request: web.Request) -> web.Response:
        req: CollectiveRPCRequest = await self._body(request, CollectiveRPCRequest)
        if req.method in _RPC_DENIED:
            raise APIError(f"method {req.method!r} is not allowed through collective_rpc: "
                           f"{_RPC_DENIED[req.method]}", 400, "method")
        if not _remote_worker_method(req.method):
            raise APIError(f"method {req.method!r} is not callable on workers", 400, "method")
        if req.timeout is not None and not req.timeout > 0:
            raise APIError(f"'timeout' must be positive (seconds) or null; got {req.timeout}", 400, "timeout")
        results = await self._control("collective_rpc", req.method, req.args, req.kwargs, req.timeout,
                                      client_errors=("ValueError", "TypeError"))  # TypeError: bad args
        return _json({"results": results})

    async def _add_server_index(self, request: web.Request, response: web.StreamResponse) -> None:
        """on_response_prepare, so streamed responses (prepared inside the handler) get it too."""
        response.headers[SERVER_INDEX_HEADER] = str(getattr(self.llm, "client_index", 0))

    # ---- end of control endpoints

    # ------------------------------------------------------------ completions

    async def completions(self, request: web.Request) -> web.StreamResponse:
        req: CompletionRequest = await self._body(request, CompletionRequest)
        self._check_model(req.model)
        prompts = completion_prompts(req.prompt)
        constraint = await self._off_loop(request_constraint, req)
        params = build_sampling_params(req, chat=False, max_logprobs=self.config.max_logprobs,
                                       vocab_size=self.config.vocab_size, structured=constraint)
        if req.echo and params.logprobs is not None:
            raise APIError("echo together with logprobs is not supported", 400, "echo")
        self._check_alive()
        add_special = True if req.add_special_tokens is None else req.add_special_tokens
        encoded = await self._off_loop(encode_prompts, self.tokenizer, prompts, add_special)
        for i, (_, ids) in enumerate(encoded):
            self._check_prompt(ids, params, i if len(encoded) > 1 else None)
        echo_texts = None
        if req.echo:
            echo_texts = []
            for text, ids in encoded:
                echo_texts.append(text if text is not None else await self._off_loop(self.tokenizer.decode, ids))
        rid = random_id("cmpl")
        created = now()
        gens = [self.llm.generate(ids, params, f"{rid}-{i}") for i, (_, ids) in enumerate(encoded)]
        stream = _merge(gens)
        try:
            first = await self._first(stream)
            prompt_tokens = sum(len(ids) for _, ids in encoded)
            n = params.n
            choices = [_Choice() for _ in range(n * len(encoded))]
            if echo_texts is not None:
                for k, c in enumerate(choices):
                    c.text.append(echo_texts[k // n])
            if req.stream:
                return await self._stream_completions(request, stream, first, rid, created, params, n, choices,
                                                      prompt_tokens, stream_include_usage(req))
            return await self._full_completions(stream, first, rid, created, params, n, choices, prompt_tokens)
        finally:
            await stream.aclose()

    def _completion_delta(self, i: int, out, params: SamplingParams, n: int, choices: list[_Choice]):
        """Apply one RequestOutput delta; returns [(choice index, text, logprobs dict | None, finished)]."""
        res = []
        for c in out.outputs:
            k = i * n + c.index
            st = choices[k]
            text = c.text
            if not st.started:
                st.started = True
                if st.text:  # echo
                    text = st.text[0] + text
                    st.text = []
            st.text.append(text)
            st.num_tokens += len(c.token_ids)
            lp = None
            if params.logprobs is not None and c.logprobs:
                lp, st.text_offset = completion_logprobs(c.token_ids, c.logprobs, params.logprobs, st.text_offset)
                st.logprobs.append(lp)
            if c.finish_reason is not None:
                st.finish_reason, st.stop_reason = c.finish_reason, c.stop_reason
            res.append((k, text, lp, st))
        return res

    async def _full_completions(self, stream, first, rid, created, params, n, choices, prompt_tokens):
        async for i, out in self._outputs(first, stream):
            self._completion_delta(i, out, params, n, choices)
        for c in choices:
            _check_choice(c)
        body = [completion_choice(k, "".join(c.text), c.finish_reason, c.stop_reason,
                                  merge_completion_logprobs(c.logprobs) if params.logprobs is not None else None)
                for k, c in enumerate(choices)]
        return _json(completion_response(rid, created, self.model_name, body,
                                         usage(prompt_tokens, sum(c.num_tokens for c in choices))))

    async def _stream_completions(self, request, stream, first, rid, created, params, n, choices, prompt_tokens,
                                  include_usage):
        resp = await self._sse_response(request)
        model = self.model_name

        async def emit(item) -> None:
            i, out = item
            for k, text, lp, st in self._completion_delta(i, out, params, n, choices):
                _check_choice(st)
                if not text and lp is None and st.finish_reason is None:
                    continue
                await resp.write(sse(completion_chunk(rid, created, model, [
                    completion_choice(k, text, st.finish_reason, st.stop_reason, lp)])))

        def final() -> bytes:
            if not include_usage:
                return b""
            return sse(completion_chunk(rid, created, model, [],
                                        usage(prompt_tokens, sum(c.num_tokens for c in choices))))

        return await self._pump_sse(resp, stream, first, emit, final)

    # ------------------------------------------------------------ chat

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        req: ChatCompletionRequest = await self._body(request, ChatCompletionRequest)
        self._check_model(req.model)
        messages = normalize_messages(req.messages)
        tools, constraint = await self._off_loop(self._chat_constraint, req)
        params = build_sampling_params(req, chat=True, max_logprobs=self.config.max_logprobs,
                                       vocab_size=self.config.vocab_size, structured=constraint)
        self._check_alive()
        _, ids = await self._off_loop(
            render_chat, self.tokenizer, messages,
            add_generation_prompt=True if req.add_generation_prompt is None else req.add_generation_prompt,
            continue_final_message=bool(req.continue_final_message),
            tools=req.tools if req.tool_choice != "none" else None,
            chat_template_kwargs=req.chat_template_kwargs,
            add_special_tokens=bool(req.add_special_tokens))
        self._check_prompt(ids, params)
        rid = random_id("chatcmpl")
        created = now()
        stream = _merge([self.llm.generate(ids, params, rid)])
        try:
            first = await self._first(stream)
            choices = [_Choice(output=ChatOutput(tools, self.reasoning_parser)) for _ in range(params.n)]
            if req.stream:
                return await self._stream_chat(request, stream, first, rid, created, params, choices, len(ids),
                                               stream_include_usage(req))
            return await self._full_chat(stream, first, rid, created, params, choices, len(ids))
        finally:
            await stream.aclose()

    def _chat_constraint(self, req: ChatCompletionRequest) -> tuple[ToolUse, StructuredOutputsParams | None]:
        """The request's tool use, and its constraint: response_format / structured_outputs, or
        the grammar that tool_choice required / named imposes (not both)."""
        constraint = request_constraint(req)
        tools, tool_constraint = tool_use(req, self.config)
        if tool_constraint is not None:
            if constraint is not None:
                raise APIError(f"tool_choice {req.tool_choice!r} constrains the output already; it cannot be "
                               "combined with response_format or structured_outputs", 400, "tool_choice")
            check_constraint(tool_constraint, "tools")
            constraint = tool_constraint
        return tools, constraint

    def _chat_delta(self, out, params: SamplingParams, choices: list[_Choice]):
        res = []
        for c in out.outputs:
            st = choices[c.index]
            st.text.append(c.text)
            st.num_tokens += len(c.token_ids)
            lp = None
            if params.logprobs is not None and c.logprobs:
                lp = chat_logprobs(c.token_ids, c.logprobs, params.logprobs)
                st.logprobs.extend(lp["content"])
            if c.finish_reason is not None:
                st.finish_reason, st.stop_reason = c.finish_reason, c.stop_reason
            res.append((c.index, c.text, lp, st))
        return res

    async def _full_chat(self, stream, first, rid, created, params, choices, prompt_tokens):
        async for _, out in self._outputs(first, stream):
            self._chat_delta(out, params, choices)
        for c in choices:
            _check_choice(c)
        body = []
        for k, c in enumerate(choices):
            c.output.text = "".join(c.text)
            message = c.output.message()
            self._count_tool_parse(c.output, streaming=False)
            body.append(chat_choice(k, message, _finish_reason(c), c.stop_reason,
                                    {"content": c.logprobs} if params.logprobs is not None else None))
        return _json(chat_response(rid, created, self.model_name, body,
                                   usage(prompt_tokens, sum(c.num_tokens for c in choices))))

    async def _stream_chat(self, request, stream, first, rid, created, params, choices, prompt_tokens,
                           include_usage):
        resp = await self._sse_response(request)
        model = self.model_name

        def begin() -> bytes:
            return b"".join(sse(chat_chunk(rid, created, model, [
                chat_chunk_choice(k, {"role": "assistant", "content": ""})])) for k in range(len(choices)))

        async def emit(item) -> None:
            for k, text, lp, st in self._chat_delta(item[1], params, choices):
                _check_choice(st)
                delta = st.output.add(text)
                if st.output.tools.mode == "auto":
                    self._count_tool_parse(st.output, streaming=True)
                if st.finish_reason is not None:
                    for key, value in st.output.finish().items():
                        delta[key] = delta.get(key, "") + value if isinstance(value, str) else value
                if not delta and lp is None and st.finish_reason is None:
                    continue
                await resp.write(sse(chat_chunk(rid, created, model, [
                    chat_chunk_choice(k, delta, _finish_reason(st), st.stop_reason, lp)])))

        def final() -> bytes:
            if not include_usage:
                return b""
            return sse(chat_chunk(rid, created, model, [], usage(prompt_tokens, sum(c.num_tokens for c in choices))))

        return await self._pump_sse(resp, stream, first, emit, final, begin)

    def _count_tool_parse(self, output: ChatOutput, streaming: bool) -> None:
        """vllm:tool_call_parser_invocations, for tool_choice "auto" (where the parser runs)."""
        if output.tools.mode != "auto":
            return
        called = bool(output.tool_calls) or (streaming and output.tools.parser.plain_prefix(output.text, False)
                                              != output.text)
        self.tool_parser_invocations.labels(self.model_name, "streaming" if streaming else "non_streaming",
                                            "tool_call" if called else "no_tool_call", "chat_completions").inc()

    # ------------------------------------------------------------ streaming plumbing

    async def _sse_response(self, request: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache",
                                           "X-Accel-Buffering": "no"})
        await resp.prepare(request)
        return resp

    async def _pump_sse(self, resp: web.StreamResponse, stream, first, emit, final, begin=None
                        ) -> web.StreamResponse:
        """Write `begin()`'s events, every output as SSE (`emit`), then `final()`'s events (usage) and
        [DONE] with the end of the body in one write; an error becomes an error event instead of
        `final()`'s. A dead client (write fails) ends it: the caller's finally closes the stream, which
        aborts."""
        try:
            if begin is not None:
                await resp.write(begin())
            async for item in self._outputs(first, stream):
                await emit(item)
            tail = final()
        except ConnectionResetError:
            logger.debug("client went away mid-stream")
            return resp
        except EngineDeadError as e:
            tail = sse(error_body(f"The engine is dead: {e or self.llm.dead_reason}", 503))
        except APIError as e:
            tail = sse(error_body(e.message, e.status, e.param))
        except ValueError as e:
            err = _value_error(e)
            tail = sse(error_body(err.message, 400, err.param))
        except (asyncio.CancelledError, GeneratorExit):
            raise
        except Exception as e:  # noqa: BLE001
            logger.exception("error while streaming")
            tail = sse(error_body(f"Internal server error: {type(e).__name__}: {e}", 500))
        try:
            await resp.write_eof(tail + SSE_DONE)
        except ConnectionResetError:
            pass
        return resp

    # ------------------------------------------------------------ app

    def build(self) -> web.Application:
        app = web.Application(middlewares=[HttpMetrics().middleware, self._middleware],  # metrics outermost
                              client_max_size=MAX_BODY_BYTES)
        routes = [("POST", "/v1/completions", self.completions),
                  ("POST", "/v1/chat/completions", self.chat_completions),
                  ("GET", "/v1/models", self.models), ("GET", "/v1/models/{model:.+}", self.model),
                  ("GET", "/health", self.health), ("GET", "/metrics", self.metrics),
                  ("GET", "/version", self.version),
                  ("POST", "/tokenize", self.tokenize), ("POST", "/detokenize", self.detokenize)]
        if self.enable_control_endpoints:
            routes += [("POST", "/reset_prefix_cache", self.reset_prefix_cache),
                       ("POST", "/sleep", self.sleep), ("POST", "/wake_up", self.wake_up),
                       ("GET", "/is_sleeping", self.is_sleeping),
                       ("POST", "/pause", self.pause), ("POST", "/resume", self.resume),
                       ("GET", "/is_paused", self.is_paused),
                       ("POST", "/collective_rpc", self.collective_rpc)]
        add = {"GET": app.router.add_get, "POST": app.router.add_post}  # add_get also answers HEAD
        for method, path, handler in routes:
            add[method](path, handler)
        app.on_response_prepare.append(self._add_server_index)  # X-Loom-Server-Index on every response
        app[SERVER_KEY] = self
        app.on_cleanup.append(self._on_cleanup)
        return app

    async def _on_cleanup(self, app) -> None:
        self.executor.shutdown(wait=False, cancel_futures=True)


def _finish_reason(choice: _Choice) -> str | None:
    """OpenAI's "tool_calls" when a chat choice that ended normally called tools."""
    if choice.finish_reason == "stop" and choice.output is not None and choice.output.tool_calls:
        return "tool_calls"
    return choice.finish_reason


def _check_choice(choice) -> None:
    """A choice the engine finished with an error fails the request (500)."""
    if choice.finish_reason == "error":
        raise APIError(f"The request failed in the engine: {choice.stop_reason}", 500)


def build_app(llm, api_key: str | None = None, enable_control_endpoints: bool = False) -> web.Application:
    return OpenAIServer(llm, api_key, enable_control_endpoints).build()


async def serve(llm, host: str = "127.0.0.1", port: int = 8000, sock: socket.socket | None = None,
                api_key: str | None = None, enable_control_endpoints: bool = False,
                access_log: bool = False, ready: asyncio.Event | None = None, shutdown_timeout: float = 3.0,
                **_ignored) -> None:
    """Serve until cancelled. `sock`: an already-bound listening socket (shared by several API
    server processes), else bind host:port. `ready` is set once listening. On shutdown, requests
    in flight get `shutdown_timeout` seconds to finish."""
    app = build_app(llm, api_key, enable_control_endpoints)
    runner = web.AppRunner(app, handler_cancellation=True, shutdown_timeout=shutdown_timeout,
                           access_log=logger if access_log else None)
    await runner.setup()
    try:
        if sock is not None:
            site: web.BaseSite = web.SockSite(runner, sock, backlog=1024)
        else:
            site = web.TCPSite(runner, host, port, backlog=1024)
        await site.start()
        logger.info("API server (client %s) listening on %s", getattr(llm, "client_index", 0),
                    ", ".join(str(n) for n in runner.addresses) or f"{host}:{port}")
        if ready is not None:
            ready.set()
        await asyncio.Event().wait()
    finally:
        await runner.cleanup()


def run_api_server(llm_or_factory, host: str = "127.0.0.1", port: int = 8000, sock: socket.socket | None = None,
                   **opts) -> None:
    """Blocking entry: run `serve` on uvloop. `llm_or_factory` is an AsyncLLM, or a callable (sync or
    async) that builds one inside the loop (AsyncLLM's sockets belong to the loop); a built one is
    started (`await llm.start()` when it has one) and closed at the end."""
    import uvloop

    async def main() -> None:
        llm = llm_or_factory
        built = callable(llm_or_factory) and not hasattr(llm_or_factory, "generate")
        if built:
            llm = llm_or_factory()
            if asyncio.iscoroutine(llm):
                llm = await llm
            if hasattr(llm, "start"):
                await llm.start()
        try:
            await serve(llm, host, port, sock, **opts)
        finally:
            if built and hasattr(llm, "close"):
                llm.close()

    try:
        uvloop.run(main())
    except KeyboardInterrupt:
        pass
