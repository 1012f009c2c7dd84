"""Resumable streams (llama-server's `X-Conversation-Id`), through any gateway.

A lane keeps a stream that carries the header alive after its client leaves, buffers its bytes,
and serves them again from any byte offset (`GET /v1/stream?conv_id=&from=`; measured on b11434,
tools/server/server-stream.h). The gateway passes the header on, scoped to the caller's tenant
(`<tenant digest>.<id>`: one tenant can neither look up nor resume another's, and two tenants'
equal ids never meet), relays the lane's bytes untouched (so the client's offset is the lane's),
and finds the lane that holds a conversation by asking the lanes themselves
(`POST /v1/streams/lookup`), which any gateway can do: one that dies mid-stream loses nothing."""

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


async def _holds(app: web.Application, lane: LaneRoute, ids: list[str]) -> list[dict]:
    """What a lane says of these conversations (those it holds), or nothing when it cannot say."""
    try:
        async with asyncio.timeout(LOOKUP_WAIT), app[SESSION].post(
                lane.url + "/v1/streams/lookup", json={"conversation_ids": ids},
                headers=lane.auth) as resp:  # fmt: skip
            found = msgspec.json.decode(await resp.read()) if resp.status == 200 else []
    except (aiohttp.ClientError, TimeoutError, msgspec.DecodeError):
        return []
    return [entry for entry in found if isinstance(entry, dict)] if isinstance(found, list) else []


async def find(app: web.Application, ids: list[str]) -> dict[str, tuple[LaneRoute, dict]]:
    """The lane holding each of these (lane-side) conversation ids, asked of every healthy lane at once."""
    lanes = [lane for lane in app[VIEW].lanes() if lane.state == "healthy"]
    answers = await asyncio.gather(*(_holds(app, lane, ids) for lane in lanes))
    found: dict[str, tuple[LaneRoute, dict]] = {}
    for lane, entries in zip(lanes, answers):
        for entry in entries:
            conv = entry.get("conversation_id")
            if conv in ids and (conv not in found or entry.get("started_at", 0) > found[conv][1].get("started_at", 0)):
                found[conv] = (lane, entry)  # (the newest, should two lanes hold one id)
    return found


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
