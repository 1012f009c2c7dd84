"""Each lane's API key: llama-server answers only requests that carry it (`--api-key-file`), so a
client that reaches a lane's port without a gateway is refused.

A new key at every start of a lane, written to a file only the agent's user (or the lane's, when
lanes run as another user) may read, beside the lane's log; never on a command line or in an
environment. The agent sends it with its own requests to the lane (launcher_agent/lane_http.py)
and puts it in bucket lanes-secrets for the gateways (launcher_agent/service.py).
"""

from __future__ import annotations

import os
import secrets
from pathlib import Path

PREFIX = "lane-"  # a lane's key among others in a log or a dump: recognisable, and never a gateway's
KEY_BYTES = 32


def new_key() -> str:
    return PREFIX + secrets.token_urlsafe(KEY_BYTES)


def key_path(lanes_dir: Path, lane_id: str) -> Path:
    return lanes_dir / f"{lane_id}.key"


def write_key(path: Path, key: str, owner: tuple[int, int] | None = None) -> None:
    """Written whole or not at all, mode 0600 from its creation (no moment world-readable);
    `owner`: (uid, gid) of the user the lane runs as, where the agent runs as root."""
    path.parent.mkdir(parents=True, exist_ok=True)
    temporary = path.with_name(f".{path.name}.{os.getpid()}")
    temporary.unlink(missing_ok=True)
    fd = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.write(fd, (key + "\n").encode())
        if owner is not None:
            os.fchown(fd, *owner)
    finally:
        os.close(fd)
    os.replace(temporary, path)


def read_key(path: Path) -> str | None:
    """The key a running lane was started with (a lane this agent adopts), or None."""
    try:
        key = path.read_text().strip()
    except OSError:
        return None
    return key or None


def remove_key(path: Path) -> None:
    path.unlink(missing_ok=True)
