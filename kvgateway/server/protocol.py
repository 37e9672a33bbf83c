"""The HTTP server's own error answers, in OpenAI's shape and without echoing the request.

aiohttp answers a request it cannot parse (a bad request line, a header with a control
character, broken framing) before any middleware runs, with a text body that quotes the
offending bytes, and logs the whole line at ERROR: a key sent with a stray control
character would land in the log and in the response. :class:`GatewayRunner` serves with a
request handler whose ``handle_error`` answers such requests with an OpenAI-style JSON
error naming only the kind of problem, and logs a one-line warning without the bytes.
"""

from __future__ import annotations

import json
import logging
from typing import Any

from aiohttp import web
from aiohttp.http_exceptions import HttpProcessingError
from aiohttp.web_protocol import RequestHandler, RequestPayloadError
from aiohttp.web_request import BaseRequest

log = logging.getLogger("kvgateway.server.protocol")

_BAD_HTTP = json.dumps(
    {
        "error": {
            "message": "The request is not valid HTTP (request line, headers or body framing).",
            "type": "invalid_request_error",
            "param": None,
            "code": "invalid_http",
        }
    }
).encode()
_INTERNAL = json.dumps(
    {
        "error": {
            "message": "The gateway failed to handle this request.",
            "type": "internal_error",
            "param": None,
            "code": "internal_error",
        }
    }
).encode()


class _GatewayRequestHandler(RequestHandler):
    def handle_error(
        self,
        request: BaseRequest,
        status: int = 500,
        exc: BaseException | None = None,
        message: str | None = None,
    ) -> web.StreamResponse:
        if request.writer.output_size > 0:
            raise ConnectionError("Response is sent already, cannot send an error response")
        kind = type(exc).__name__ if exc is not None else "error"
        if status >= 500:
            log.error("request from %s failed: %s", request.remote, kind, exc_info=exc)
            body = _INTERNAL
        else:
            log.warning("unparsable HTTP request from %s (%s)", request.remote, kind)
            body = _BAD_HTTP
        resp = web.Response(status=status, body=body, content_type="application/json")
        resp.force_close()
        return resp


class _GatewayServer(web.Server):
    def __call__(self) -> RequestHandler:
        return _GatewayRequestHandler(self, loop=self._loop, **self._kwargs)


class _AnsweredPayloadErrors(logging.Filter):
    """aiohttp reads what is left of a request body after the answer; a body that cannot
    be decoded (broken gzip, bad chunking) fails again there and would be logged with a
    traceback, though the client already got its 400. Those records are dropped."""

    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        return not isinstance(exc, HttpProcessingError | RequestPayloadError)


_PAYLOAD_FILTER = _AnsweredPayloadErrors()


class GatewayRunner(web.AppRunner):
    """An ``AppRunner`` whose connections answer unparsable requests as described above."""

    def __init__(self, app: web.Application, **kwargs: Any) -> None:
        super().__init__(app, **kwargs)
        logging.getLogger("aiohttp.server").addFilter(_PAYLOAD_FILTER)  # a set: added once

    async def _make_server(self) -> web.Server:
        server = await super()._make_server()
        # Same server, our handler class: aiohttp builds both with private arguments.
        server.__class__ = _GatewayServer
        return server
