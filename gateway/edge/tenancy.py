"""Who a request is and what it may do: the key check (middleware), its tenant, the tenant's
refusals (403, 429) and what an answer costs it (usage counting)."""

from __future__ import annotations

import time

from aiohttp import web

from gateway.admission import Lease
from gateway.edge import access
from gateway.edge.app_keys import ADMISSION, COOKIE_SECRET, KEY_ID, KEYS, METRICS, ROLE, SETTINGS, TENANT, USAGE, VIEW
from gateway.edge.endpoints import api_of
from gateway.edge.openai_errors import anthropic_error, openai_error
from gateway.settings import GatewaySettings
from gateway.tenants import PLAIN, PLAIN_ROLE, AnswerReader, KeysFile, Tenant, Usage, digest


@web.middleware
async def errors_and_keys(request: web.Request, handler):
    response = await _keyed(request, handler)
    if api_of(request.path) == "anthropic" and type(response) is web.Response and response.status >= 400:
        return anthropic_error(response)  # the gateway's own; a lane's error is relayed as the lane said it
    return response


async def _keyed(request: web.Request, handler):
    settings = request.app[SETTINGS]
    keyed = bool(settings.api_keys) or request.app[KEYS] is not None
    if keyed and access.needs_key(request.path):
        if not _key_presented(request, settings):
            return openai_error(401, "missing or invalid API key (Authorization: Bearer ...)", "invalid_api_key")
        if not access.role_may_open(request[ROLE], request.path):
            return openai_error(403, f"a key of role {request[ROLE]} opens the API only: /metrics and the dashboard "
                                "show every tenant and need an ops or admin key", "role_forbidden")  # fmt: skip
    try:
        return await handler(request)
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        code = {404: "not_found", 405: "method_not_allowed", 413: "request_too_large"}.get(exc.status)
        return openai_error(exc.status, exc.reason if exc.status != 413 else exc.text or exc.reason, code)


def _key_presented(request: web.Request, settings: GatewaySettings) -> bool:
    """A valid bearer key, or (dashboard paths only) a valid session cookie (gateway/edge/access.py)."""
    scheme, _, presented = request.headers.get("Authorization", "").partition(" ")
    if scheme.lower() != "bearer" and "x-api-key" in request.headers:  # Anthropic's clients send it so
        scheme, presented = "bearer", request.headers["x-api-key"]
    if scheme.lower() == "bearer":
        tenant = tenant_of(request.app, presented.strip())
        if tenant is not None:
            request[TENANT], request[KEY_ID] = tenant, digest(presented.strip())
            request[ROLE] = role_of(request.app, request[KEY_ID])
            return True
    token = request.cookies.get(access.COOKIE)
    if token and access.cookie_may_open(request.path) and access.session_ok(
            request.app[COOKIE_SECRET].value, token, time.time(), dashboard_key_ids(request.app)):  # fmt: skip
        request[ROLE] = "ops"  # only an ops or admin key gets a cookie, and keeps it only while it stays so
        return True
    return False


def role_of(app: web.Application, key_id: str) -> str:
    """What the key with this sha256 opens: its role in the keys file; an --api-key key is the operator's."""
    keys: KeysFile | None = app[KEYS]
    return keys.table.role(key_id) if keys is not None else PLAIN_ROLE


def key_ids_of(app: web.Application, roles: frozenset[str]) -> frozenset[str]:
    """The sha256 of every key whose role is one of `roles`, as the keys are now."""
    keys: KeysFile | None = app[KEYS]
    if keys is None:
        return frozenset(digest(k) for k in app[SETTINGS].api_keys) if PLAIN_ROLE in roles else frozenset()
    return frozenset(h for h in keys.table.by_digest if keys.table.role(h) in roles)


def dashboard_key_ids(app: web.Application) -> frozenset[str]:
    """Every key that may open the dashboard now (ops and admin): a session cookie names one of
    them, and ends when its key is revoked or made a tenant's."""
    return key_ids_of(app, frozenset({"ops", "admin"}))


def tenant_of(app: web.Application, presented: str) -> Tenant | None:
    """The tenant a bearer key names (keys file, then --api-key as tenant `default`); None: no such key."""
    keys: KeysFile | None = app[KEYS]
    if keys is not None:
        return keys.table.find(presented)
    return Tenant(PLAIN) if app[SETTINGS].key_ok(presented) else None


def has_keys(app: web.Application) -> bool:
    """Whether any key guards this gateway (without one there is no session to give)."""
    keys: KeysFile | None = app[KEYS]
    return bool(app[SETTINGS].api_keys) or (keys is not None and bool(keys.table.by_digest))


def tenant_refusal(app: web.Application, tenant: Tenant, name: str) -> web.Response | None:
    """403 for a model the key may not use; 429 naming the token limit the tenant is over."""
    if not tenant.may_use(name):
        app[METRICS].refusals.labels(tenant.name, tenant.klass, "model_not_allowed").inc()
        return openai_error(403, f"the key of tenant {tenant.name!r} may not use model {name!r}", "model_not_allowed")
    over = app[USAGE].check(tenant, time.time())
    if over is not None:
        app[METRICS].refusals.labels(tenant.name, tenant.klass, over.code).inc()
        return openai_error(429, str(over), over.code, over.retry_after)
    return None


def cache_route(app: web.Application, tenant: Tenant, name: str) -> tuple[str, web.Response | None]:
    """The name a request is served under, or its 403: lanes dedicated to a tenant serve it
    alone, and a tenant whose cache is private is served by its own lanes only (its prompts
    never meet another tenant's in a lane's cache, nor theirs its `cached_tokens`)."""
    base, colon, adapter = name.partition(":")
    keys: KeysFile | None = app[KEYS]
    owner = keys.table.dedicated_to.get(base) if keys is not None else None
    if owner is not None and owner != tenant.name:
        app[METRICS].refusals.labels(tenant.name, tenant.klass, "model_not_allowed").inc()
        return name, openai_error(403, f"model {base!r} is dedicated to another tenant", "model_not_allowed")
    if tenant.cache != "private" or owner == tenant.name:
        return name, None
    alias = tenant.dedicated(base)
    if alias is None:
        app[METRICS].refusals.labels(tenant.name, tenant.klass, "private_cache_unavailable").inc()
        return name, openai_error(403, f"tenant {tenant.name!r} keeps its prompt cache private and no lanes of model "
                                  f"{base!r} are dedicated to it (keys file: lanes = {{{base} = \"<alias>\"}}, and "
                                  "that alias planned in the demand)", "private_cache_unavailable")  # fmt: skip
    return alias + colon + adapter, None


def foreign_lanes(app: web.Application, tenant: Tenant, name: str) -> frozenset:
    """Lanes of the requested model dedicated to another tenant: a request naming the model (not
    their alias) would otherwise reach them too, and its prompt would meet that tenant's in their
    cache. Routing leaves them out."""
    keys: KeysFile | None = app[KEYS]
    dedicated = keys.table.dedicated_to if keys is not None else {}
    if not dedicated:
        return frozenset()
    base = name.partition(":")[0]
    return frozenset(lane.key for lane in app[VIEW].lanes_for(name)
                     if lane.alias != base and dedicated.get(lane.alias, tenant.name) != tenant.name)  # fmt: skip


def count_usage(app: web.Application, lease: Lease, found: Usage | None, output: int = 0, measure: bool = True) -> None:
    """An answer's tokens: charged to its tenant (fair share, token limits, metrics); with `measure`,
    what the lane said it had cached corrects the prefix index and its prefill speed."""
    if found is None and not output:
        return
    prompt = found.prompt if found is not None else 0
    tokens = app[ADMISSION].charge(lease.tenant, prompt, output)  # its fair share
    app[USAGE].add(lease.tenant, tokens, time.time())  # its token limits
    tenant: Tenant = app[KEYS].table.tenants().get(lease.tenant, Tenant(lease.tenant)) if app[KEYS] else Tenant(
        lease.tenant)
    app[METRICS].tenant_tokens.labels(tenant.name, tenant.klass, "prompt").inc(prompt)
    app[METRICS].tenant_tokens.labels(tenant.name, tenant.klass, "output").inc(output)
    if found is None or not measure:
        return
    lane = lease.lane
    admission = app[ADMISSION]
    counts = admission.counts
    counts.note_prompt(lane.alias, f"{lane.host_id}/{lane.lane_id}", found.prompt, found.cached)
    if found.prefill_rate is not None:
        counts.note_prefill(lane.key, found.prefill_rate)
    admission.measured(lease, found.prompt, found.cached, output)


def count_cut_short(app: web.Application, lease: Lease, read: AnswerReader) -> None:
    """An answer its client left or its lane broke off: the tokens it carried so far, and its
    prompt as the lane said it or, where it never got to say, as estimated when it was sent."""
    found = read.usage() or (Usage(lease.prompt_tokens, 0) if lease.prompt_tokens else None)
    count_usage(app, lease, found, read.output(), measure=False)
