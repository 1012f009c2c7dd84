"""Resumable streams (llama-server's `X-Conversation-Id`) and completion controls, through any gateway.

A lane keeps a stream that carries the header alive after its client leaves, buffers its bytes,
and serves them again from any byte offset (`GET /v1/stream?conv_id=&from=`; measured on b11434,
tools/server/server-stream.h). The gateway passes the header on, scoped to the caller's tenant
(`<tenant digest>.<id>`: one tenant can neither look up nor resume another's, and two tenants'
equal ids never meet), relays the lane's bytes untouched (so the client's offset is the lane's),
and finds the lane that holds a conversation by asking the lanes themselves
(`POST /v1/streams/lookup`), which any gateway can do: one that dies mid-stream loses nothing.
A control (`POST /v1/chat/completions/control`: end a completion's reasoning) is found its lane
the same way: every lane is asked, and the one running that completion answers."""

from __future__ import annotations

import asyncio
import hashlib

import aiohttp
import msgspec
from aiohttp import web

from gateway.edge.app_keys import SESSION, SETTINGS, TENANT, VIEW
from gateway.edge.openai_errors import openai_error
from gateway.fleet import LaneRoute
from gateway.tenants import Tenant

HEADER = "X-Conversation-Id"
MAX_ID = 128  # characters of a client's conversation id
MAX_LOOKUP = 64  # ids one lookup may ask for
LOOKUP_WAIT = 3.0  # seconds each lane has to say which conversations it holds


def scoped(tenant: Tenant, conversation: str) -> str:
    """The id the lane sees: the client's, behind its tenant's digest."""
    return f"{hashlib.sha256(tenant.name.encode()).hexdigest()[:16]}.{conversation}"


def unscoped(tenant: Tenant, lane_id: str) -> str | None:
    """The client's id of a lane's conversation id, or None when another tenant's."""
    prefix = scoped(tenant, "")
    return lane_id[len(prefix) :] if lane_id.startswith(prefix) else None


def refusal(conversation: str) -> web.Response | None:
    if not conversation or len(conversation) > MAX_ID or not conversation.isprintable():
        return openai_error(400, f"{HEADER} must be 1 to {MAX_ID} printable characters", "invalid_conversation_id")
    return None


async def _ask_every_lane(app: web.Application, path: str, body: dict) -> list[tuple[LaneRoute, int, object]]:
    """(lane, status, its JSON answer) from every healthy lane asked at once; one that cannot say is left out."""
    lanes = [lane for lane in app[VIEW].lanes() if lane.state == "healthy"]

    async def ask(lane: LaneRoute) -> tuple[int, object] | None:
        try:
            async with asyncio.timeout(LOOKUP_WAIT), app[SESSION].post(lane.url + path, json=body,
                                                                       headers=lane.auth) as resp:  # fmt: skip
                return resp.status, msgspec.json.decode(await resp.read())
        except (aiohttp.ClientError, TimeoutError, msgspec.DecodeError):
            return None

    answers = await asyncio.gather(*(ask(lane) for lane in lanes))
    return [(lane, *answer) for lane, answer in zip(lanes, answers) if answer is not None]


async def find(app: web.Application, ids: list[str]) -> dict[str, tuple[LaneRoute, dict]]:
    """The lane holding each of these (lane-side) conversation ids, asked of every healthy lane at once."""
    found: dict[str, tuple[LaneRoute, dict]] = {}
    for lane, status, entries in await _ask_every_lane(app, "/v1/streams/lookup", {"conversation_ids": ids}):
        for entry in entries if status == 200 and isinstance(entries, list) else ():
            conv = entry.get("conversation_id") if isinstance(entry, dict) else None
            if conv in ids and (conv not in found or entry.get("started_at", 0) > found[conv][1].get("started_at", 0)):
                found[conv] = (lane, entry)  # (the newest, should two lanes hold one id)
    return found


NOT_HERE = "no active completion for this id"  # a lane's answer to a control for another lane's completion (b11434)


async def control(request: web.Request) -> web.Response:
    """POST /v1/chat/completions/control ({"id", "action"}): the answer of the lane running that
    completion; when none is, a lane's own "no active completion" answer."""
    try:
        asked = msgspec.json.decode(await request.read())
    except msgspec.DecodeError as exc:
        return openai_error(400, f"request body is not JSON: {exc}", "invalid_json")
    if not isinstance(asked, dict) or not isinstance(asked.get("id"), str) or not asked["id"]:
        return openai_error(400, "missing completion id", "invalid_request")  # llama-server's words
    answers = [(status, answer) for _, status, answer in await _ask_every_lane(request.app, request.path, asked)]
    elsewhere = [(status, a) for status, a in answers
                 if status == 200 and isinstance(a, dict) and a.get("message") == NOT_HERE]  # fmt: skip
    running = [(status, a) for status, a in answers if (status, a) not in elsewhere]
    if running or elsewhere:  # the lane running it (or refusing the request itself), else "not here"
        status, answer = (running or elsewhere)[0]
        return web.json_response(answer, status=status)
    return openai_error(503, "no lane could be asked", "no_lane", request.app[SETTINGS].retry_after)


async def lookup(request: web.Request) -> web.Response:
    """POST /v1/streams/lookup: the caller's tenant's conversations, wherever they run."""
    try:
        asked = msgspec.json.decode(await request.read())
    except msgspec.DecodeError as exc:
        return openai_error(400, f"request body is not JSON: {exc}", "invalid_json")
    ids = asked.get("conversation_ids") if isinstance(asked, dict) else None
    if not isinstance(ids, list) or not all(isinstance(i, str) for i in ids) or len(ids) > MAX_LOOKUP:
        return openai_error(400, f"conversation_ids: a list of at most {MAX_LOOKUP} strings", "invalid_request")
    tenant: Tenant = request.get(TENANT) or Tenant()
    found = await find(request.app, [scoped(tenant, i) for i in ids])
    return web.json_response([entry | {"conversation_id": unscoped(tenant, conv)} for conv, (_, entry) in found.items()])


async def resume(request: web.Request) -> web.StreamResponse:
    """GET /v1/stream?conv_id=&from=: the lane's buffered and live bytes, relayed untouched;
    DELETE /v1/stream?conv_id=: the lane forgets it."""
    conversation = request.query.get("conv_id", "")
    if not conversation:
        return openai_error(400, "Missing conversation id in path", "invalid_request")  # llama-server's words
    tenant: Tenant = request.get(TENANT) or Tenant()
    lane_side = scoped(tenant, conversation)
    found = (await find(request.app, [lane_side])).get(lane_side)
    if found is None:
        if request.method == "DELETE":
            return web.Response(status=204)  # as the lane: forgetting an unknown one is done
        return openai_error(404, "Stream not found or expired", "not_found")
    lane = found[0]
    query = {"conv_id": lane_side} | ({"from": request.query["from"]} if "from" in request.query else {})
    timeout = aiohttp.ClientTimeout(total=request.app[SETTINGS].request_timeout,
                                    connect=request.app[SETTINGS].connect_timeout)  # fmt: skip
    async with request.app[SESSION].request(request.method, lane.url + "/v1/stream", params=query, headers=lane.auth,
                                            timeout=timeout) as upstream:  # fmt: skip
        resp = web.StreamResponse(status=upstream.status)
        for header in ("Content-Type", "Cache-Control"):
            if header in upstream.headers:
                resp.headers[header] = upstream.headers[header]
        resp.headers["X-Lanes-Lane"] = f"{lane.host_id}/{lane.lane_id}"
        await resp.prepare(request)
        async for chunk in upstream.content.iter_any():
            await resp.write(chunk)
        await resp.write_eof()
        return resp
