"""POST /v1/responses, GET /v1/responses/{id}, POST /v1/responses/{id}/cancel and
DELETE /v1/responses/{id}: OpenAI's Responses API over the chat path.

A request is translated into a ChatCompletionRequest (frontend/openai/responses.py) and runs as
a chat does (OpenAIServer.prepare_chat: template, tokenization, tools, reasoning parser,
structured outputs, images); its answer is translated back. `store` (default true) keeps the
response (frontend/openai/response_store.py) for GET, previous_response_id and, with
`background: true`, cancel: a background request answers at once ("queued") and generates in a
task of its own, which cancel ends (the engine aborts the request)."""
from __future__ import annotations

import asyncio
import copy
import logging
import re

from aiohttp import web

from frontend.errors import EngineDeadError, engine_dead_message
from frontend.openai.protocol import APIError, ChatCompletionRequest, dumps
from frontend.openai.response_store import ResponseStore, StoredResponse
from frontend.openai.responses import (ResponseStream, ResponsesRequest, chat_request, finish, input_messages,
                                       output_items, output_messages, skeleton)
from frontend.openai.serving import chat_answer, chat_deltas, first_output, pump_sse, sse_response, translate

logger = logging.getLogger("loom.api")


def _json(obj, status: int = 200) -> web.Response:
    return web.Response(body=dumps(obj), status=status, content_type="application/json")


# the chat request's fields that a Responses request spells otherwise
_FIELD_NAMES = {"max_tokens": "max_output_tokens", "messages": "input", "response_format": "text.format"}


def _as_responses_error(e: APIError) -> APIError:
    """An error of the chat path, naming the field as the client sent it."""
    name = _FIELD_NAMES.get(e.param or "")
    if name is None:
        return e
    return APIError(re.sub(rf"\b{re.escape(e.param)}\b", name, e.message), e.status, name, e.type)


class ResponsesAPI:
    def __init__(self, server):
        self.server = server
        self.store = ResponseStore()

    def routes(self) -> list[tuple[str, str, object]]:
        return [("POST", "/v1/responses", self.create),
                ("GET", "/v1/responses/{response_id}", self.retrieve),
                ("DELETE", "/v1/responses/{response_id}", self.delete),
                ("POST", "/v1/responses/{response_id}/cancel", self.cancel)]

    def _stored(self, rid: str, param: str | None = None) -> StoredResponse:
        entry = self.store.get(rid)
        if entry is None:
            raise APIError(f"Response with id '{rid}' not found.", 404, param, "invalid_request_error")
        return entry

    # ------------------------------------------------------------ create

    async def create(self, request: web.Request) -> web.StreamResponse:
        server = self.server
        req: ResponsesRequest = await server.body(request, ResponsesRequest)
        store = req.store is not False
        if req.background and not store:
            raise APIError("background responses need store=true", 400, "background")
        if req.background and req.stream:
            raise APIError("background responses cannot be streamed here; poll GET /v1/responses/{id}", 400,
                           "stream")
        history: list[dict] = []
        if req.previous_response_id is not None:
            prev = self._stored(req.previous_response_id, "previous_response_id")
            if prev.response["status"] in ("queued", "in_progress"):
                raise APIError(f"Response '{req.previous_response_id}' is still {prev.response['status']}", 400,
                               "previous_response_id")
            history = prev.conversation + output_messages(prev.response["output"])
        conversation = history + input_messages(req.input)
        chat_req = translate(chat_request(req, conversation), ChatCompletionRequest)
        try:
            ctx, mm_items = await server.prepare_chat(request, chat_req, "resp", "responses")
        except APIError as e:
            raise _as_responses_error(e) from None
        response = skeleton("resp_" + ctx.rid.split("-", 1)[1], req, server.model_name, "in_progress")
        if req.background:
            entry = StoredResponse(response, conversation)
            response["status"] = "queued"
            entry.task = asyncio.create_task(self._background(entry, ctx, mm_items))
            self.store.put(entry)
            body = dumps(response)
            # one turn of the loop: the task takes its first step (a task cancelled before it would
            # never run its cleanup, and its images would stay in the store)
            await asyncio.sleep(0)
            return web.Response(body=body, content_type="application/json")
        stream = server.start(ctx, mm_items)
        try:
            first = await first_output(stream)
            if not req.stream:
                chat = await chat_answer(ctx, stream, first)
                finish(response, output_items(chat["choices"][0]["message"]), ctx.choices[0].finish_reason,
                       chat["usage"])
                if store:
                    self.store.put(StoredResponse(copy.deepcopy(response), conversation))
                return _json(response)
            return await self._stream(ctx, response, stream, first, conversation if store else None)
        finally:
            await stream.aclose()

    async def _stream(self, ctx, response: dict, stream, first, conversation: list[dict] | None):
        events = ResponseStream(response)
        resp = await sse_response(ctx.request)

        def emit(item) -> bytes:
            return b"".join(events.delta(d) for d in chat_deltas(ctx, item[1]))

        def final() -> bytes:
            tail = events.end(ctx.choices[0].finish_reason, ctx.usage())
            if conversation is not None:
                self.store.put(StoredResponse(copy.deepcopy(events.response), conversation))
            return tail

        def error_event(message: str, status: int, param: str | None = None) -> bytes:
            return events.error(message, status)

        return await pump_sse(resp, stream, first, emit, final, begin=events.begin(), error_event=error_event,
                              done=b"")

    async def _background(self, entry: StoredResponse, ctx, mm_items) -> None:
        response = entry.response
        stream = None
        try:
            stream = self.server.start(ctx, mm_items)
            response["status"] = "in_progress"
            chat = await chat_answer(ctx, stream, await first_output(stream))
            finish(response, output_items(chat["choices"][0]["message"]), ctx.choices[0].finish_reason,
                   chat["usage"])
        except asyncio.CancelledError:
            response["status"] = "cancelled"
        except (APIError, EngineDeadError, ValueError) as e:
            response["status"] = "failed"
            message = engine_dead_message(e) if isinstance(e, EngineDeadError) else str(e)
            response["error"] = {"code": "server_error" if isinstance(e, EngineDeadError) else "invalid_request",
                                 "message": message}
        except Exception:  # noqa: BLE001  (a task's error goes nowhere else)
            logger.exception("background response %s failed", response["id"])
            response["status"] = "failed"
            response["error"] = {"code": "server_error", "message": "Internal server error (see the server log)"}
        finally:
            entry.task = None
            if stream is not None:
                await stream.aclose()

    # ------------------------------------------------------------ stored

    async def retrieve(self, request: web.Request) -> web.Response:
        return _json(self._stored(request.match_info["response_id"]).response)

    async def delete(self, request: web.Request) -> web.Response:
        rid = request.match_info["response_id"]
        entry = self._stored(rid)
        if entry.task is not None:
            entry.task.cancel()
        self.store.pop(rid)
        return _json({"id": rid, "object": "response", "deleted": True})

    async def cancel(self, request: web.Request) -> web.Response:
        """OpenAI's: only a background response can be cancelled; one that has ended is answered as it is."""
        entry = self._stored(request.match_info["response_id"])
        if not entry.response["background"]:
            raise APIError("Only responses created with background=true can be cancelled", 400)
        task = entry.task
        if task is not None:
            task.cancel()
            await asyncio.wait([task])
            if entry.response["status"] in ("queued", "in_progress"):   # (cancelled before its first step)
                entry.response["status"] = "cancelled"
            entry.task = None
        return _json(entry.response)

    def close(self) -> None:
        for task in self.store.running():
            task.cancel()
