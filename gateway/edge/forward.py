"""Forwarding a request: lanes tried until one answers or routing gives up (gateway/routing/tries.py
decides; this performs the tries, records each failure, and hands the answer to gateway/edge/relay.py)."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, replace

import aiohttp
import structlog
from aiohttp import web

from gateway import routing
from gateway.admission import Lease
from gateway.edge import adapters
from gateway.edge.endpoints import ENDPOINTS
from gateway.edge.lane_stream import LaneStream, LaneUnreachable, lane_address, open_stream
from gateway.edge.app_keys import ADMISSION, METRICS, SESSION, SETTINGS, SPARES, TENANT, VIEW
from gateway.edge.openai_errors import give_up, openai_error
from gateway.edge.relay import assembled, cut_short, relay
from gateway.fleet import FleetView
from gateway.refusals import AdmissionError, Refused
from gateway.routing import Attempt, Failure, Fingerprint, GiveUp
from gateway.tenants import AnswerReader, Tenant

log = structlog.get_logger("lanes.gateway")


@dataclass(frozen=True)
class Shape:
    """What the edge read of a request that decides how it is forwarded."""

    label: str = ""  # the model's metric label
    mark: Fingerprint | None = None  # the prompt's chunk hashes (prefix affinity)
    too_small: frozenset = frozenset()  # lanes whose window cannot hold it
    tokens: int | None = None  # its prompt's tokens (counted, or their upper bound)
    streamed: bool = False  # "stream": true: the first token's time is the first byte's
    assembled: str | None = None  # plain, asked of the lane as a stream and put together (gateway/edge/assemble.py)
    conversation: str | None = None  # X-Conversation-Id as the lane sees it: a resumable stream (conversations.py)
    content_type: str | None = None  # a form's own (multipart, with its boundary); None: JSON
    held: bool = False  # it waited for its model to load: its time is not the gateway's own


def lane_headers(accept: str, streamed: bool) -> dict[str, str]:
    """A request's headers to its lane. A streamed answer's connection is not kept: llama-server
    closes it after the last chunk though its headers say keep-alive (measured, b11434), and a
    pooled one sent the next request down a dead socket (ServerDisconnectedError, a retry, a
    warning). Asked with `Connection: close`, the lane says so and aiohttp pools nothing."""
    headers = {"Content-Type": "application/json", "Accept": accept}
    if streamed:
        headers["Connection"] = "close"
    return headers


async def forward(
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
            return give_up(step, settings)
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
        upstream, first, first_at = None, b"", 0.0
        try:
            async with asyncio.timeout(wait):
                streams = bool(shape.streamed or shape.assembled)
                data = body if shape.content_type else adapters.body_for(body, name, lane)
                headers = (lane_headers(request.headers.get("Accept", "*/*"), streams) | lane.auth
                           | ({"X-Conversation-Id": shape.conversation} if shape.conversation else {})
                           | ({"Content-Type": shape.content_type} if shape.content_type else {}))  # fmt: skip
                if streams:  # never pooled: the bare client (gateway/edge/lane_stream.py)
                    spares, address = app[SPARES], lane_address(lane.url)
                    spare = spares.take(address)
                    upstream = await open_stream(lane.url, request.path, data, headers, settings.connect_timeout, spare)
                    app[METRICS].lane_connections.labels("spare" if upstream is spare else "new").inc()
                    spares.refill(address)  # the next stream's connection, opened while this one answers
                else:
                    upstream = await app[SESSION].post(
                        lane.url + request.path, data=data, headers=headers,
                        timeout=aiohttp.ClientTimeout(total=None, connect=settings.connect_timeout),
                    )
                if streams and upstream.status == 200:
                    first = await upstream.content.readany()  # the first token: the prefill is done
                    first_at = time.perf_counter()
                    lease.prefilled()
        except aiohttp.ClientConnectionError as exc:  # refused, reset, closed before answering
            _drop(upstream, lease)
            unreachable = isinstance(exc, (aiohttp.ClientConnectorError, LaneUnreachable))
            how = Failure.UNREACHABLE if unreachable else Failure.DROPPED
            _lane_failed(view, Attempt(lane.key, how, f"{type(exc).__name__} {exc}"), history)
            continue
        except asyncio.TimeoutError:
            _drop(upstream, lease)  # closing the connection stops the lane's work on it
            if wait < remaining:  # no first token in the time its prefill should take: stalled, try another
                _lane_failed(view, Attempt(lane.key, Failure.STALLED, f"no first token within {wait:g} s"), history)
            else:  # the request's own time is up
                history.append(Attempt(lane.key, Failure.TIMEOUT))
            continue
        except BaseException:  # its client left (the handler cancelled)
            if upstream is not None and upstream.status == 200 and (shape.streamed or shape.assembled):
                cut_short(app, lease, upstream, AnswerReader(True), lane_ok=True)  # mid-prefill: read till it stops
            else:
                _drop(upstream, lease)
            raise
        small = (upstream.content_length or routing.REFUSAL_BYTES + 1) <= routing.REFUSAL_BYTES
        if upstream.status == 404 and request.path in ENDPOINTS and small:
            first = await upstream.read()  # relayed as the answer unless the lane has no such route
        if upstream.status == 404 and NO_ROUTE in first:
            upstream.release()
            lease.release()
            return openai_error(501, f"lane {lane.host_id}/{lane.lane_id}'s llama-server does not serve {request.path}: "
                                f"its build is older than {TESTED_BUILD}, the build lanes is tested with (`lanes "
                                "install-llama` installs it)", "not_supported_by_lane")  # fmt: skip
        if upstream.status in routing.RETRY_STATUSES:
            upstream.release()
            lease.release()
            history.append(Attempt(lane.key, Failure.STATUS, status=upstream.status))
            continue
        if upstream.status == 400 and small:
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
                        return give_up(refused, settings)
                    shape = replace(shape, too_small=shape.too_small | smaller, tokens=tokens)
                    continue  # counted now: to a lane whose window holds it
        sse = upstream.headers.get("Content-Type", "").startswith("text/event-stream")
        if shape.assembled and upstream.status == 200 and sse:  # (a lane that answers plain is relayed as it is)
            return await assembled(request, upstream, lease, started, first, shape.assembled)
        sent = upstream.sent_at if isinstance(upstream, LaneStream) else 0.0  # its connect is the gateway's time too
        waited = history or shape.held or lease.queued
        own = None if waited or not first_at or not sent else (sent - started, first_at)
        return await relay(request, upstream, lease, started, first, resumable=shape.conversation is not None,
                           own=own)  # fmt: skip


TESTED_BUILD = "b11434"  # llama.cpp's build whose endpoints gateway/edge/endpoints.py lists
NO_ROUTE = b'"File Not Found"'  # llama-server's 404 for a path it has no route for (b11434)


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
