"""OpenAI-shaped answers for the requests aiohttp refuses before any handler runs.

aiohttp's HTTP parser answers a request it cannot parse (headers over 8,190 bytes, a duplicate
Content-Length, a Content-Encoding it cannot decode, a malformed request line) itself, with a
plain-text body, and no middleware sees it. A client of an OpenAI-compatible server reads
`{"error": {...}}` from every 4xx, so `OpenAIErrorRunner` makes the server's connections use a
protocol whose `handle_error` answers in that shape, and closes the connection after the answer,
as before. A 4xx is logged at DEBUG, not as an ERROR with a traceback.
"""
from __future__ import annotations

from http import HTTPStatus

import msgspec
from aiohttp import web
from aiohttp.web_protocol import RequestHandler

from frontend.openai.protocol import error_body


class _OpenAIErrorHandler(RequestHandler):
    def handle_error(self, request, status: int = 500, exc: BaseException | None = None,
                     message: str | None = None) -> web.StreamResponse:
        if status >= 500:
            super().handle_error(request, status, exc, message)   # logs; raises if a response was begun
        else:   # a client's malformed request: no ERROR with a traceback (any client could fill the log)
            self.logger.debug("refused a malformed request from %s: %s", request.remote, message or exc)
            if request.writer.output_size > 0:
                raise ConnectionError("a response was begun: no error answer can follow it")
        text = message
        if status >= 500 or not message:   # a 500 here is a bug of ours (the middleware answers
            text = _phrase(status)         # the handlers' errors): details go to the log only
        resp = web.Response(status=status, body=msgspec.json.encode(error_body(text, status)),
                            content_type="application/json")
        resp.force_close()
        return resp


def _phrase(status: int) -> str:
    try:
        return f"{status} {HTTPStatus(status).phrase}"
    except ValueError:
        return str(status)


class _OpenAIErrorServer(web.Server):
    def __call__(self) -> RequestHandler:   # the protocol factory: one handler per connection
        return _OpenAIErrorHandler(self, loop=self._loop, **self._kwargs)


class OpenAIErrorRunner(web.AppRunner):
    """web.AppRunner whose connections answer parser errors in OpenAI's error shape."""

    async def _make_server(self) -> web.Server:
        server = await super()._make_server()
        server.__class__ = _OpenAIErrorServer   # same state, our protocol factory
        return server
