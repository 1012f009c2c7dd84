"""The gateway's HTTP edge: OpenAI-compatible routes in front of the lanes (aiohttp).

Bodies are relayed chunk by chunk as the lane sends them (SSE included); nothing is
buffered whole. This module only performs the I/O: which lane to try after a failure,
and when to give up, is gateway/routing.py's to decide. Errors are OpenAI's shape.
"""

from __future__ import annotations

import asyncio
import socket
import time
from collections.abc import AsyncIterator
from pathlib import Path
from dataclasses import dataclass, replace

import aiohttp
import msgspec
import structlog
from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from gateway import access, adapters, assemble, prompts, routing, usage, waking
from gateway.admission import Admission, AdmissionError, Lease, Refused
from gateway.quota import UsageBook
from gateway.tenants import PLAIN, KeysFile, Tenant
from gateway.affinity import Fingerprint, fingerprint
from gateway.fleet import FleetView
from gateway.metrics import GatewayMetrics
from gateway.routing import Attempt, Failure, GiveUp
from gateway.settings import GatewaySettings
from gateway.tokens import count_tokens

log = structlog.get_logger("lanes.gateway")

VIEW = web.AppKey("view", FleetView)
ADMISSION = web.AppKey("admission", Admission)
METRICS = web.AppKey("metrics", GatewayMetrics)
SETTINGS = web.AppKey("settings", GatewaySettings)
SESSION = web.AppKey("session", aiohttp.ClientSession)
WAKER = web.AppKey("waker", waking.Waker)
KEYS = web.AppKey("keys", object)  # a KeysFile, or None without --keys-file
USAGE = web.AppKey("usage", UsageBook)  # tenants' tokens this minute and day, every gateway's
TENANT = web.RequestKey("tenant", Tenant)  # the request's Tenant, as its key said

PROXIED = ("/v1/chat/completions", "/v1/completions", "/v1/embeddings", "/v1/rerank", "/rerank")
_ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                404: "invalid_request_error", 405: "invalid_request_error", 413: "invalid_request_error",
                429: "rate_limit_error"}  # fmt: skip


def openai_error(status: int, message: str, code: str | None = None, retry_after: int | None = None) -> web.Response:
    body = {"error": {"message": message, "type": _ERROR_TYPES.get(status, "server_error"), "param": None,
                      "code": code}}  # fmt: skip
    headers = {"Retry-After": str(retry_after)} if retry_after else None
    return web.json_response(body, status=status, headers=headers)


def _sse_error(end: GiveUp) -> bytes:
    """An error event the openai client raises on, for a stream that broke after it began."""
    body = {"error": {"message": end.message, "type": "server_error", "param": None, "code": end.code}}
    return b"data: " + msgspec.json.encode(body) + b"\n\n"


# ------------------------------------------------------------------ middleware


@web.middleware
async def _errors_and_keys(request: web.Request, handler):
    settings = request.app[SETTINGS]
    keyed = bool(settings.api_keys) or request.app[KEYS] is not None
    if keyed and access.needs_key(request.path) and not _key_presented(request, settings):
        return openai_error(401, "missing or invalid API key (Authorization: Bearer ...)", "invalid_api_key")
    try:
        return await handler(request)
    except web.HTTPException as exc:
        if not request.path.startswith("/v1/") or exc.status < 400:
            raise
        code = {404: "not_found", 405: "method_not_allowed", 413: "request_too_large"}.get(exc.status)
        return openai_error(exc.status, exc.reason if exc.status != 413 else exc.text or exc.reason, code)


def _key_presented(request: web.Request, settings: GatewaySettings) -> bool:
    """A valid bearer key, or (dashboard paths only) a valid session cookie (gateway/access.py)."""
    scheme, _, presented = request.headers.get("Authorization", "").partition(" ")
    if scheme.lower() == "bearer":
        tenant = tenant_of(request.app, presented.strip())
        if tenant is not None:
            request[TENANT] = tenant
            return True
    token = request.cookies.get(access.COOKIE)
    return bool(token) and access.cookie_may_open(request.path) and access.session_ok(
        signing_keys(request.app), token, time.time())


def tenant_of(app: web.Application, presented: str) -> Tenant | None:
    """The tenant a bearer key names (keys file, then --api-key as tenant `default`); None: no such key."""
    keys: KeysFile | None = app[KEYS]
    if keys is not None:
        return keys.table.find(presented)
    return Tenant(PLAIN) if app[SETTINGS].key_ok(presented) else None


def signing_keys(app: web.Application) -> tuple[str, ...]:
    """What the dashboard's session cookie is signed with: the plain keys and the keys file's digests."""
    keys: KeysFile | None = app[KEYS]
    return app[SETTINGS].api_keys + (tuple(sorted(keys.table.by_digest)) if keys is not None else ())


# ------------------------------------------------------------------ routes


async def _health(request: web.Request) -> web.Response:
    """Liveness: the process answers. Readiness (/ready) also needs the fleet read from NATS."""
    view = request.app[VIEW]
    ready = sum(lane.routable for lane in view.lanes())
    return web.json_response({"status": "ok", "synced": view.synced, "lanes_routable": ready})


async def _ready(request: web.Request) -> web.Response:
    view = request.app[VIEW]
    if not view.synced:
        return web.json_response({"status": "not ready", "reason": "fleet not read from NATS yet"}, status=503)
    return web.json_response({"status": "ok"})


async def _models(request: web.Request) -> web.Response:
    """Every servable model, loaded or not, with its state (ready, loading, unloaded, failed) and lanes."""
    return web.json_response({"object": "list", "data": waking.catalogue(request.app[VIEW])})


async def _metrics(request: web.Request) -> web.Response:
    body = generate_latest(request.app[METRICS].registry)
    return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})


async def _proxy(request: web.Request) -> web.StreamResponse:
    app = request.app
    started = time.perf_counter()
    body = await request.read()  # bounded by client_max_size: past it aiohttp answers 413
    try:
        payload = msgspec.json.decode(body)
    except msgspec.DecodeError as exc:
        return openai_error(400, f"request body is not JSON: {exc}", "invalid_json")
    name = payload.get("model") if isinstance(payload, dict) else None
    view, metrics = app[VIEW], app[METRICS]
    if not isinstance(name, str) or not name:
        # As llama-server itself: a fleet of one model serves a request that names none.
        name, why = waking.only_model(waking.catalogue(view))
        if name is None:
            return openai_error(400, f"the request names no model (field 'model') and {why}", "model_required")
    name = adapters.requested(name, payload)  # a LoRA adapter: "base:adapter"
    model = waking.classify(view, name)
    label = model.name if model.state != "unknown" else "unknown"  # bounded labels: no client-chosen names
    tenant: Tenant = request.get(TENANT) or Tenant()
    request[TENANT] = tenant
    refused = _tenant_refusal(app, tenant, name)
    if refused is not None:
        metrics.tenant_requests.labels(tenant.name, tenant.klass, str(refused.status)).inc()
        return refused
    if model.state != "unknown":
        app[WAKER].touch(name)  # a request: the idle clock restarts (probes and scrapes never come here)
    try:
        response = await _answer(request, model, name, payload, body, started, label)
    except asyncio.CancelledError:  # the client hung up (handler cancellation): nginx's 499
        metrics.requests.labels(label, "499").inc()
        raise
    metrics.requests.labels(label, str(response.status)).inc()
    metrics.tenant_requests.labels(tenant.name, tenant.klass, str(response.status)).inc()
    metrics.latency.labels(label).observe(time.perf_counter() - started)
    return response


def _tenant_refusal(app: web.Application, tenant: Tenant, name: str) -> web.Response | None:
    """403 for a model the key may not use; 429 naming the token limit the tenant is over."""
    if not tenant.may_use(name):
        app[METRICS].refusals.labels(tenant.name, tenant.klass, "model_not_allowed").inc()
        return openai_error(403, f"the key of tenant {tenant.name!r} may not use model {name!r}", "model_not_allowed")
    over = app[USAGE].check(tenant, time.time())
    if over is not None:
        app[METRICS].refusals.labels(tenant.name, tenant.klass, over.code).inc()
        return openai_error(429, str(over), over.code, over.retry_after)
    return None


async def _answer(
    request: web.Request, model: waking.ModelView, name: str, payload: object, body: bytes, started: float, label: str
) -> web.StreamResponse:
    app, view = request.app, request.app[VIEW]
    images = prompts.takes_images(request.path, payload)
    if images and model.state != "unknown" and not _takes_images(view, name):
        return openai_error(400, f"model {name!r} takes no images: no multimodal projector (mmproj) is paired with "
                            "it on its hosts (put a *mmproj*.gguf beside its file)", "images_not_supported")  # fmt: skip
    response = await _held(request, model) if model.state != "ready" else None
    if response is None:
        prompt = prompts.prompt_of(request.path, payload)
        refused, too_small, tokens = await _window_check(request, name, prompt, body)
        if images:  # lanes without a projector cannot read it: as if too small for it
            too_small |= {lane.key for lane in view.lanes_for(name) if not lane.vision}
        if refused is not None:
            response = _give_up(refused, app[SETTINGS])
        else:
            lanes = view.lanes_for(name)
            mark = fingerprint(lanes[0].model, prompt.text) if prompt is not None and lanes else None
            if tokens is None and prompt is not None and prompt.kind != "embedding":
                tokens = prompt.token_bound()  # an upper bound: a first-byte timeout on the safe side
            streamed = isinstance(payload, dict) and payload.get("stream") is True
            kind = assemble.kind_of(request.path, payload)  # a plain answer, asked as a stream
            if kind is not None:
                body = assemble.streamed_body(payload)
            shape = Shape(label, mark, too_small, tokens, streamed, kind)
            response = await _forward(request, name, body, started, shape)
    return response


def _takes_images(view, name: str) -> bool:
    """A lane of the model has a projector, or the planner says its lanes will (an unloaded model)."""
    entry = view.model_entry(name)
    return any(lane.vision for lane in view.lanes_for(name)) or bool(entry and entry.vision)


async def _held(request: web.Request, model: waking.ModelView) -> web.Response | None:
    """A model with no ready lane: unknown is a 404 at once; otherwise the request is held
    while it loads (woken over the bus). None: go on and forward it."""
    waker, settings = request.app[WAKER], request.app[SETTINGS]
    if model.state == "unknown":
        return openai_error(404, f"model {model.name!r} is not served by this fleet; GET /v1/models lists what is",
                            "model_not_found")  # fmt: skip
    if model.state == "failed":
        return openai_error(502, f"model {model.name!r} failed to load: {model.reason}", waking.LoadFailed.code)
    try:
        await waker.wait_ready(model, settings.load_timeout)  # None: predicted load time + a margin
    except waking.LoadFailed as exc:
        return openai_error(exc.status, str(exc), exc.code)
    except waking.LoadTimeout as exc:
        return openai_error(exc.status, str(exc), exc.code, exc.retry_after)
    except waking.HeldFull as exc:
        return openai_error(exc.status, str(exc), exc.code, settings.retry_after)
    return None


async def _window_check(
    request: web.Request, name: str, prompt: prompts.Prompt | None, body: bytes
) -> tuple[GiveUp | None, frozenset, int | None]:
    """(the 400 when no lane's window holds the prompt, the lanes too small for it, its tokens if counted).

    Only a prompt whose byte bound passes a window is counted, by a routable lane's tokenizer;
    when none can count it, every lane is tried and the lane itself refuses what it cannot hold.
    """
    windows = {lane.key: lane.window for lane in request.app[VIEW].lanes_for(name)}
    known = [w for w in windows.values() if w > 0]
    if prompt is None or prompt.kind == "embedding" or not known or prompt.token_bound() < min(known):
        return None, frozenset(), None
    counter = next((lane for lane in request.app[VIEW].routable(name)), None)
    tokens = None if counter is None else await count_tokens(
        request.app[SESSION], counter.url, prompt, body, request.app[SETTINGS].connect_timeout)
    if tokens is None:
        return None, frozenset(), None
    return routing.context_exceeded(windows, tokens), routing.too_small(windows, tokens), tokens


@dataclass(frozen=True)
class Shape:
    """What the edge read of a request that decides how it is forwarded."""

    label: str = ""  # the model's metric label
    mark: Fingerprint | None = None  # the prompt's chunk hashes (prefix affinity)
    too_small: frozenset = frozenset()  # lanes whose window cannot hold it
    tokens: int | None = None  # its prompt's tokens (counted, or their upper bound)
    streamed: bool = False  # "stream": true: the first token's time is the first byte's
    assembled: str | None = None  # plain, asked of the lane as a stream and put together (gateway/assemble.py)


async def _forward(
    request: web.Request, name: str, body: bytes, started: float, shape: Shape = Shape()
) -> web.StreamResponse:
    """Tries lanes until one answers or routing gives up; each failure goes into the history it decides on."""
    app = request.app
    view, admission, settings = app[VIEW], app[ADMISSION], app[SETTINGS]
    history: list[Attempt] = []
    while True:
        step = routing.decide([lane.key for lane in view.lanes_for(name) if lane.key not in shape.too_small], history,
                              request_timeout=settings.request_timeout)  # fmt: skip
        if isinstance(step, GiveUp):
            return _give_up(step, settings)
        if step.retry:
            app[METRICS].retries.labels(name).inc()
        tenant: Tenant = request.get(TENANT) or Tenant()
        try:
            lease = await admission.acquire(name, exclude=step.exclude | shape.too_small, prompt=shape.mark,
                                            who=tenant)  # fmt: skip
        except Refused as exc:  # its class's ceiling, or its tenant's limit: named, with when to come back
            app[METRICS].refusals.labels(tenant.name, tenant.klass, exc.code).inc()
            return openai_error(429, str(exc), exc.code, exc.retry_after)
        except AdmissionError as exc:
            history.append(Attempt(None, Failure.NO_SLOT, str(exc), exc.status, exc.code))
            continue
        if not history:
            app[METRICS].queue_wait.labels(shape.label or name).observe(time.perf_counter() - started)
            app[METRICS].tenant_queue_wait.labels(tenant.name, tenant.klass).observe(time.perf_counter() - started)
        lane = lease.lane
        remaining = max(0.001, settings.request_timeout - (time.perf_counter() - started))
        wait = remaining
        if shape.streamed or shape.assembled:
            wait = routing.first_byte_timeout(settings.first_byte_timeout, shape.tokens,
                                              admission.counts.prefill_rate.get(lane.key), total=remaining)  # fmt: skip
        upstream, first = None, b""
        try:
            async with asyncio.timeout(wait):
                upstream = await app[SESSION].post(
                    lane.url + request.path,
                    data=adapters.body_for(body, name, lane),
                    headers={"Content-Type": "application/json", "Accept": request.headers.get("Accept", "*/*")},
                    timeout=aiohttp.ClientTimeout(total=None, connect=settings.connect_timeout),
                )
                if (shape.streamed or shape.assembled) and upstream.status == 200:
                    first = await upstream.content.readany()  # the first token: the prefill is done
                    lease.prefilled()
        except aiohttp.ClientConnectionError as exc:  # refused, reset, closed before answering
            _drop(upstream, lease)
            how = Failure.UNREACHABLE if isinstance(exc, aiohttp.ClientConnectorError) else Failure.DROPPED
            _lane_failed(view, Attempt(lane.key, how, f"{type(exc).__name__} {exc}"), history)
            continue
        except asyncio.TimeoutError:
            _drop(upstream, lease)  # closing the connection stops the lane's work on it
            if wait < remaining:  # no first token in the time its prefill should take: stalled, try another
                _lane_failed(view, Attempt(lane.key, Failure.STALLED, f"no first token within {wait:g} s"), history)
            else:  # the request's own time is up
                history.append(Attempt(lane.key, Failure.TIMEOUT))
            continue
        except BaseException:
            _drop(upstream, lease)
            raise
        if upstream.status in routing.RETRY_STATUSES:
            upstream.release()
            lease.release()
            history.append(Attempt(lane.key, Failure.STATUS, status=upstream.status))
            continue
        if upstream.status == 400 and (upstream.content_length or routing.REFUSAL_BYTES + 1) <= routing.REFUSAL_BYTES:
            first = await upstream.read()  # relayed as the answer's first chunk unless it is a window refusal
            tokens = routing.context_refusal(first)
            if tokens is not None:
                windows = {x.key: x.window for x in view.lanes_for(name)}
                smaller = routing.too_small(windows, tokens) | {lane.key}
                refused = routing.context_exceeded(windows, tokens)
                if refused is not None or set(windows) - smaller:
                    upstream.release()
                    lease.release()
                    if refused is not None:
                        return _give_up(refused, settings)
                    shape = replace(shape, too_small=shape.too_small | smaller, tokens=tokens)
                    continue  # counted now: to a lane whose window holds it
        sse = upstream.headers.get("Content-Type", "").startswith("text/event-stream")
        if shape.assembled and upstream.status == 200 and sse:  # (a lane that answers plain is relayed as it is)
            return await _assembled(request, upstream, lease, started, first, shape.assembled)
        return await _relay(request, upstream, lease, started, first)


def _drop(upstream: aiohttp.ClientResponse | None, lease: Lease) -> None:
    if upstream is not None:
        upstream.close()
    lease.release()


def _lane_failed(view: FleetView, attempt: Attempt, history: list[Attempt]) -> None:
    """Log a lane's failure, take the lane out of rotation where routing says so, and remember it."""
    host, lane = attempt.lane
    log.warning("lane failed before answering", lane=lane, host=host, error=routing.describe(attempt))
    if reason := routing.unreachable_reason(attempt):
        view.mark_unreachable(attempt.lane, reason)
    if reason := routing.stalled_reason(attempt):
        view.mark_stalled(attempt.lane, reason)
    history.append(attempt)


def _count_usage(app: web.Application, lease: Lease, found: usage.Usage | None, output: int = 0) -> None:
    if found is not None:
        lane = lease.lane
        tokens = app[ADMISSION].charge(lease.tenant, found.prompt, output)  # its fair share
        app[USAGE].add(lease.tenant, tokens, time.time())  # its token limits
        tenant: Tenant = app[KEYS].table.tenants().get(lease.tenant, Tenant(lease.tenant)) if app[KEYS] else Tenant(
            lease.tenant)
        app[METRICS].tenant_tokens.labels(tenant.name, tenant.klass, "prompt").inc(found.prompt)
        app[METRICS].tenant_tokens.labels(tenant.name, tenant.klass, "output").inc(output)
        admission = app[ADMISSION]
        counts = admission.counts
        counts.note_prompt(lane.alias, f"{lane.host_id}/{lane.lane_id}", found.prompt, found.cached)
        if found.prefill_rate is not None:
            counts.note_prefill(lane.key, found.prefill_rate)
        admission.measured(lease, found.prompt, found.cached)


def _give_up(step: GiveUp, settings: GatewaySettings) -> web.Response:
    return openai_error(step.status, step.message, step.code, settings.retry_after if step.retry_after else None)


class _Stalled(Exception):
    """No byte from the lane for the idle timeout, mid-answer."""


class _TimeUp(Exception):
    """The request's own time ran out while its answer still flowed: the lane is not to blame."""


async def _chunks(upstream: aiohttp.ClientResponse, first: bytes, idle: float, deadline: float) -> AsyncIterator[bytes]:
    """The lane's answer chunk by chunk, each within `idle` seconds and all before `deadline` (loop time)."""
    loop = asyncio.get_running_loop()
    if first:
        yield first
    while True:
        left = deadline - loop.time()
        if left <= 0:
            raise _TimeUp
        try:
            async with asyncio.timeout(min(idle, left)):
                chunk = await upstream.content.readany()
        except TimeoutError:
            raise (_TimeUp if idle >= left else _Stalled) from None
        if not chunk:
            return
        yield chunk


async def _relay(
    request: web.Request, upstream: aiohttp.ClientResponse, lease: Lease, started: float, first_chunk: bytes = b""
) -> web.StreamResponse:
    """Copy the lane's answer as it arrives; a break after the first byte ends the stream with an error.

    A stream that reaches the request timeout while it still flows is ended, and its lane stays in
    rotation; one whose lane sends nothing for --stream-idle-timeout marks the lane stalled.
    """
    app, lane, settings = request.app, lease.lane, request.app[SETTINGS]
    resp = web.StreamResponse(status=upstream.status)
    for header in ("Content-Type", "Content-Encoding", "Cache-Control"):
        if header in upstream.headers:
            resp.headers[header] = upstream.headers[header]
    if upstream.content_length is not None:
        resp.content_length = upstream.content_length
    resp.headers["X-Lanes-Lane"] = f"{lane.host_id}/{lane.lane_id}"
    finished = False
    streamed = upstream.headers.get("Content-Type", "").startswith("text/event-stream")
    kept, kept_bytes = [], 0  # the answer (plain) or its tail (stream), for its prompt usage
    limit = usage.STREAM_TAIL_BYTES if streamed else usage.PLAIN_BODY_BYTES
    counting = upstream.status == 200 and not request.path.endswith("/embeddings")  # vectors: nothing cached
    deadline = asyncio.get_running_loop().time() + settings.request_timeout - (time.perf_counter() - started)
    try:
        await resp.prepare(request)
        first = True
        try:
            async for chunk in _chunks(upstream, first_chunk, settings.stream_idle_timeout, deadline):
                if first:
                    app[METRICS].ttfb.labels(lane.alias).observe(time.perf_counter() - started)
                    first = False
                await resp.write(chunk)
                if counting and (streamed or kept_bytes <= limit):
                    kept.append(chunk)
                    kept_bytes += len(chunk)
                    while streamed and len(kept) > 1 and kept_bytes - len(kept[0]) >= limit:
                        kept_bytes -= len(kept.pop(0))
            finished = True
            if counting and (streamed or kept_bytes <= limit):
                answer = b"".join(kept)
                _count_usage(app, lease, usage.prompt_usage(answer, streamed), usage.output_tokens(answer, streamed))
        except (aiohttp.ClientError, asyncio.TimeoutError, _Stalled, _TimeUp) as exc:
            # Bytes went out: routing ends the answer with its error, whatever other lanes there are.
            end = _broken(app, lane, exc)
            if streamed:
                await resp.write(_sse_error(end))
            else:
                raise  # a plain answer cut short: drop the connection, the client sees it incomplete
        await resp.write_eof()
    except (ConnectionResetError, aiohttp.ClientConnectionResetError):
        pass  # the client left; closing upstream below stops the lane's generation
    finally:
        if finished:
            upstream.release()
        else:
            upstream.close()
        lease.release()
        app[WAKER].touch(lane.alias)  # the answer's end counts as use too: a long stream is not idle time
    return resp


async def _assembled(
    request: web.Request, upstream: aiohttp.ClientResponse, lease: Lease, started: float, first_chunk: bytes, kind: str
) -> web.Response:
    """A plain answer put together from the lane's stream: a client that leaves closes that stream
    (the lane stops generating), and a lane that breaks off or stalls is answered as an error,
    since nothing has reached the client yet."""
    app, lane, settings = request.app, lease.lane, request.app[SETTINGS]
    deadline = asyncio.get_running_loop().time() + settings.request_timeout - (time.perf_counter() - started)
    parts = assemble.Assembler(kind)
    finished = False
    try:
        async for chunk in _chunks(upstream, first_chunk, settings.stream_idle_timeout, deadline):
            parts.feed(chunk)
        finished = True
    except (aiohttp.ClientError, asyncio.TimeoutError, _Stalled, _TimeUp) as exc:
        return _give_up(_broken(app, lane, exc), settings)
    except ValueError as exc:  # not the stream llama-server sends
        return openai_error(502, f"lane {lane.host_id}/{lane.lane_id} sent a stream that is not JSON: {exc}",
                            "lane_failed")  # fmt: skip
    finally:
        if finished:
            upstream.release()
        else:
            upstream.close()  # the lane stops generating
        lease.release()
        app[WAKER].touch(lane.alias)
    if parts.error is not None:
        status = parts.error.get("error", {}).get("code") if isinstance(parts.error.get("error"), dict) else None
        return web.json_response(parts.error, status=status if isinstance(status, int) and 400 <= status < 600 else 500)
    body = msgspec.json.encode(parts.result())
    _count_usage(app, lease, usage.prompt_usage(body, False), usage.output_tokens(body, False))
    app[METRICS].ttfb.labels(lane.alias).observe(time.perf_counter() - started)
    return web.Response(body=body, content_type="application/json",
                        headers={"X-Lanes-Lane": f"{lane.host_id}/{lane.lane_id}"})  # fmt: skip


def _broken(app: web.Application, lane, exc: BaseException) -> GiveUp:
    """The error that ends an answer cut short, and what it says of the lane."""
    settings = app[SETTINGS]
    if isinstance(exc, _TimeUp):  # a long answer, still progressing: the lane did nothing wrong
        return GiveUp(504, f"the answer did not finish within the request timeout of {settings.request_timeout:g} s",
                      "timeout")  # fmt: skip
    if isinstance(exc, _Stalled):
        failed = Attempt(lane.key, Failure.STALLED, f"no byte for {settings.stream_idle_timeout:g} s mid-answer")
        app[VIEW].mark_stalled(lane.key, routing.stalled_reason(failed))
    else:
        failed = Attempt(lane.key, Failure.BROKE, f"{type(exc).__name__} {exc}")
        app[VIEW].mark_unreachable(lane.key, routing.unreachable_reason(failed))
    end = routing.decide((), [failed], request_timeout=settings.request_timeout)
    log.warning("stream broke", lane=lane.lane_id, host=lane.host_id, error=end.message)
    return end


# ------------------------------------------------------------------ the app

# A lane whose host vanished (a cut link, a dead machine) leaves sent bytes unacknowledged
# and keepalive probes unanswered: the connection fails in seconds instead of the kernel's
# quarter of an hour, so a request sent on it is retried on another lane.
LANE_TCP_USER_TIMEOUT_MS = 5000
LANE_KEEPALIVE_IDLE = 2.0  # seconds an idle pooled connection to a lane is kept (llama-server: 5)
LANE_KEEPALIVE = {"TCP_KEEPIDLE": 5, "TCP_KEEPINTVL": 2, "TCP_KEEPCNT": 3}


def lane_socket(addr_info) -> socket.socket:
    family, type_, proto, _, _ = addr_info
    sock = socket.socket(family=family, type=type_, proto=proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    for name, value in LANE_KEEPALIVE.items():
        if hasattr(socket, name):
            sock.setsockopt(socket.IPPROTO_TCP, getattr(socket, name), value)
    if hasattr(socket, "TCP_USER_TIMEOUT"):
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_USER_TIMEOUT, LANE_TCP_USER_TIMEOUT_MS)
    return sock



def admission_for(view: FleetView, settings: GatewaySettings) -> Admission:
    admission = Admission(view, max_queue=settings.queue_depth, max_wait=settings.queue_wait,
                          use_affinity=settings.affinity, critical_wait=settings.critical_wait, fair=settings.fair)
    admission.ledger.half_life, admission.ledger.output_weight = settings.fair_half_life, settings.output_weight
    return admission


def build_app(
    view: FleetView,
    settings: GatewaySettings = GatewaySettings(),
    *,
    admission: Admission | None = None,
    metrics: GatewayMetrics | None = None,
    waker: waking.Waker | None = None,
) -> web.Application:
    """The gateway's aiohttp application; more routes may be added before it starts."""
    app = web.Application(client_max_size=settings.max_body_bytes, middlewares=[_errors_and_keys])
    app[VIEW] = view
    app[SETTINGS] = settings
    admission = admission or admission_for(view, settings)
    app[ADMISSION] = admission
    app[KEYS] = None
    if settings.keys_file:
        keys = KeysFile(Path(settings.keys_file), settings.api_keys)
        said = keys.check()
        if keys.error:
            raise ValueError(keys.error)
        log.info("keys loaded", detail=said)
        app[KEYS] = keys
    app[USAGE] = UsageBook(settings.gateway_id or "local")
    app[METRICS] = metrics or GatewayMetrics(view, admission.counts)
    app[WAKER] = waker or waking.Waker(view, max_held=settings.queue_depth)
    if app[WAKER].on_cold_start is None:
        m = app[METRICS]

        def cold_start(model: str, seconds: float) -> None:
            m.cold_starts.labels(model).inc()
            m.cold_start_seconds.labels(model).observe(seconds)

        app[WAKER].on_cold_start = cold_start

    async def client_session(app: web.Application):
        # No pool limit: admission bounds what is in flight; one connection per slot is kept alive.
        # Idle connections are let go before llama-server's own 5 s keep-alive timeout closes
        # them: reusing one the server is closing at that instant fails the request.
        connector = aiohttp.TCPConnector(limit=0, ttl_dns_cache=10, keepalive_timeout=LANE_KEEPALIVE_IDLE,
                                         socket_factory=lane_socket)  # fmt: skip
        async with aiohttp.ClientSession(connector=connector, auto_decompress=False) as session:
            app[SESSION] = session
            yield

    app.cleanup_ctx.append(client_session)
    app.router.add_get("/health", _health)
    app.router.add_get("/ready", _ready)
    app.router.add_get("/metrics", _metrics)
    app.router.add_get("/v1/models", _models)
    for path in PROXIED:
        app.router.add_post(path, _proxy)
    return app
