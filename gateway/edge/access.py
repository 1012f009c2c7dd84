"""Which gateway paths need an API key, and the dashboard's session cookie (pure: no sockets).

With keys configured, everything needs one except the probes (/health, /ready) and the
dashboard's page shell, which holds no data and only asks for the key. /metrics takes it as
a bearer token (what Prometheus's scrape config sends). The dashboard's config change is
guarded by the admin key alone, in its own handler: the two keys stay separate.

The page trades its key once for a session cookie (POST /dashboard/api/session with the
bearer key): a browser's EventSource and <script src> cannot send an Authorization header,
and a key in the stream's URL would land in access logs and proxies. The cookie is
HttpOnly, SameSite=Strict, limited to /dashboard/ and expires; it holds an expiry signed
with the configured keys, so any gateway with the same keys accepts it (no shared state)
and removing a key ends every session signed with it.
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
    """The session cookie opens the dashboard's data and assets only, never /v1 or /metrics."""
    return path.startswith(COOKIE_PATH)


def _signature(keys: tuple[str, ...], expires: int) -> str:
    secret = hashlib.sha256(b"lanes-dashboard\0" + "\0".join(sorted(keys)).encode()).digest()
    return hmac.new(secret, str(expires).encode(), hashlib.sha256).hexdigest()


def session_token(keys: tuple[str, ...], now: float, seconds: int = SESSION_SECONDS) -> str:
    expires = int(now) + seconds
    return f"{expires}.{_signature(keys, expires)}"


def session_ok(keys: tuple[str, ...], token: str, now: float) -> bool:
    """A token this gateway's keys signed, not yet expired."""
    expires_text, _, signature = token.partition(".")
    if not keys or not expires_text.isdigit() or len(expires_text) > 12:
        return False
    expires = int(expires_text)
    return hmac.compare_digest(signature.encode(), _signature(keys, expires).encode()) and now < expires
