"""The gateway's HTTP edge: OpenAI-compatible routes in front of the lanes (aiohttp).

Bodies are relayed chunk by chunk as the lane sends them (SSE included); nothing is
buffered whole. This module only performs the I/O: which lane to try after a failure,
and when to give up, is gateway/routing/tries.py's to decide. Errors are OpenAI's shape.
Here: the routes, what is checked before a request is forwarded (its model's state, its
windows), and the app; the tries are gateway/edge/forward.py's, the answer's copy gateway/edge/relay.py's,
keys, tenants and usage gateway/edge/tenancy.py's, the errors gateway/edge/openai_errors.py's.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import aiohttp
import msgspec
import structlog
from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from gateway import routing
from gateway.admission import (
    Admission, HeldFull, LoadFailed, LoadTimeout, ModelView, Waker, catalogue, classify, only_model,
)
from gateway.edge import adapters, assemble, bounds, conversations, cors, counted, endpoints, relay
from gateway.edge.access import CookieSecret
from gateway.edge.app_keys import (ADMISSION, COOKIE_SECRET, KEYS, LEFT, METRICS, SESSION, SETTINGS, SPARES, TENANT,
                                   USAGE, VIEW, WAKER)  # fmt: skip
from gateway.edge.endpoints import ENDPOINTS
from gateway.edge.lane_spares import Spares
from gateway.edge.lane_stream import lane_socket
from gateway.edge.forward import Shape, forward
from gateway.edge.images import aspect_refusal
from gateway.edge.openai_errors import give_up, openai_error
from gateway.edge.tenancy import cache_route, errors_and_keys, foreign_lanes, tenant_refusal
from gateway.fleet import FleetView
from gateway.metrics import GatewayMetrics
from gateway.routing import GiveUp, count_tokens, fingerprint
from gateway.settings import GatewaySettings
from gateway.tenants import KeysFile, Tenant, UsageBook
from shared import defaults

log = structlog.get_logger("lanes.gateway")


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
    return web.json_response({"object": "list", "data": catalogue(request.app[VIEW])})


async def _props(request: web.Request) -> web.Response:
    """GET /props?model=: a ready lane's own /props for that model (or the fleet's only one), as
    llama-server's router answers it."""
    app = request.app
    name = request.query.get("model") or only_model(catalogue(app[VIEW]))[0]
    if not name:
        return openai_error(400, "say which model: /props?model=<name> (GET /v1/models lists them)", "model_required")
    lanes = app[VIEW].routable(name)
    if not lanes:
        return openai_error(404, f"no ready lane serves model {name!r} (GET /v1/models says its state)",
                            "model_not_found")  # fmt: skip
    timeout = aiohttp.ClientTimeout(total=app[SETTINGS].connect_timeout * 3, connect=app[SETTINGS].connect_timeout)
    try:
        async with app[SESSION].get(lanes[0].url + "/props", headers=lanes[0].auth, timeout=timeout) as upstream:
            return web.Response(body=await upstream.read(), status=upstream.status,
                                content_type="application/json")  # fmt: skip
    except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
        return openai_error(502, f"lane {lanes[0].host_id}/{lanes[0].lane_id} did not answer /props: {exc!r}",
                            "lane_failed")  # fmt: skip


async def _metrics(request: web.Request) -> web.Response:
    body = generate_latest(request.app[METRICS].registry)
    return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})


async def _proxy(request: web.Request) -> web.StreamResponse:
    app = request.app
    started = time.perf_counter()
    try:  # bounded by client_max_size (past it aiohttp answers 413) and by time (no task, as wait_for makes)
        async with asyncio.timeout(app[SETTINGS].client_timeout):
            body = await request.read()
    except TimeoutError:
        slow = openai_error(408, f"the request body did not arrive within {app[SETTINGS].client_timeout:g} s",
                            "request_timeout")  # fmt: skip
        slow.force_close()  # the rest of the body is never read: the connection goes
        return slow
    form = ENDPOINTS[request.path].form
    try:
        payload = endpoints.form_fields(body) if form else msgspec.json.decode(body)
    except msgspec.DecodeError as exc:
        return openai_error(400, f"request body is not JSON: {exc}", "invalid_json")
    out_of_bounds = bounds.refusal(payload)
    if out_of_bounds is not None:
        return openai_error(400, *out_of_bounds)
    name = payload.get("model")
    view, metrics = app[VIEW], app[METRICS]
    if conversations.HEADER in request.headers:
        refused = conversations.refusal(request.headers[conversations.HEADER])
        if refused is not None:
            return refused
    if not await view.wait_synced(defaults.FLEET_SYNC_WAIT):
        return openai_error(503, "the gateway has not read the fleet from NATS yet (is NATS up, and the planner?)",
                            "fleet_not_read", app[SETTINGS].retry_after)  # fmt: skip
    if not isinstance(name, str) or not name:
        # As llama-server itself: a fleet of one model serves a request that names none.
        name, why = only_model(catalogue(view))
        if name is None:
            return openai_error(400, f"the request names no model (field 'model') and {why}", "model_required")
    name = adapters.requested(name, payload) if not form else name  # a LoRA adapter: "base:adapter"
    if ":" not in name and adapters.applied_by_id(payload):
        return openai_error(400, "apply a LoRA adapter by name (model \"base:adapter\", or lora [{\"name\": ..., "
                            "\"scale\": ...}]): ids differ between lanes", "adapter_by_id")  # fmt: skip
    tenant: Tenant = request.get(TENANT) or Tenant()
    request[TENANT] = tenant
    refused = tenant_refusal(app, tenant, name)
    if refused is None:
        name, refused = cache_route(app, tenant, name)  # a private cache: the tenant's own lanes
    if refused is not None:
        metrics.tenant_requests.labels(tenant.name, tenant.klass, str(refused.status)).inc()
        return refused
    model = classify(view, name)
    label = model.name if model.state != "unknown" else "unknown"  # bounded labels: no client-chosen names
    if model.state != "unknown":
        app[WAKER].touch(name)  # a request: the idle clock restarts (probes and scrapes never come here)
    try:
        response = await _answer(request, model, name, payload, body, started, label)
    except asyncio.CancelledError:  # the client hung up (handler cancellation): nginx's 499
        metrics.requests.labels(label, "499").inc()
        metrics.endpoint_requests.labels(request.path, "499").inc()
        raise
    metrics.requests.labels(label, str(response.status)).inc()
    metrics.endpoint_requests.labels(request.path, str(response.status)).inc()
    metrics.tenant_requests.labels(tenant.name, tenant.klass, str(response.status)).inc()
    metrics.latency.labels(label).observe(time.perf_counter() - started)
    return response


async def _answer(
    request: web.Request, model: ModelView, name: str, payload: object, body: bytes, started: float, label: str
) -> web.StreamResponse:
    app, view = request.app, request.app[VIEW]
    images = routing.takes_images(request.path, payload)
    if images and model.state != "unknown" and not _takes_images(view, name):
        return openai_error(400, f"model {name!r} takes no images: no multimodal projector (mmproj) is paired with "
                            "it on its hosts (put a *mmproj*.gguf beside its file)", "images_not_supported")  # fmt: skip
    if images and (longest := _image_max_aspect(view, name)):
        if (message := aspect_refusal(payload, longest)) is not None:
            return openai_error(400, message, "image_too_long")
    response = await _held(request, model) if model.state != "ready" else None
    if response is None:
        prompt = routing.prompt_of(request.path, payload)
        refused, too_small, tokens = await _window_check(request, name, prompt, body)
        if images:  # lanes without a projector cannot read it: as if too small for it
            too_small |= {lane.key for lane in view.lanes_for(name) if not lane.vision}
        # Another tenant's dedicated lanes (a private cache) are not this request's, whatever it names.
        too_small |= foreign_lanes(app, request.get(TENANT) or Tenant(), name)
        if refused is not None:
            response = give_up(refused, app[SETTINGS])
        else:
            lanes = view.lanes_for(name)
            mark = fingerprint(lanes[0].model, prompt.text) if prompt is not None and lanes else None
            if tokens is None and prompt is not None and prompt.kind != "embedding":
                tokens = prompt.token_bound()  # an upper bound: a first-byte timeout on the safe side
            streamed = isinstance(payload, dict) and payload.get("stream") is True
            # Resumable (X-Conversation-Id): the lane keeps it, under the tenant's scope, and its own
            # bytes are relayed as they are, as the client will ask for them again (never assembled).
            conversation = request.headers.get(conversations.HEADER)
            kind = assemble.kind_of(request.path, payload) if conversation is None else None  # plain, as a stream
            if kind is not None:
                body = assemble.streamed_body(payload)
            else:
                body = counted.counted_body(request.path, payload, body, streamed)
            if conversation is not None:
                conversation = conversations.scoped(request.get(TENANT) or Tenant(), conversation)
            content_type = request.headers.get("Content-Type", "") if ENDPOINTS[request.path].form else None
            shape = Shape(label, mark, too_small, tokens, streamed, kind, conversation, content_type,
                          held=model.state != "ready")  # fmt: skip
            response = await forward(request, name, body, started, shape)
    return response


def _takes_images(view, name: str) -> bool:
    """A lane of the model has a projector, or the planner says its lanes will (an unloaded model)."""
    entry = view.model_entry(name)
    return any(lane.vision for lane in view.lanes_for(name)) or bool(entry and entry.vision)


def _image_max_aspect(view, name: str) -> int:
    """The longest image the model's lanes are planned for (the smallest cap among them); 0: any."""
    caps = [lane.image_max_aspect for lane in view.lanes_for(name) if lane.vision and lane.image_max_aspect]
    return min(caps, default=0)


async def _held(request: web.Request, model: ModelView) -> web.Response | None:
    """A model with no ready lane: unknown is a 404 at once; otherwise the request is held
    while it loads (woken over the bus). None: go on and forward it."""
    waker, settings = request.app[WAKER], request.app[SETTINGS]
    if model.state == "unknown":
        return openai_error(404, f"model {model.name!r} is not served by this fleet; GET /v1/models lists what is",
                            "model_not_found")  # fmt: skip
    if model.state == "failed":
        return openai_error(502, f"model {model.name!r} failed to load: {model.reason}", LoadFailed.code)
    try:
        await waker.wait_ready(model, settings.load_timeout)  # None: predicted load time + a margin
    except LoadFailed as exc:
        return openai_error(exc.status, str(exc), exc.code)
    except LoadTimeout as exc:
        return openai_error(exc.status, str(exc), exc.code, exc.retry_after)
    except HeldFull as exc:
        return openai_error(exc.status, str(exc), exc.code, settings.retry_after)
    return None


async def _window_check(
    request: web.Request, name: str, prompt: routing.Prompt | None, body: bytes
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
        request.app[SESSION], counter.url, prompt, body, request.app[SETTINGS].connect_timeout, counter.auth)
    if tokens is None:
        return None, frozenset(), None
    return routing.context_exceeded(windows, tokens), routing.too_small(windows, tokens), tokens


# ------------------------------------------------------------------ the app

LANE_KEEPALIVE_IDLE = 2.0  # seconds an idle pooled connection to a lane is kept (llama-server: 5)


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
    waker: Waker | None = None,
) -> web.Application:
    """The gateway's aiohttp application; more routes may be added before it starts."""
    app = web.Application(client_max_size=settings.max_body_bytes, middlewares=[cors.preflights, errors_and_keys])
    app.on_response_prepare.append(cors.name_the_origin)
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
    app[COOKIE_SECRET] = CookieSecret()
    app[LEFT] = set()
    app[METRICS] = metrics or GatewayMetrics(view, admission.counts)
    app[WAKER] = waker or Waker(view, max_held=settings.queue_depth)
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
            app[SPARES] = Spares(app[SETTINGS].lane_spares, app[SETTINGS].connect_timeout)
            try:
                yield
                await relay.settle_left(app)  # before the session closes their connections
            finally:
                await app[SPARES].close()

    app.cleanup_ctx.append(client_session)
    app.router.add_get("/health", _health)
    app.router.add_get("/ready", _ready)
    app.router.add_get("/metrics", _metrics)
    app.router.add_get("/v1/models", _models)
    app.router.add_get("/models", _models)
    app.router.add_get("/props", _props)
    for path in ENDPOINTS:
        app.router.add_post(path, _proxy)
    app.router.add_post("/v1/streams/lookup", conversations.lookup)
    app.router.add_post("/v1/chat/completions/control", conversations.control)
    app.router.add_get("/v1/stream", conversations.resume)
    app.router.add_delete("/v1/stream", conversations.resume)
    return app
