"""POST /v1/messages and POST /v1/messages/count_tokens: Anthropic's Messages API over the chat
path. A request is translated into a ChatCompletionRequest (frontend/openai/anthropic.py) and
runs as a chat does (OpenAIServer.prepare_chat: template, tokenization, tools, reasoning parser,
structured outputs, images); its answer is translated back. Errors, before and during a stream,
are Anthropic's {"type": "error", "error": {"type", "message"}} (the API server's middleware
answers every path under /v1/messages so); `x-api-key` is the API key's header here (the
middleware takes it on every path)."""
from __future__ import annotations

from aiohttp import web

from frontend.openai import anthropic
from frontend.openai.anthropic import CountTokensRequest, MessageStream, MessagesRequest
from frontend.openai.protocol import ChatCompletionRequest, dumps
from frontend.openai.serving import chat_answer, chat_deltas, first_output, pump_sse, sse_response, translate


class MessagesAPI:
    def __init__(self, server):
        self.server = server

    def routes(self) -> list[tuple[str, str, object]]:
        return [("POST", "/v1/messages", self.create), ("POST", "/v1/messages/count_tokens", self.count_tokens)]

    async def create(self, request: web.Request) -> web.StreamResponse:
        server = self.server
        req: MessagesRequest = await server.body(request, MessagesRequest)
        chat_req = translate(anthropic.chat_request(req), ChatCompletionRequest)
        ctx, mm_items = await server.prepare_chat(request, chat_req, "msg", "other")
        rid = anthropic.message_id(ctx.rid)
        prompt_tokens = len(ctx.prompts[0].token_ids)
        stream = server.start(ctx, mm_items)
        try:
            first = await first_output(stream)
            if not req.stream:
                chat = await chat_answer(ctx, stream, first)
                msg = chat["choices"][0]["message"]
                reason = anthropic.stop_reason(ctx.choices[0].finish_reason, ctx.choices[0].stop_reason,
                                               bool(msg.get("tool_calls")))
                body = anthropic.message(rid, server.model_name, anthropic.content_blocks(msg), reason,
                                         anthropic.usage(prompt_tokens, chat["usage"]["completion_tokens"]))
                return web.Response(body=dumps(body), content_type="application/json")
            events = MessageStream(anthropic.message(rid, server.model_name, [], (None, None),
                                                     anthropic.usage(prompt_tokens, 0)))
            resp = await sse_response(request)

            def emit(item) -> bytes:
                return b"".join(events.delta(d) for d in chat_deltas(ctx, item[1]))

            def final() -> bytes:
                c = ctx.choices[0]
                reason = anthropic.stop_reason(c.finish_reason, c.stop_reason, events.tool_calls)
                return events.end(reason, anthropic.usage(prompt_tokens, c.num_tokens))

            return await pump_sse(resp, stream, first, emit, final, begin=events.begin(),
                                  error_event=anthropic.error_event, done=b"")
        finally:
            await stream.aclose()

    async def count_tokens(self, request: web.Request) -> web.Response:
        """The prompt's tokens as the request would run it: template, tools and images (expanded)."""
        server = self.server
        req: CountTokensRequest = await server.body(request, CountTokensRequest)
        chat_req = translate(anthropic.chat_request(req), ChatCompletionRequest)
        ctx, mm_items = await server.prepare_chat(request, chat_req, "msg", "other")
        if mm_items:   # counted, never run: the store's references go back
            server.llm.mm.unref(mm_items)
        return web.Response(body=dumps({"input_tokens": len(ctx.prompts[0].token_ids)}),
                            content_type="application/json")
