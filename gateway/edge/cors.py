"""Cross-origin calls from web pages, answered as llama-server answers them (measured on b11434,
its defaults: --cors-origins *, --cors-methods "GET, POST, DELETE, OPTIONS", --cors-headers *,
--cors-credentials on): a preflight gets 200 with the Origin reflected, and every answer to an
allowed Origin names it. A preflight carries no key, so it is answered before the key check."""

from __future__ import annotations

from urllib.parse import urlsplit

from aiohttp import web

from gateway.edge.app_keys import SETTINGS
from gateway.edge.openai_errors import openai_error

METHODS = "GET, POST, DELETE, OPTIONS"
LOCAL_HOSTS = frozenset({"localhost", "127.0.0.1", "::1"})


def allowed(origin: str, setting: str) -> bool:
    """Whether a page of `origin` may call: "*" any, "localhost" a localhost page, else the list."""
    if setting.strip() == "*":
        return True
    if setting.strip() == "localhost":
        try:
            return urlsplit(origin).hostname in LOCAL_HOSTS
        except ValueError:
            return False
    return origin in {o.strip() for o in setting.split(",") if o.strip()}


@web.middleware
async def preflights(request: web.Request, handler):
    origin = request.headers.get("Origin")
    if request.method != "OPTIONS" or origin is None or "Access-Control-Request-Method" not in request.headers:
        return await handler(request)
    if not allowed(origin, request.app[SETTINGS].cors_origins):
        return openai_error(403, f"origin {origin!r} may not call this gateway (--cors-origins)", "origin_not_allowed")
    return web.Response(headers={"Access-Control-Allow-Origin": origin, "Access-Control-Allow-Credentials": "true",
                                 "Access-Control-Allow-Methods": METHODS, "Access-Control-Allow-Headers": "*",
                                 "Vary": "Origin"})  # fmt: skip


async def name_the_origin(request: web.Request, response: web.StreamResponse) -> None:
    """on_response_prepare: every answer to an allowed page names its origin (streams too, whose
    headers go before any middleware could add to them)."""
    origin = request.headers.get("Origin")
    if origin and "Access-Control-Allow-Origin" not in response.headers and allowed(
            origin, request.app[SETTINGS].cors_origins):  # fmt: skip
        response.headers["Access-Control-Allow-Origin"] = origin  # (llama-server says no more on an answer)
        response.headers.add("Vary", "Origin")
