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


def openai_error(status: int, message: str, code: str | None = None, retry_after: int | None = None,
                 detail: tuple[tuple[str, int], ...] = ()) -> web.Response:  # fmt: skip
    body = {"error": {"message": message, "type": _ERROR_TYPES.get(status, "server_error"), "param": None,
                      "code": code, **dict(detail)}}  # fmt: skip
    headers = {"Retry-After": str(retry_after)} if retry_after else None
    return web.json_response(body, status=status, headers=headers)


_ANTHROPIC_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                    404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error",
                    503: "overloaded_error", 529: "overloaded_error"}  # fmt: skip


def anthropic_error(response: web.Response) -> web.Response:
    """An error the gateway answered itself, in Anthropic's shape (what the anthropic client reads):
    {"type": "error", "error": {"type", "message"}}, the gateway's code kept beside them."""
    try:
        said = msgspec.json.decode(response.body or b"")
    except (msgspec.DecodeError, TypeError):
        return response
    error = said.get("error") if isinstance(said, dict) else None
    if not isinstance(error, dict) or said.get("type") == "error":
        return response
    kept = {k: v for k, v in error.items() if k not in ("message", "type", "param")}  # its code and details
    body = {"type": "error", "error": {"type": _ANTHROPIC_TYPES.get(response.status, "api_error"),
                                       "message": error.get("message", ""), **kept}}  # fmt: skip
    headers = {k: v for k, v in response.headers.items() if k == "Retry-After"}
    return web.json_response(body, status=response.status, headers=headers or None)


def sse_error(end: GiveUp) -> bytes:
    """An error event the openai client raises on, for a stream that broke after it began."""
    body = {"error": {"message": end.message, "type": "server_error", "param": None, "code": end.code}}
    return b"data: " + msgspec.json.encode(body) + b"\n\n"


def give_up(step: GiveUp, settings: GatewaySettings) -> web.Response:
    return openai_error(step.status, step.message, step.code, settings.retry_after if step.retry_after else None,
                        step.detail)  # fmt: skip
