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
expires; it holds an expiry and the sha256 of the key it was traded for, signed with a random
secret (CookieSecret) that gateways share through NATS (bucket lanes-secrets, which only they
may read), so any gateway of the fleet accepts it; nothing in it derives from the keys, so
reading the keys file forges nothing. Revoking its key (or making it a tenant's) ends its
sessions; so does a new secret.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
import secrets
from dataclasses import dataclass, field

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


SECRET_BYTES = 32


@dataclass
class CookieSecret:
    """What session cookies are signed with: random at start, then the fleet's (the first
    gateway's, shared through NATS), so a cookie one gateway gave opens the others'."""

    value: bytes = field(default_factory=lambda: secrets.token_bytes(SECRET_BYTES), repr=False)
    shared: bool = False  # taken from NATS (False: this gateway's own, until the bus has one)

    def text(self) -> str:
        return base64.urlsafe_b64encode(self.value).decode().rstrip("=")

    def adopt(self, text: str) -> bool:
        """Take the fleet's secret (from its text form); whether it changed this gateway's."""
        try:
            value = base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))
        except (binascii.Error, ValueError):
            return False
        if len(value) < SECRET_BYTES:
            return False
        changed = value != self.value
        self.value, self.shared = value, True
        return changed


def _signature(secret: bytes, expires: int, key_id: str) -> str:
    return hmac.new(secret, f"{expires}.{key_id}".encode(), hashlib.sha256).hexdigest()


def session_token(secret: bytes, now: float, key_id: str, seconds: int = SESSION_SECONDS) -> str:
    """A cookie for the key whose sha256 is `key_id`, until now + seconds."""
    expires = int(now) + seconds
    return f"{expires}.{key_id}.{_signature(secret, expires, key_id)}"


def session_ok(secret: bytes, token: str, now: float, key_ids: frozenset[str]) -> bool:
    """A token signed with `secret`, not yet expired, at most SESSION_SECONDS from its making,
    for a key still among `key_ids` (the keys that may open the dashboard)."""
    expires_text, key_id, signature = (token.split(".") + ["", ""])[:3]
    if not secret or not expires_text.isdigit() or len(expires_text) > 12 or key_id not in key_ids:
        return False
    expires = int(expires_text)
    good = _signature(secret, expires, key_id)
    return hmac.compare_digest(signature.encode(), good.encode()) and now < expires <= now + SESSION_SECONDS
