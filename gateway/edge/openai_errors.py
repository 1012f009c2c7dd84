"""Errors in OpenAI's shape: a JSON answer, an SSE event for a stream already begun, routing's give-up."""

from __future__ import annotations

import msgspec
from aiohttp import web

from gateway.routing import GiveUp
from gateway.settings import GatewaySettings

_ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                404: "invalid_request_error", 405: "invalid_request_error", 408: "invalid_request_error",
                413: "invalid_request_error",
                429: "rate_limit_error"}  # fmt: skip


def openai_error(status: int, message: str, code: str | None = None, retry_after: int | None = None) -> web.Response:
    body = {"error": {"message": message, "type": _ERROR_TYPES.get(status, "server_error"), "param": None,
                      "code": code}}  # fmt: skip
    headers = {"Retry-After": str(retry_after)} if retry_after else None
    return web.json_response(body, status=status, headers=headers)


def sse_error(end: GiveUp) -> bytes:
    """An error event the openai client raises on, for a stream that broke after it began."""
    body = {"error": {"message": end.message, "type": "server_error", "param": None, "code": end.code}}
    return b"data: " + msgspec.json.encode(body) + b"\n\n"


def give_up(step: GiveUp, settings: GatewaySettings) -> web.Response:
    return openai_error(step.status, step.message, step.code, settings.retry_after if step.retry_after else None)
