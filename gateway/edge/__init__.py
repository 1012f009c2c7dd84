"""The HTTP edge (aiohttp): the routes, the checks before a request is forwarded, the tries,
the answer relayed or assembled, keys and the dashboard's cookie, errors in OpenAI's shape."""

from gateway.edge.access import COOKIE, COOKIE_PATH, SESSION_PATH, SESSION_SECONDS, CookieSecret, session_token
from gateway.edge.app import admission_for, build_app
from gateway.edge.app_keys import COOKIE_SECRET, KEY_ID, KEYS, METRICS, USAGE
from gateway.edge.openai_errors import openai_error
from gateway.edge.tenancy import has_keys, key_ids_of

__all__ = [
    "COOKIE", "COOKIE_PATH", "COOKIE_SECRET", "KEY_ID", "KEYS", "METRICS", "SESSION_PATH", "SESSION_SECONDS", "USAGE",
    "CookieSecret", "admission_for", "build_app", "has_keys", "key_ids_of", "openai_error", "session_token",
]  # fmt: skip
