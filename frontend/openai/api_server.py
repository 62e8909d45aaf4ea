"""The OpenAI-compatible HTTP server (aiohttp on uvloop), one per API-server process.

Endpoints: POST /v1/completions, POST /v1/chat/completions (stream or not), POST /v1/responses
(and GET/DELETE /v1/responses/{id}, POST /v1/responses/{id}/cancel: frontend/openai/serving_responses.py),
POST /v1/messages and /v1/messages/count_tokens (Anthropic's: serving_messages.py), POST /invocations
(SageMaker: either of those by the body's shape), GET /v1/models, GET /health, GET /metrics
(Prometheus), GET /version, POST /tokenize, POST /detokenize, GET /tokenizer_info (with
--enable-tokenizer-info-endpoint), and the control endpoints of frontend/openai/control_api.py (with
--enable-control-endpoints). Every response carries X-Loom-Server-Index (which API-server process
answered).

Bodies are bounded (--max-request-body-bytes), parsed with msgspec (nesting too deep or invalid
UTF-8 is a 400), and validated by ipc/validation.py before anything reaches the engine.

Tokenization and chat templating run off the event loop, in two lanes: inputs under
_SMALL_INPUT_CHARS in a thread of their own, so one user's 20 MB prompt cannot delay another's
small request; larger ones in a tokenizer process (frontend/openai/tokenizer_proc.py). Work for a client
that has gone is cancelled: a queued job is skipped, a running one in the tokenizer process is
killed (cancelling the handler does both).

Client disconnects: the server runs with aiohttp's handler_cancellation, so a dropped connection
cancels the handler; the cancellation reaches the AsyncLLM.generate() iterator, which aborts the
request in the engine. A failed write (ConnectionResetError) ends the stream the same way.
"""
from __future__ import annotations

import asyncio
import copy
import functools
import hmac
import logging
import socket
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, fields
from typing import Any

import msgspec
from aiohttp import web

from frontend.dp_router import check_rank
from frontend.errors import EngineDeadError, engine_dead_message
from frontend.openai import anthropic
from frontend.openai.http_errors import OpenAIErrorRunner
from frontend.chat_utils import (audio_urls, detect_content_format, image_urls, media_chars, message_text,
                                 parse_chat_messages, render_chat)
from frontend.processing import tokenize_bad_words, tokenize_prompts, truncate_prompt
from frontend.openai.protocol import (APIError, ChatCompletionRequest, CompletionRequest, DetokenizeRequest,
                               TokenizeRequest, build_sampling_params, check_model, check_request_chat_template,
                               check_stream_options, completion_prompts, dumps, error_body, models_response, now,
                               parse_request, random_id, stream_usage)
from frontend.openai.load_api import LoadAPI
from frontend.openai.rl_api import control_routes
from frontend.openai.lora_api import LoRARegistry, parse_lora_modules
from frontend.openai.serving_messages import MessagesAPI
from frontend.openai.serving_responses import ResponsesAPI
from frontend.openai.serving_pooling import ServingPooling
from frontend.openai.serving_transcription import TranscriptionAPI
from frontend.openai.tokenizer_proc import ChatJob, EncodeJob, TokenizerProcess
from frontend.openai.serving import (GenerationContext, Prompt, first_output, merge, merged, outputs, pump_sse, sse_response,
                              value_error)
from ipc import envs
from ipc.config import weight_quantization
from ipc.sampling_params import SamplingParams
from ipc.validation import Limits, RequestError, check_bad_words_token_ids, check_prompt
from frontend.openai.beam_search import beam_search, check_beam_search
from frontend.openai.chat_output import ChatOutput, ToolUse
from frontend.openai.constraints import check_constraint, check_tools, may_constrain, request_constraint, tool_use
from frontend.openai.harmony import HarmonyUnavailable, is_harmony_model, render_prompt
from frontend.openai.reasoning import REASONING_PARSERS, ReasoningParser, reasoning_after_prompt
from ipc.grammar import prompt_thinking
from ipc.sampling_params import StructuredOutputsParams
from metrics.registry import Builder
from metrics.http import HttpMetrics
from metrics.registry import render as render_metrics
from multimodal.media import MediaError
from multimodal.processor import StoreBusy, mm_reject

logger = logging.getLogger("loom.api")

SERVER_KEY: web.AppKey["OpenAIServer"] = web.AppKey("openai_server")
SERVER_INDEX_HEADER = "X-Loom-Server-Index"
DP_RANK_HEADER = "X-data-parallel-rank"   # vLLM's: pins a request to one engine core (data parallelism)
_OPEN_PATHS = ("/health", "/metrics", "/load")  # no API key needed (as in vLLM: probes, scrapers, routers)
_SMALL_INPUT_CHARS = 1 << 16     # request bodies up to this size tokenize in the fast lane
MAX_PROMPTS = 1024               # prompts in one /v1/completions request (vLLM: VLLM_MAX_COMPLETION_PROMPTS)
MAX_CHOICES = 1024               # n x prompts of one request


@dataclass
class ServerOptions:
    """The `loom serve` flags an API server honours (see frontend/entrypoints/cli.py for their help)."""
    api_key: str | None = None
    enable_control_endpoints: bool = False
    max_request_body_bytes: int = 8 * 1024 * 1024
    trust_request_chat_template: bool = False
    chat_template_content_format: str = "auto"
    enable_prompt_tokens_details: bool = False
    enable_tokenizer_info_endpoint: bool = False
    enable_orca_load_metrics: bool = False
    lora_modules: list[str] | None = None   # --lora-modules (frontend/openai/lora_api.py)
    stream_interval: int = 1                # --stream-interval: tokens per stream chunk (AsyncLLM)

    @classmethod
    def pick(cls, opts: dict) -> "ServerOptions":
        names = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in opts.items() if k in names})


def _version() -> str:
    try:
        from importlib.metadata import version
        return version("loom")
    except Exception:
        return "0.1.0"


def _json(obj: Any, status: int = 200, headers: dict | None = None) -> web.Response:
    return web.Response(body=dumps(obj), status=status, content_type="application/json", headers=headers)


def _answer_body(ctx: GenerationContext, collected: list) -> bytes:
    """A non-streamed answer, encoded, from its outputs."""
    for i, out in collected:
        (ctx.chat_delta(out) if ctx.chat else ctx.completion_delta(i, out))
    return dumps(ctx.chat_body() if ctx.chat else ctx.completion_body())


def _error_response(e: APIError, headers: dict | None = None, path: str = "") -> web.Response:
    """In OpenAI's shape, or in Anthropic's on its paths (/v1/messages...)."""
    if path.startswith(anthropic.ANTHROPIC_PATH):
        return _json(anthropic.error_body(e.message, e.status), e.status, headers)
    return _json(e.body(), e.status, headers)


class _Tokenizers:
    """Two lanes: small inputs in a thread of their own, so they never wait behind a huge one;
    large ones (encoding and chat templates) in the tokenizer process (frontend/openai/tokenizer_proc.py),
    where the work of a client that has gone is killed, not finished. Other large work (decode,
    token strings), and large inputs while no tokenizer process can be had, run in a second
    thread. Each thread has its own tokenizer (a HF fast tokenizer is not safe to share)."""

    def __init__(self, tokenizer, source: str | None, trust_remote_code: bool = False):
        self.small = (ThreadPoolExecutor(1, thread_name_prefix="loom-tokenize"), tokenizer)
        self.large = (ThreadPoolExecutor(1, thread_name_prefix="loom-tokenize-large"), copy.deepcopy(tokenizer))
        self.process = TokenizerProcess(source, trust_remote_code) if source else None

    async def run(self, size: int, fn, *args, **kwargs):
        """fn(tokenizer, *args, **kwargs) in the thread for an input of `size` characters (or bytes)."""
        executor, tokenizer = self.small if size <= _SMALL_INPUT_CHARS else self.large
        return await asyncio.get_running_loop().run_in_executor(
            executor, functools.partial(fn, tokenizer, *args, **kwargs))

    async def encode(self, size: int, prompts: list, add_special_tokens: bool,
                     limit: int | None = None) -> list[tuple[str | None, list[int]]]:
        """tokenize_prompts() (frontend/processing.py) of a request body of `size` bytes; `limit`:
        the most tokens a prompt that can run has (a longer one is refused early)."""
        texts = [p for p in prompts if isinstance(p, str)]
        if not texts:   # token ids: nothing to tokenize, no thread hop
            try:
                return tokenize_prompts(None, prompts, add_special_tokens, limit)
            except RequestError as e:
                raise value_error(e) from None
        if size > _SMALL_INPUT_CHARS and self.process is not None:
            where = [i for i, p in enumerate(prompts) if isinstance(p, str)]
            ids = await self.process.run(EncodeJob(texts, add_special_tokens, limit, where))
            if ids is not None:
                it = iter(ids)
                return [(p, next(it)) if isinstance(p, str) else (None, p) for p in prompts]
        try:
            return await self.run(size, tokenize_prompts, prompts, add_special_tokens, limit)
        except RequestError as e:
            raise value_error(e) from None

    async def chat(self, size: int, messages: list[dict], **kwargs) -> list[int]:
        """render_chat()'s token ids (frontend/chat_utils.py), for a request body of `size` bytes.
        A request's own chat template renders in the tokenizer process whatever its size, within
        LOOM_CHAT_TEMPLATE_TIMEOUT_S: its loops can run for ever, and only a process can be stopped."""
        own_template = (kwargs.get("chat_template") is not None
                        or "chat_template" in (kwargs.get("chat_template_kwargs") or {}))
        # an image's or audio clip's URL is one placeholder in the template: a request with a 1 MB
        # image and a short text takes the small lane (it went to the tokenizer process, whose
        # start took ~10 s of a VL benchmark's first requests on the H200)
        size = max(size - media_chars(messages), 0)
        if (size > _SMALL_INPUT_CHARS or own_template) and self.process is not None:
            budget = envs.LOOM_CHAT_TEMPLATE_TIMEOUT_S if own_template else None
            ids = await self.process.run(ChatJob(messages, **kwargs), budget)
            if ids is not None:
                return ids[0]
        if own_template:
            raise APIError("A request's own chat template renders in the tokenizer process, which cannot be "
                           "started now; retry later.", 503)
        try:
            return (await self.run(size, render_chat, messages, **kwargs))[1]
        except RequestError as e:
            raise value_error(e) from None

    def shutdown(self) -> None:
        for executor, _ in (self.small, self.large):
            executor.shutdown(wait=False, cancel_futures=True)
        if self.process is not None:
            self.process.close()


class OpenAIServer:
    def __init__(self, llm, options: ServerOptions | None = None):
        self.llm = llm
        self.config = llm.config
        self.tokenizer = llm.tokenizer
        self.options = options or ServerOptions()
        if self.options.stream_interval < 1:
            raise ValueError(f"--stream-interval must be at least 1, got {self.options.stream_interval}")
        llm.stream_interval = self.options.stream_interval
        self.limits = Limits.of(self.config)
        self.model_name = self.config.model_name
        self.created = now()
        self.tokenizers = _Tokenizers(self.tokenizer, getattr(llm, "tokenizer_source", None),
                                      self.config.trust_remote_code)
        self.handling = 0      # requests whose handler runs (shutdown waits for their last bytes)
        fmt = self.options.chat_template_content_format
        self.content_format = (detect_content_format(getattr(self.tokenizer, "chat_template", None))
                               if fmt == "auto" else fmt)
        parser = getattr(self.config, "reasoning_parser", None)
        self.reasoning_parser = REASONING_PARSERS[parser]() if parser else None
        # gpt-oss speaks harmony: prompts rendered and outputs parsed by openai-harmony, not by the
        # chat template and the text parsers (frontend/openai/harmony.py)
        self.harmony = (is_harmony_model(getattr(self.config, "model", "")) or parser == "openai_gptoss"
                        or getattr(self.config, "tool_call_parser", None) == "gpt_oss")
        if self.harmony:
            self.reasoning_parser = None
        self._think_ids: tuple[list[int], list[int]] | None = None   # <think>, </think> as token ids
        self.loras = LoRARegistry(self)        # --enable-lora: adapters by name (frontend/openai/lora_api.py)
        self.responses = ResponsesAPI(self)    # /v1/responses and its store
        self.messages = MessagesAPI(self)      # /v1/messages (Anthropic's)
        self.load = LoadAPI(self, self.options.enable_orca_load_metrics)   # /load, /server_info, ORCA header
        # Counted in the API server, which does not track the engine a request ran on: with one
        # engine its index, with data parallelism "all" (every metric carries `engine`, section 7).
        self.tool_parser_engine = "0" if getattr(self.config, "data_parallel_size", 1) == 1 else "all"
        self.tool_parser_invocations = Builder().counter(
            "vllm:tool_call_parser_invocations", "Total number of ToolParser invocations. Non-streaming increments "
            "once per choice; streaming increments once per delta.",
            ("model_name", "engine", "mode", "outcome", "request_type"))
        for mode in ("streaming", "non_streaming"):
            for outcome in ("tool_call", "no_tool_call"):
                for request_type in ("chat_completions", "responses", "other"):
                    self.tool_parser_invocations.labels(self.model_name, self.tool_parser_engine, mode, outcome,
                                                        request_type)

    # ------------------------------------------------------------ plumbing

    def check_alive(self) -> None:
        if self.llm.is_dead:
            raise APIError(engine_dead_message(self.llm.dead_reason), 503)

    def _check_model(self, name: str | None) -> None:
        if self.loras.resolve(name) is None:   # an adapter's name is a model too
            check_model(name, self.model_name, getattr(self.config, "model", None))

    async def _tokenize_bad_words(self, params: SamplingParams) -> SamplingParams:
        """vLLM's bad_words as token ids, in the tokenizer's thread, checked once per request."""
        if not params.bad_words:
            return params
        params = await self.tokenizers.run(sum(map(len, params.bad_words)), tokenize_bad_words, params)
        try:
            check_bad_words_token_ids(params, self.limits)
        except RequestError as e:
            raise value_error(e) from None
        return params

    def _prompt_limit(self, req: CompletionRequest | ChatCompletionRequest) -> int | None:
        """The most prompt tokens that can run (check_prompt), so that a longer prompt is refused
        before it is tokenized in full; None when the request truncates its prompt."""
        return None if req.truncate_prompt_tokens is not None else self.config.max_model_len - 1

    def _truncate(self, ids: list[int], req: CompletionRequest | ChatCompletionRequest) -> list[int]:
        try:
            return truncate_prompt(ids, req.truncate_prompt_tokens, self.config.max_model_len, req.truncation_side)
        except RequestError as e:
            raise value_error(e) from None

    def _check_prompt(self, ids: list[int], params: SamplingParams, index: int | None = None) -> None:
        try:
            check_prompt(ids, params, self.limits)
        except RequestError as e:
            err = value_error(e)
            if index is not None and index > 0:
                err.message = f"prompt[{index}]: {err.message}"
                err.args = (err.message,)
            raise err from None

    async def handlers_done(self, timeout: float) -> None:
        """Wait (at most `timeout` s) until no handler runs, then a moment for aiohttp to write
        the responses they returned."""
        deadline = asyncio.get_running_loop().time() + timeout
        while self.handling and asyncio.get_running_loop().time() < deadline:
            await asyncio.sleep(0.01)
        await asyncio.sleep(0.02)

    @web.middleware
    async def _middleware(self, request: web.Request, handler):
        self.handling += 1
        try:
            return await self._handle(request, handler)
        finally:
            self.handling -= 1

    async def _handle(self, request: web.Request, handler):
        try:
            if self.options.api_key is not None and request.path not in _OPEN_PATHS:
                auth = request.headers.get("Authorization", "")
                # Anthropic's clients send the key as x-api-key
                token = auth[7:] if auth[:7].lower() == "bearer " else request.headers.get("x-api-key", "")
                # (aiohttp keeps a header's non-UTF-8 bytes as surrogate escapes)
                if not hmac.compare_digest(token.encode("utf-8", "surrogateescape"), self.options.api_key.encode()):
                    raise APIError("Incorrect or missing API key: send 'Authorization: Bearer <key>' (or "
                                   "'x-api-key: <key>').", 401,
                                   type="AuthenticationError")
            if getattr(self.llm, "draining", False) and request.path != "/metrics":
                raise APIError("The server is shutting down.", 503)
            return await handler(request)
        except APIError as e:
            return _error_response(e, path=request.path)
        except web.HTTPException as e:
            if e.status < 400:
                raise
            headers = {"Allow": e.headers["Allow"]} if "Allow" in e.headers else None
            msg = e.reason
            if e.status == 404:
                msg = f"Not found: {request.method} {request.path}"
            elif e.status == 405:
                msg = f"Method {request.method} is not allowed on {request.path}"
            return _error_response(APIError(msg, e.status), headers, request.path)
        except EngineDeadError as e:
            return _error_response(APIError(engine_dead_message(e or self.llm.dead_reason), 503), path=request.path)
        except (asyncio.CancelledError, ConnectionResetError):
            raise
        except Exception:  # noqa: BLE001
            # the details (and the traceback) go to the log only: an error body never shows code or paths
            logger.exception("error handling %s %s", request.method, request.path)
            return _error_response(APIError("Internal server error (see the server log)", 500), path=request.path)

    async def body(self, request: web.Request, cls=None):
        """The request body as `cls` (None: the bytes), bounded by --max-request-body-bytes."""
        try:
            raw = await request.read()
        except web.HTTPRequestEntityTooLarge:
            raise APIError(f"The request body is larger than {self.options.max_request_body_bytes} bytes "
                           "(--max-request-body-bytes).", 413) from None
        except web.RequestPayloadError as e:  # e.g. a Content-Encoding the body does not have
            # the body ends here and the connection closes after the answer: aiohttp would read
            # on into the broken body and log its error again, as an ERROR with a traceback
            request.content.feed_eof()
            request.protocol.close()
            raise APIError(f"The request body cannot be read: {e}", 400) from None
        return raw if cls is None else parse_request(raw, cls)

    # ------------------------------------------------------------ simple endpoints

    async def health(self, request: web.Request) -> web.Response:
        if self.llm.is_dead:
            return _json(error_body(engine_dead_message(self.llm.dead_reason), 503), 503)
        if getattr(self.llm, "engine_stalled", False):
            return _json(error_body("The engine has stopped stepping (no heartbeat).", 503), 503)
        return web.Response(status=200)

    async def metrics(self, request: web.Request) -> web.Response:
        """Prometheus exposition (all API servers' values under `loom serve`); open like /health."""
        body, content_type = await asyncio.get_running_loop().run_in_executor(
            None, render_metrics, request.headers.get("Accept"))
        return web.Response(body=body, headers={"Content-Type": content_type})

    async def version(self, request: web.Request) -> web.Response:
        return _json({"version": _version()})

    async def models(self, request: web.Request) -> web.Response:
        models = models_response(self.model_name, self.config.model, self.config.max_model_len, self.created,
                                 self.quantization)
        models["data"] += self.loras.model_cards(self.created)
        return _json(models)

    async def model(self, request: web.Request) -> web.Response:
        name = request.match_info["model"]
        self._check_model(name)
        if (card := next((c for c in self.loras.model_cards(self.created) if c["id"] == name), None)) is not None:
            return _json(card)
        return _json(models_response(self.model_name, self.config.model, self.config.max_model_len,
                                     self.created, self.quantization)["data"][0])

    @functools.cached_property
    def quantization(self) -> str | None:
        return weight_quantization(self.config)

    async def tokenize(self, request: web.Request) -> web.Response:
        req: TokenizeRequest = await self.body(request, TokenizeRequest)
        self._check_model(req.model)
        if (req.prompt is None) == (req.messages is None):
            raise APIError("give exactly one of 'prompt' (a string) or 'messages'", 400, "prompt")
        size = request.content_length or 0
        if req.prompt is not None:
            add_special = True if req.add_special_tokens is None else req.add_special_tokens
            [(_, ids)] = await self.tokenizers.encode(size, [req.prompt], add_special)
        else:
            check_request_chat_template(req, self.options.trust_request_chat_template)
            messages = self._messages(req)
            check_tools(req.tools)
            for modality, urls in (("image", image_urls(messages)), ("audio", audio_urls(messages))):
                if urls and (getattr(self.llm, "mm", None) is None or len(urls) > self.config.mm_limit(modality)):
                    try:   # refused as a chat request would be (items are not decoded here: vLLM's /tokenize
                        # does not expand them either)
                        mm_reject(self.config, len(urls), modality)
                    except MediaError as e:
                        raise APIError(str(e), 400, "messages") from None
            ids = await self.tokenizers.chat(
                size, messages,
                add_generation_prompt=True if req.add_generation_prompt is None else req.add_generation_prompt,
                continue_final_message=bool(req.continue_final_message), tools=req.tools,
                chat_template_kwargs=req.chat_template_kwargs, chat_template=req.chat_template,
                add_special_tokens=bool(req.add_special_tokens))
        token_strs = None
        if req.return_token_strs:
            token_strs = await self.tokenizers.run(size, lambda tok: tok.convert_ids_to_tokens(ids))
        return _json({"count": len(ids), "max_model_len": self.config.max_model_len, "tokens": ids,
                      "token_strs": token_strs})

    async def detokenize(self, request: web.Request) -> web.Response:
        """Strict, as OpenAI: an id outside the vocabulary is a 400 (vLLM decodes it to "")."""
        req: DetokenizeRequest = await self.body(request, DetokenizeRequest)
        self._check_model(req.model)
        vocab = max(self.config.vocab_size or 0, len(self.tokenizer))
        bad = [t for t in req.tokens if not 0 <= t < vocab]
        if bad:
            raise APIError(f"token ids out of the vocabulary: {bad[:8]}", 400, "tokens")
        text = await self.tokenizers.run(len(req.tokens), lambda tok: tok.decode(req.tokens))
        return _json({"prompt": text})

    async def tokenizer_info(self, request: web.Request) -> web.Response:
        """vLLM's GET /tokenizer_info (--enable-tokenizer-info-endpoint): the tokenizer's configuration."""
        tok = self.tokenizer
        info = {k: v for k, v in (getattr(tok, "init_kwargs", None) or {}).items() if k != "tokenizer_object"}
        info = msgspec.json.decode(msgspec.json.encode(info, enc_hook=str))  # JSON-safe (AddedToken -> str)
        info["tokenizer_class"] = type(tok).__name__
        template = getattr(tok, "chat_template", None)
        if template:
            info["chat_template"] = template
        return _json(info)

    async def _add_server_index(self, request: web.Request, response: web.StreamResponse) -> None:
        """on_response_prepare, so streamed responses (prepared inside the handler) get it too."""
        response.headers[SERVER_INDEX_HEADER] = str(getattr(self.llm, "client_index", 0))

    # ------------------------------------------------------------ completions

    async def completions(self, request: web.Request) -> web.StreamResponse:
        return await self._completions(request, await self.body(request, CompletionRequest))

    async def _completions(self, request: web.Request, req: CompletionRequest) -> web.StreamResponse:
        self._check_model(req.model)
        check_stream_options(req)
        prompts = completion_prompts(req.prompt)
        if len(prompts) > MAX_PROMPTS:
            raise APIError(f"prompt list length {len(prompts)} exceeds the maximum of {MAX_PROMPTS}", 400, "prompt")
        constraint = None
        if may_constrain(req):   # xgrammar: off the loop (two thread hops were ~15% of a short request's CPU)
            constraint = await self.tokenizers.run(0, lambda _: request_constraint(req))
        params = await self._tokenize_bad_words(build_sampling_params(
            req, chat=False, limits=self.limits, defaults=self.config.default_sampling_params, structured=constraint))
        if len(prompts) * params.n > MAX_CHOICES:
            raise APIError(f"n x prompts = {len(prompts) * params.n} exceeds the maximum of {MAX_CHOICES} "
                           "choices per request", 400, "n")
        self.check_alive()
        add_special = True if req.add_special_tokens is None else req.add_special_tokens
        encoded = await self.tokenizers.encode(request.content_length or 0, prompts, add_special,
                                               self._prompt_limit(req))
        encoded = [Prompt(text, self._truncate(ids, req)) for text, ids in encoded]
        for i, p in enumerate(encoded):
            self._check_prompt(p.token_ids, params, i if len(encoded) > 1 else None)
        echo_texts = None
        if req.echo:
            if req.truncate_prompt_tokens is not None:
                encoded = [Prompt(None, p.token_ids) for p in encoded]   # echo what the model saw
            echo_texts = [p.text if p.text is not None else
                          await self.tokenizers.run(len(p.token_ids), lambda tok, ids=p.token_ids: tok.decode(ids))
                          for p in encoded]
        include_usage, continuous = stream_usage(req)
        ctx = GenerationContext(request=request, req=req, chat=False, rid=random_id("cmpl"), created=now(),
                                model=self.model_name, params=params, prompts=encoded, include_usage=include_usage,
                                continuous_usage=continuous,
                                prompt_tokens_details=self.options.enable_prompt_tokens_details,
                                decode=lambda tid: self.tokenizer.decode([tid]), echo_texts=echo_texts)
        return await self._generate(ctx)

    # ------------------------------------------------------------ chat

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        return await self._chat_completions(request, await self.body(request, ChatCompletionRequest))

    async def _chat_completions(self, request: web.Request, req: ChatCompletionRequest) -> web.StreamResponse:
        ctx, mm_items = await self.prepare_chat(request, req)
        return await self._generate(ctx, mm_items)

    async def prepare_chat(self, request: web.Request, req: ChatCompletionRequest,
                           rid_prefix: str = "chatcmpl", request_type: str = "chat_completions"
                           ) -> tuple[GenerationContext, list]:
        """A chat request, checked, templated and tokenized, its images stored: the context of its
        generation and its multimodal items. /v1/responses and /v1/messages translate into a
        ChatCompletionRequest and come through here too (frontend/openai/serving_responses.py,
        serving_messages.py): one chat path."""
        self._check_model(req.model)
        check_stream_options(req)
        check_request_chat_template(req, self.options.trust_request_chat_template)
        messages = self._messages(req)
        if may_constrain(req):   # xgrammar: off the loop
            tools, constraint = await self.tokenizers.run(0, lambda _: self._chat_constraint(req))
        else:
            tools, constraint = self._chat_constraint(req)
        if self.harmony and constraint is not None:   # a grammar from the first token has no channels to parse
            raise APIError("a gpt-oss (harmony) chat cannot be constrained yet: tool_choice 'required' or a named "
                           "tool, response_format and structured_outputs are not supported with it", 400,
                           "tool_choice" if tools.mode in ("required", "named") else "response_format")
        params = await self._tokenize_bad_words(build_sampling_params(
            req, chat=True, limits=self.limits, defaults=self.config.default_sampling_params, structured=constraint))
        if tools.mode == "auto" and tools.parser.keeps_special_tokens and req.skip_special_tokens is None:
            params.skip_special_tokens = False   # its markers are special tokens (vLLM's adjust_request)
        self.check_alive()
        add_generation_prompt = True if req.add_generation_prompt is None else req.add_generation_prompt
        if self.harmony:
            ids = self._harmony_prompt(messages, req)
        else:
            ids = await self.tokenizers.chat(
                request.content_length or 0, messages,
                add_generation_prompt=add_generation_prompt,
                continue_final_message=bool(req.continue_final_message),
                tools=req.tools if req.tool_choice != "none" else None,
                chat_template_kwargs=req.chat_template_kwargs, chat_template=req.chat_template,
                add_special_tokens=bool(req.add_special_tokens), limit=self._prompt_limit(req))
        ids = self._truncate(ids, req)
        ids, mm_items = await self._images(messages, ids, req.mm_processor_kwargs)
        try:
            self._check_prompt(ids, params)
        except APIError:
            if mm_items:
                self.llm.mm.unref(mm_items)
            raise
        # vLLM: the answer's role is the assistant's, or the last message's when continuing it; echo
        # prepends the last message's content when it has that role
        role = "assistant" if add_generation_prompt else messages[-1]["role"]
        echo_texts = None
        if req.echo:
            echo_texts = [message_text(messages[-1]) if messages[-1]["role"] == role else ""]
        include_usage, continuous = stream_usage(req)
        ctx = GenerationContext(request=request, req=req, chat=True, rid=random_id(rid_prefix), created=now(),
                                model=self.model_name, params=params, prompts=[Prompt(None, ids)],
                                include_usage=include_usage, continuous_usage=continuous,
                                prompt_tokens_details=self.options.enable_prompt_tokens_details,
                                echo_texts=echo_texts, role=role, tools=tools,
                                reasoning=self._reasoning_for(ids, constraint is not None),
                                on_tool_parse=functools.partial(self._count_tool_parse, request_type=request_type),
                                harmony=self.harmony)
        return ctx, mm_items

    def _harmony_prompt(self, messages: list[dict], req: ChatCompletionRequest) -> list[int]:
        """A gpt-oss chat's prompt, rendered by openai-harmony: 400 for what harmony cannot say
        (a role, a reasoning effort), 500 when its vocabulary cannot be loaded (offline)."""
        try:
            return render_prompt(messages, req.tools if req.tool_choice != "none" else None, req.reasoning_effort)
        except HarmonyUnavailable as e:
            raise APIError(str(e), 500) from None
        except ValueError as e:
            raise APIError(str(e), 400, "messages") from None

    async def _images(self, messages: list[dict], ids: list[int], mm_kwargs) -> tuple[list[int], list]:
        """Load a chat's images (http(s) fetched here; decoding and the HF processor off the
        loop), expand their placeholders and put them in the shared-memory store."""
        by_modality = {"image": image_urls(messages), "audio": audio_urls(messages)}
        mm = getattr(self.llm, "mm", None)
        modality = mm.modality if mm is not None else "image"
        urls = by_modality.pop(modality)
        try:
            for other, its in by_modality.items():   # (the model's modality is never here)
                if its:
                    mm_reject(self.config, len(its), other)
            if not urls:
                return ids, []
            if mm is None:
                mm_reject(self.config, len(urls))
            return await mm.process_urls(ids, urls, mm_kwargs, self.config.allowed_local_media_path)
        except MediaError as e:
            raise APIError(str(e), 400, "messages") from None
        except StoreBusy as e:
            raise APIError(str(e), 503) from None

    def _reasoning_for(self, ids: list[int], constrained: bool) -> ReasoningParser | None:
        """The reasoning parser of a chat's output, by how its prompt left the thinking: none for a
        constrained chat whose prompt closed it (the engine constrains its output from the first
        token, so all of it is the answer: it came back as reasoning_content, and a named tool's
        call was lost); reasoning up to </think> when the prompt opened it (a stream sent it as
        content, then again as reasoning, and lost the answer)."""
        parser = self.reasoning_parser
        if parser is None:
            return None
        if self._think_ids is None:
            self._think_ids = tuple(self.tokenizer.encode(tag, add_special_tokens=False)
                                    for tag in (parser.start, parser.end))
        state = prompt_thinking(ids, *self._think_ids)
        if state == "closed" and constrained:
            return None
        return reasoning_after_prompt(parser, state)

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

    def _count_tool_parse(self, output: ChatOutput, streaming: bool, request_type: str = "chat_completions") -> None:
        """vllm:tool_call_parser_invocations, for tool_choice "auto" (where the parser runs)."""
        if output.tools.mode != "auto":
            return
        called = bool(output.tool_calls)
        self.tool_parser_invocations.labels(self.model_name, self.tool_parser_engine,
                                            "streaming" if streaming else "non_streaming",
                                            "tool_call" if called else "no_tool_call", request_type).inc()

    def _messages(self, req: ChatCompletionRequest | TokenizeRequest) -> list[dict]:
        """The request's messages, parsed for the chat template (frontend/chat_utils.py)."""
        try:
            return parse_chat_messages(req.messages, self._content_format(req))
        except RequestError as e:
            raise value_error(e) from None

    def _content_format(self, req: ChatCompletionRequest | TokenizeRequest) -> str:
        if req.chat_template is not None and self.options.chat_template_content_format == "auto":
            return detect_content_format(req.chat_template)
        return self.content_format

    # ------------------------------------------------------------ both

    def _dp_rank(self, request: web.Request) -> dict:
        """generate()'s data_parallel_rank from the X-data-parallel-rank header, when it has one."""
        values = request.headers.getall(DP_RANK_HEADER, [])
        if not values:
            return {}
        if len(values) > 1:
            raise APIError(f"{DP_RANK_HEADER} is given {len(values)} times; give one rank", 400)
        value = values[0]
        try:
            return {"data_parallel_rank": check_rank(value, self.config.data_parallel_size)}
        except ValueError as e:
            raise APIError(f"{DP_RANK_HEADER}: {e}", 400) from None

    def start(self, ctx: GenerationContext, mm_items: list | None = None):
        """The engine's outputs of every prompt of `ctx`, merged: (prompt index, RequestOutput)."""
        try:
            extra = self._dp_rank(ctx.request)
            if ctx.req.use_beam_search:
                try:
                    check_beam_search(ctx.params, ctx.params.structured_outputs is not None, bool(mm_items))
                except ValueError as e:
                    raise APIError(str(e), 400, "use_beam_search") from None
        except APIError:
            if mm_items:   # they never reach the engine: the store's references go back
                self.llm.mm.unref(mm_items)
            raise
        if mm_items:
            extra["mm_items"] = mm_items   # a chat's images (one prompt)
        if ctx.req.priority:
            extra["priority"] = ctx.req.priority
        if len(ctx.prompts) > 1:   # its prompts share one fair share of the engine's batch
            extra["group_id"] = ctx.rid
        if (lora := self.loras.resolve(ctx.req.model)) is not None:
            extra["lora_request"] = lora
            ctx.model = lora.lora_name   # (the response names the adapter, as vLLM's)
        if ctx.req.use_beam_search:
            return merge([self._beam_search(ctx, p.token_ids, f"{ctx.rid}-{i}", extra)
                          for i, p in enumerate(ctx.prompts)])
        gens = [self.llm.generate(p.token_ids, ctx.params, f"{ctx.rid}-{i}" if not ctx.chat else ctx.rid, **extra)
                for i, p in enumerate(ctx.prompts)]
        return merged(gens)

    def _beam_search(self, ctx: GenerationContext, prompt: list[int], request_id: str, extra: dict):
        """vLLM's beam search over the engine (frontend/openai/beam_search.py): one answer at the end."""
        params = ctx.params
        room = self.config.max_model_len - len(prompt)
        max_tokens = room if params.max_tokens is None else min(params.max_tokens, room)
        end_ids = frozenset(self.config.eos_token_ids or ()) | frozenset(params.stop_token_ids or ())
        length_penalty = 1.0 if ctx.req.length_penalty is None else ctx.req.length_penalty
        skip = params.skip_special_tokens
        return beam_search(self.llm.generate, prompt, params, length_penalty, end_ids, max_tokens, request_id,
                           extra, lambda ids: self.tokenizer.decode(ids, skip_special_tokens=skip))

    async def _generate(self, ctx: GenerationContext, mm_items: list | None = None) -> web.StreamResponse:
        stream = self.start(ctx, mm_items)
        try:
            first = await first_output(stream)
            if not ctx.req.stream:
                collected = [item async for item in outputs(first, stream)]
                if ctx.may_be_large:   # hundreds of MB of logprobs take seconds: on a thread, the
                    # loop gets the GIL back every switch interval and keeps serving the others
                    body = await asyncio.get_running_loop().run_in_executor(None, _answer_body, ctx, collected)
                else:
                    body = _answer_body(ctx, collected)
                return web.Response(body=body, content_type="application/json")
            resp = await sse_response(ctx.request)
            if ctx.chat:
                return await self._stream_chat(ctx, resp, stream, first)
            return await self._stream_completions(ctx, resp, stream, first)
        finally:
            await stream.aclose()

    async def _stream_completions(self, ctx: GenerationContext, resp, stream, first) -> web.StreamResponse:
        def final() -> bytes:
            return ctx.completion_chunk([], ctx.usage()) if ctx.include_usage else b""

        # every choice's chunk of an output in one write (a send() each)
        return await pump_sse(resp, stream, first, ctx.completion_events, final)

    async def _stream_chat(self, ctx: GenerationContext, resp, stream, first) -> web.StreamResponse:
        def final() -> bytes:
            return ctx.chat_chunk([], ctx.usage()) if ctx.include_usage else b""

        return await pump_sse(resp, stream, first, ctx.chat_events, final, begin=ctx.chat_begin())

    async def invocations(self, request: web.Request) -> web.StreamResponse:
        """SageMaker's POST /invocations: a chat request when the body has "messages", a completion
        when it has "prompt" (vLLM dispatches the same way)."""
        raw = await self.body(request)
        try:
            keys = msgspec.json.decode(raw, type=dict[str, msgspec.Raw])
        except (msgspec.DecodeError, msgspec.ValidationError, RecursionError, UnicodeDecodeError):
            raise APIError("The request body must be a JSON object.", 400) from None
        if "messages" in keys:
            return await self._chat_completions(request, parse_request(raw, ChatCompletionRequest))
        if "prompt" in keys:
            return await self._completions(request, parse_request(raw, CompletionRequest))
        raise APIError("Cannot tell the request type: /invocations takes a chat request ('messages') or a "
                       "completion request ('prompt').", 400)

    # ------------------------------------------------------------ app

    def build(self) -> web.Application:
        app = web.Application(middlewares=[HttpMetrics().middleware, self._middleware,  # metrics outermost
                                           self.load.count_in_flight],
                              client_max_size=self.options.max_request_body_bytes)
        routes = [("POST", "/v1/completions", self.completions),
                  ("POST", "/v1/chat/completions", self.chat_completions),
                  ("POST", "/invocations", self.invocations),
                  ("GET", "/v1/models", self.models), ("GET", "/v1/models/{model:.+}", self.model),
                  ("GET", "/health", self.health), ("GET", "/metrics", self.metrics),
                  ("GET", "/version", self.version),
                  ("POST", "/tokenize", self.tokenize), ("POST", "/detokenize", self.detokenize)]
        routes += (self.responses.routes() + self.messages.routes() + TranscriptionAPI(self).routes()
                   + self.load.routes())
        if self.options.enable_tokenizer_info_endpoint:
            routes.append(("GET", "/tokenizer_info", self.tokenizer_info))
        routes += control_routes(self)  # sleep, pause, weight updates, the profiler, ... (ipc/control.py)
        routes = ServingPooling(self).with_routes(routes)  # embeddings, score, rerank (serving_pooling.py)
        routes += self.loras.routes()   # /v1/load_lora_adapter, /v1/unload_lora_adapter
        add = {"GET": app.router.add_get, "POST": app.router.add_post,  # add_get also answers HEAD
               "DELETE": app.router.add_delete}
        for method, path, handler in routes:
            add[method](path, handler)
        app.on_response_prepare.append(self._add_server_index)  # X-Loom-Server-Index on every response
        app.on_response_prepare.append(self.load.add_orca_header)
        app[SERVER_KEY] = self
        app.on_cleanup.append(self._on_cleanup)
        if self.options.lora_modules:   # registered before the server listens
            modules = parse_lora_modules(self.options.lora_modules)
            app.on_startup.append(lambda app: self.loras.add_modules(modules))
        return app

    async def _on_cleanup(self, app) -> None:
        self.responses.close()
        self.tokenizers.shutdown()


def build_app(llm, **options) -> web.Application:
    return OpenAIServer(llm, ServerOptions.pick(options)).build()


async def serve(llm, host: str = "127.0.0.1", port: int = 8000, sock: socket.socket | None = None,
                access_log: bool = False, ready: asyncio.Event | None = None, shutdown_timeout: float = 3.0,
                on_built=None, **options) -> None:
    """Serve until cancelled. `sock`: an already-bound listening socket (shared by several API
    server processes), else bind host:port. `ready` is set once listening; `on_built(server)` is
    called with the OpenAIServer first. On shutdown, requests in flight get `shutdown_timeout`
    seconds to finish. `options`: ServerOptions fields (others are ignored)."""
    app = build_app(llm, **options)
    if on_built is not None:
        on_built(app[SERVER_KEY])
    runner = OpenAIErrorRunner(app, handler_cancellation=True, shutdown_timeout=shutdown_timeout,
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
