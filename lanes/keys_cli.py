"""`lanes keys add/list/revoke`: edit the gateway's keys file (gateway/tenants/keys.py) in place.

A new key is printed once and stored as its SHA-256 only. Edits keep every other entry and its
comments as they were, are checked by the gateway's own parser before they are written, and
replace the file in one rename: a gateway rereading it sees the old file or the new one.
"""

from __future__ import annotations

import argparse
import os
import secrets
import tomllib
from datetime import datetime, timezone
from pathlib import Path

from gateway.tenants import CLASSES, ROLES, class_of, digest, parse
from lanes.errors import UserError


def add_parser(sub) -> None:
    p = sub.add_parser("keys", help="add, list or revoke the gateway's keys (the --keys-file)")
    ksub = p.add_subparsers(dest="action", required=True)
    for name, text in (("add", "a new key for a tenant (printed once)"), ("list", "the keys, by tenant"),
                       ("revoke", "remove keys by the start of their sha256, or every key of a --tenant")):  # fmt: skip
        q = ksub.add_parser(name, help=text)
        q.add_argument("--file", default=os.environ.get("LANES_GATEWAY_KEYS_FILE"),
                       help="the keys file (env LANES_GATEWAY_KEYS_FILE)")  # fmt: skip
        if name == "add":
            q.add_argument("--tenant", required=True)
            q.add_argument("--priority", default="standard", help="critical, standard, sheddable or a number")
            q.add_argument("--models", default="*", help="comma-separated names or patterns (default: all)")
            q.add_argument("--weight", type=float, help="share of contested slots relative to other tenants (1)")
            q.add_argument("--tokens-per-minute", type=int)
            q.add_argument("--tokens-per-day", type=int)
            q.add_argument("--max-concurrent", type=int)
            q.add_argument("--role", choices=ROLES, default="tenant",
                           help="tenant: the API only (default); ops: also /metrics and the dashboard; admin: also "
                                "the dashboard's config change")  # fmt: skip
        if name == "revoke":
            q.add_argument("sha256", nargs="?", help="the start of the key's sha256 (at least 8 hex digits)")
            q.add_argument("--tenant", help="revoke every key of this tenant")


def _blocks(text: str) -> tuple[str, list[str]]:
    """(what precedes the first [[keys]], each [[keys]] block as written)."""
    head, blocks, current = [], [], None
    for line in text.splitlines(keepends=True):
        if line.strip() == "[[keys]]":
            current = [line]
            blocks.append(current)
        elif current is None:
            head.append(line)
        else:
            current.append(line)
    return "".join(head), ["".join(b) for b in blocks]


def _entry(block: str) -> dict:
    return tomllib.loads(block)["keys"][0]


def _write(path: Path, text: str) -> None:
    try:
        parse(text)
    except ValueError as exc:
        raise UserError(f"{path}: the edit would make the file invalid: {exc}") from None
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(text)
    os.chmod(tmp, 0o600)
    os.replace(tmp, path)


def _value(v) -> str:
    if isinstance(v, str):
        return '"' + v.replace("\\", "\\\\").replace('"', '\\"') + '"'
    if isinstance(v, list):
        return "[" + ", ".join(_value(x) for x in v) + "]"
    return repr(v)


def cmd_keys(args: argparse.Namespace) -> int:
    if not args.file:
        raise UserError("name the keys file: --file FILE or env LANES_GATEWAY_KEYS_FILE")
    path = Path(args.file)
    text = path.read_text() if path.exists() else ""
    try:
        parse(text)
    except ValueError as exc:
        raise UserError(f"{path}: {exc}") from None
    head, blocks = _blocks(text)
    if args.action == "list":
        for block in blocks:
            e = _entry(block)
            hashed = e.get("sha256") or digest(e["key"])
            prio = e.get("priority", "standard")
            limits = " ".join(f"{k}={e[k]}" for k in ("role", "weight", "tokens_per_minute", "tokens_per_day",
                                                      "max_concurrent") if k in e)  # fmt: skip
            klass = prio if isinstance(prio, str) else f"{prio} ({class_of(prio)})"
            plain = "  (plain key in the file)" if "key" in e else ""
            print(f"{hashed[:12]}  {e['tenant']:<20} {klass:<10} models={','.join(e.get('models', ['*']))} {limits}"
                  f"{plain}".rstrip())  # fmt: skip
        return 0
    if args.action == "add":
        key = "lanes-" + secrets.token_urlsafe(32)
        prio = args.priority if args.priority in CLASSES else int(args.priority) if args.priority.lstrip("-").isdigit() \
            else args.priority  # fmt: skip
        fields = {"sha256": digest(key), "tenant": args.tenant, "priority": prio,
                  "models": [m.strip() for m in args.models.split(",") if m.strip()]}  # fmt: skip
        for name in ("weight", "tokens_per_minute", "tokens_per_day", "max_concurrent"):
            if getattr(args, name) is not None:
                fields[name] = getattr(args, name)
        if args.role != "tenant":
            fields["role"] = args.role
        fields["note"] = f"added {datetime.now(timezone.utc):%Y-%m-%d %H:%M} UTC"
        block = "[[keys]]\n" + "".join(f"{k} = {_value(v)}\n" for k, v in fields.items())
        sep = "" if not text or text.endswith("\n\n") else "\n" if text.endswith("\n") else "\n\n"
        _write(path, text + sep + block)
        print(key)
        return 0
    if not args.sha256 and not args.tenant:
        raise UserError("revoke: give the start of a key's sha256, or --tenant")
    if args.sha256 and (len(args.sha256) < 8 or any(c not in "0123456789abcdef" for c in args.sha256.lower())):
        raise UserError("revoke: give at least 8 hex digits of the sha256 (`lanes keys list` shows them)")

    def revoked(block: str) -> bool:
        e = _entry(block)
        hashed = e.get("sha256", "").lower() or digest(e["key"])
        return (bool(args.sha256) and hashed.startswith(args.sha256.lower())) or e["tenant"] == args.tenant

    kept = [b for b in blocks if not revoked(b)]
    if len(kept) == len(blocks):
        raise UserError("revoke: no key matched")
    _write(path, head + "".join(kept))
    print(f"revoked {len(blocks) - len(kept)} key(s)")
    return 0
