"""Which gateway paths need an API key, and the dashboard's session cookie (pure: no sockets).

With keys configured, everything needs one except the probes (/health, /ready) and the
dashboard's page shell, which holds no data and only asks for the key. /metrics takes it as
a bearer token (what Prometheus's scrape config sends). The dashboard's config change is
guarded by the admin key alone, in its own handler: the two keys stay separate.

A key's role decides what it opens: a tenant's key the API alone; /metrics and the dashboard
show every tenant's figures, so they need an ops or admin key (gateway/tenants/keys.py).

The page trades its key once for a session cookie (POST /dashboard/api/session with the
bearer key, never with a cookie: a cookie cannot mint its successor): a browser's EventSource
and <script src> cannot send an Authorization header, and a key in the stream's URL would land
in access logs and proxies. The cookie is HttpOnly, SameSite=Strict, limited to /dashboard/ and
expires; it holds an expiry and the sha256 of the key it was traded for, signed with the
configured keys, so any gateway with the same keys accepts it (no shared state), and revoking
that key (or making it a tenant's) ends its sessions.
"""

from __future__ import annotations

import hashlib
import hmac

OPEN_PATHS = frozenset({"/health", "/ready"})  # probes: no key, ever
PAGE_PATHS = frozenset({"/dashboard", "/dashboard/"})  # the page shell: asks for the key, shows nothing
ADMIN_PATHS = frozenset({"/dashboard/api/config"})  # the admin key, checked by the handler
SESSION_PATH = "/dashboard/api/session"
COOKIE = "lanes_dashboard"
COOKIE_PATH = "/dashboard/"
SESSION_SECONDS = 12 * 3600


def needs_key(path: str) -> bool:
    """Whether a request for `path` must carry an API key when the gateway has keys."""
    return path not in OPEN_PATHS and path not in PAGE_PATHS and path not in ADMIN_PATHS


def cookie_may_open(path: str) -> bool:
    """The session cookie opens the dashboard's data and assets only: never /v1, /metrics, nor the
    session path itself (a new cookie takes the key again, so a session ends when its key does)."""
    return path.startswith(COOKIE_PATH) and path != SESSION_PATH


def role_may_open(role: str, path: str) -> bool:
    """A tenant's key opens the API; /metrics and the dashboard show every tenant: ops and admin."""
    return role != "tenant" or not (path == "/metrics" or path.startswith(COOKIE_PATH))


def _signature(keys: tuple[str, ...], expires: int, key_id: str) -> str:
    secret = hashlib.sha256(b"lanes-dashboard\0" + "\0".join(sorted(keys)).encode()).digest()
    return hmac.new(secret, f"{expires}.{key_id}".encode(), hashlib.sha256).hexdigest()


def session_token(keys: tuple[str, ...], now: float, key_id: str, seconds: int = SESSION_SECONDS) -> str:
    """A cookie for the key whose sha256 is `key_id`, until now + seconds."""
    expires = int(now) + seconds
    return f"{expires}.{key_id}.{_signature(keys, expires, key_id)}"


def session_ok(keys: tuple[str, ...], token: str, now: float, key_ids: frozenset[str]) -> bool:
    """A token this gateway's keys signed, not yet expired, for a key still among `key_ids` (the
    keys that may open the dashboard)."""
    expires_text, key_id, signature = (token.split(".") + ["", ""])[:3]
    if not keys or not expires_text.isdigit() or len(expires_text) > 12 or key_id not in key_ids:
        return False
    expires = int(expires_text)
    good = _signature(keys, expires, key_id)
    return hmac.compare_digest(signature.encode(), good.encode()) and now < expires
