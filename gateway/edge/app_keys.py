"""The typed keys of the gateway's aiohttp app and requests, shared by the HTTP edge's modules."""

from __future__ import annotations

import aiohttp
from aiohttp import web

from gateway.admission import Admission, Waker
from gateway.edge.access import CookieSecret
from gateway.edge.lane_spares import Spares
from gateway.fleet import FleetView
from gateway.metrics import GatewayMetrics
from gateway.settings import GatewaySettings
from gateway.tenants import Tenant, UsageBook

VIEW = web.AppKey("view", FleetView)
ADMISSION = web.AppKey("admission", Admission)
METRICS = web.AppKey("metrics", GatewayMetrics)
SETTINGS = web.AppKey("settings", GatewaySettings)
SESSION = web.AppKey("session", aiohttp.ClientSession)
WAKER = web.AppKey("waker", Waker)
SPARES = web.AppKey("spares", Spares)  # connections opened to lanes ahead of their next stream
KEYS = web.AppKey("keys", object)  # a KeysFile, or None without --keys-file
USAGE = web.AppKey("usage", UsageBook)  # tenants' tokens this minute and day, every gateway's
COOKIE_SECRET = web.AppKey("cookie_secret", CookieSecret)  # signs the dashboard's session cookies
LEFT = web.AppKey("left", set)  # answers whose client left, read on until their lane stops (gateway/edge/relay.py)
TENANT = web.RequestKey("tenant", Tenant)  # the request's Tenant, as its key said
KEY_ID = web.RequestKey("key_id", str)  # the sha256 of the key it came with (a cookie names it too)
ROLE = web.RequestKey("role", str)  # what that key opens: tenant, ops or admin (gateway/tenants/keys.py)
