"""Who a key belongs to and what it may use: the keys file (TOML), parsed purely, reloaded on change.

Each `[[keys]]` entry holds a key's SHA-256 (or, for a quick start, the key itself, hashed at
load and never kept), the tenant it names, its priority class, the models it may use (shell
patterns) and optional limits. A presented key is found by its hash: the table holds no key
in plain text, and a dict lookup on a digest tells a timing observer nothing about the keys.
A malformed file keeps the last good table and says why in one line (KeysFile.check).
"""

from __future__ import annotations

import fnmatch
import math
import hashlib
import os
import re
import tomllib
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path

from shared import defaults

# A class name, or a number: above 0 ranks with critical, 0 with standard, below 0 is sheddable
# (llm-d's InferenceObjective.priority reads the same way). Higher is served first.
CLASSES = {"critical": 1, "standard": 0, "sheddable": -1}
ANONYMOUS = "anonymous"  # the tenant of every request when the gateway has no keys at all
PLAIN = "default"  # the tenant of a key given with --api-key / --api-key-file
_TENANT = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_-]{0,63}$")  # one NATS subject token (its usage key)
_HEX = re.compile(r"^[0-9a-f]{64}$")
_FIELDS = {"sha256", "key", "tenant", "priority", "models", "weight", "tokens_per_minute", "tokens_per_day",
           "max_concurrent", "note", "role", "cache", "lanes"}  # fmt: skip
CACHES = ("shared", "private")
# What a key opens: `tenant` the API alone; `ops` also /metrics and the dashboard (every tenant's
# figures, read-only); `admin` also the dashboard's config change. A key of the file is a tenant's
# unless it says otherwise; an --api-key key (the operator's own) is ops.
ROLES = ("tenant", "ops", "admin")
PLAIN_ROLE = "ops"


def class_of(priority: int) -> str:
    """The metric label and ceiling class of a priority number."""
    return "critical" if priority > 0 else "standard" if priority == 0 else "sheddable"


def digest(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


@dataclass(frozen=True)
class Tenant:
    """What one key lets its holder do."""

    name: str = ANONYMOUS
    priority: int = 0
    models: tuple[str, ...] = ("*",)
    weight: float = 1.0  # its share of contested slots relative to other tenants' (token-fair queueing)
    tokens_per_minute: int | None = None  # prompt + weighted output tokens, per calendar minute (UTC)
    tokens_per_day: int | None = None  # ... per calendar day (UTC)
    max_concurrent: int | None = None  # requests in flight or waiting on one gateway
    # "private": its requests never meet another tenant's prompt cache. They go only to the lanes
    # dedicated to it (`lanes`: requested model -> the persona, planned in demand like any, whose
    # lanes serve this tenant alone); a model without one is refused (403 private_cache_unavailable).
    cache: str = "shared"
    lanes: tuple[tuple[str, str], ...] = ()  # (model it asks for, the alias of its dedicated lanes)

    def dedicated(self, model: str) -> str | None:
        """The alias of this tenant's own lanes for `model` (the base name, no adapter), or None."""
        return dict(self.lanes).get(model)

    @property
    def klass(self) -> str:
        return class_of(self.priority)

    def may_use(self, model: str) -> bool:
        return any(fnmatch.fnmatchcase(model, pattern) for pattern in self.models)


@dataclass(frozen=True)
class KeyTable:
    by_digest: dict[str, Tenant] = field(default_factory=dict)
    roles: dict[str, str] = field(default_factory=dict)  # digest -> its role (a key's, not its tenant's)

    def find(self, presented: str) -> Tenant | None:
        return self.by_digest.get(digest(presented)) if presented else None

    def role(self, hashed: str) -> str:
        """The role of the key with this digest (a tenant's where the table says none)."""
        return self.roles.get(hashed, "tenant")

    def tenants(self) -> dict[str, Tenant]:
        """Each tenant once (its keys agree on its limits: parse checks)."""
        return {t.name: t for t in self.by_digest.values()}

    @cached_property
    def dedicated_to(self) -> dict[str, str]:
        """Alias of dedicated lanes -> the one tenant they serve (no other tenant may ask for it)."""
        return {alias: t.name for t in self.by_digest.values() for _, alias in t.lanes}


def _int_limit(entry: dict, name: str, where: str) -> int | None:
    value = entry.get(name)
    if value is None:
        return None
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise ValueError(f"{where}: {name} must be a positive whole number, not {value!r}")
    return value


def _priority(value: object, where: str) -> int:
    if isinstance(value, str) and value in CLASSES:
        return CLASSES[value]
    if isinstance(value, int) and not isinstance(value, bool) and -1000 <= value <= 1000:
        return value
    raise ValueError(f"{where}: priority must be critical, standard, sheddable or a number, not {value!r}")


def parse(text: str, plain_keys: tuple[str, ...] = ()) -> KeyTable:
    """The keys file's table (plus --api-key keys as tenant `default`); ValueError names the first problem."""
    try:
        doc = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise ValueError(f"not TOML: {exc}") from None
    entries = doc.get("keys", [])
    if not isinstance(entries, list) or set(doc) - {"keys"}:
        raise ValueError("expected only [[keys]] tables")
    table: dict[str, Tenant] = {digest(k): Tenant(PLAIN) for k in plain_keys}
    roles: dict[str, str] = {digest(k): PLAIN_ROLE for k in plain_keys}
    seen: dict[str, Tenant] = {}
    for i, entry in enumerate(entries, 1):
        where = f"key {i}"
        if not isinstance(entry, dict):
            raise ValueError(f"{where}: not a table")
        if unknown := set(entry) - _FIELDS:
            raise ValueError(f"{where}: unknown field {sorted(unknown)[0]!r}")
        if ("sha256" in entry) == ("key" in entry):
            raise ValueError(f"{where}: give exactly one of sha256 or key")
        if "sha256" in entry:
            hashed = entry["sha256"]
            if not isinstance(hashed, str) or not _HEX.match(hashed.lower()):
                raise ValueError(f"{where}: sha256 must be 64 hex digits")
            hashed = hashed.lower()
        else:
            if not isinstance(entry["key"], str) or len(entry["key"]) < 8:
                raise ValueError(f"{where}: key must be a string of at least 8 characters")
            hashed = digest(entry["key"])
        name = entry.get("tenant")
        if not isinstance(name, str) or not _TENANT.match(name):
            raise ValueError(f"{where}: tenant must be 1-64 letters, digits, '_' or '-', starting with a letter or digit")
        where = f"key {i} (tenant {name})"
        models = entry.get("models", ["*"])
        if not isinstance(models, list) or not models or not all(isinstance(m, str) and m for m in models):
            raise ValueError(f"{where}: models must be a non-empty list of names or patterns")
        weight = entry.get("weight", 1.0)
        if not isinstance(weight, (int, float)) or isinstance(weight, bool) or not 0 < weight <= 1000:
            raise ValueError(f"{where}: weight must be a number above 0 (at most 1000)")
        cache = entry.get("cache", "shared")
        if cache not in CACHES:
            raise ValueError(f"{where}: cache must be one of {', '.join(CACHES)}, not {cache!r}")
        lanes = entry.get("lanes", {})
        if not isinstance(lanes, dict) or not all(isinstance(k, str) and isinstance(v, str) and v and ":" not in v
                                                  for k, v in lanes.items()):  # fmt: skip
            raise ValueError(f"{where}: lanes must map a model name to the alias of the lanes dedicated to this tenant")
        tenant = Tenant(
            name=name, priority=_priority(entry.get("priority", "standard"), where), models=tuple(models),
            weight=float(weight), tokens_per_minute=_int_limit(entry, "tokens_per_minute", where),
            tokens_per_day=_int_limit(entry, "tokens_per_day", where),
            max_concurrent=_int_limit(entry, "max_concurrent", where),
            cache=cache, lanes=tuple(sorted(lanes.items())),
        )  # fmt: skip
        if name in seen and seen[name] != tenant:
            raise ValueError(f"{where}: differs from an earlier key of the same tenant (keys of one tenant share it)")
        if hashed in table and table[hashed] != tenant:
            raise ValueError(f"{where}: the same key is listed twice")
        role = entry.get("role", "tenant")
        if role not in ROLES:
            raise ValueError(f"{where}: role must be one of {', '.join(ROLES)}, not {role!r}")
        seen[name] = tenant
        table[hashed] = tenant
        roles[hashed] = role
    owners: dict[str, str] = {}
    for t in seen.values():
        for _, alias in t.lanes:
            if owners.setdefault(alias, t.name) != t.name:
                raise ValueError(f"lanes {alias!r} are dedicated to two tenants ({owners[alias]} and {t.name})")
    return KeyTable(table, roles)


@dataclass
class KeysFile:
    """The keys file as last read well; check() rereads it when its stat changes."""

    path: Path
    plain_keys: tuple[str, ...] = ()
    table: KeyTable = field(default_factory=KeyTable)
    error: str = ""  # why the file on disk is not the table in use; empty when it is
    _stamp: tuple = ()

    def check(self) -> str | None:
        """Reread on change; returns a one-line message when something changed (loaded or refused)."""
        try:
            st = os.stat(self.path)
            stamp = (st.st_mtime_ns, st.st_size, st.st_ino)
            if stamp == self._stamp:
                return None
            self._stamp = stamp
            text = self.path.read_text()
        except OSError as exc:
            stamp = ("missing", exc.errno)
            if stamp == self._stamp:
                return None
            self._stamp = stamp
            self.error = f"keys file {self.path}: {exc.strerror}; keeping the last good keys"
            return self.error
        try:
            self.table = parse(text, self.plain_keys)
        except ValueError as exc:
            self.error = f"keys file {self.path}: {exc}; keeping the last good keys"
            return self.error
        self.error = ""
        return f"keys file {self.path}: {len(self.table.by_digest)} keys, {len(self.table.tenants())} tenants"


def refusal_ceiling(priority: int, depth: int) -> int:
    """Waiting requests a class may find in a model's queue and still join it (its admission ceiling)."""
    share = {"critical": 1.0, "standard": defaults.STANDARD_CEILING, "sheddable": defaults.SHEDDABLE_CEILING}
    return max(1, math.ceil(depth * share[class_of(priority)] - 1e-9))
