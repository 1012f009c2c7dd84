"""Reading a config or demand file (JSON or TOML) into its message type, with one-line errors."""

from __future__ import annotations

from pathlib import Path
from typing import TypeVar

import msgspec

from lanes.errors import UserError

T = TypeVar("T")


def load_file(path: str, kind: type[T]) -> T:
    p = Path(path)
    if not p.is_file():
        raise UserError(f"{path}: no such file")
    data = p.read_bytes()
    try:
        if p.suffix == ".toml":
            return msgspec.toml.decode(data, type=kind)
        return msgspec.json.decode(data, type=kind)
    except (msgspec.ValidationError, msgspec.DecodeError) as exc:
        raise UserError(f"{path}: {exc}") from None
