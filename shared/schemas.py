"""JSON Schemas of the wire messages, one file per type in docs/schemas/.

The files are generated from shared.messages.catalog.WIRE_TYPES and checked in, so a change to
a message shows up in review; tests/test_schemas.py fails when they are stale.

    python -m shared.schemas            # rewrite docs/schemas/
    python -m shared.schemas OUT_DIR    # write them somewhere else
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import msgspec

from shared.messages.catalog import WIRE_TYPES

DEFAULT_FOLDER = Path(__file__).resolve().parent.parent / "docs" / "schemas"


def schema_name(kind: type) -> str:
    """File name of a type's schema: its wire tag, e.g. host_report.json."""
    tag = kind.__struct_config__.tag
    if not isinstance(tag, str):
        raise ValueError(f"{kind.__name__} has no string tag")
    return f"{tag}.json"


def render_schema(kind: type) -> bytes:
    schema = msgspec.json.schema(kind)
    text = json.dumps(schema, indent=2, sort_keys=True, ensure_ascii=False)
    return (text + "\n").encode("utf-8")


def render_schemas() -> dict[str, bytes]:
    """File name -> file content for every wire type, in file-name order."""
    rendered = {schema_name(kind): render_schema(kind) for kind in WIRE_TYPES}
    if len(rendered) != len(WIRE_TYPES):
        raise ValueError("two wire types share a tag")
    return dict(sorted(rendered.items()))


def write_schemas(folder: str | os.PathLike[str] = DEFAULT_FOLDER) -> list[Path]:
    """Write every schema into folder and remove *.json files there that no type produces."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    rendered = render_schemas()
    written = []
    for name, data in rendered.items():
        path = folder / name
        if not path.is_file() or path.read_bytes() != data:
            path.write_bytes(data)
        written.append(path)
    for stale in sorted(folder.glob("*.json")):
        if stale.name not in rendered:
            stale.unlink()
    return written


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) > 1 or (args and args[0] in ("-h", "--help")):
        print("usage: python -m shared.schemas [FOLDER]  (default: docs/schemas/)", file=sys.stderr)
        return 2
    folder = Path(args[0]) if args else DEFAULT_FOLDER
    written = write_schemas(folder)
    print(f"wrote {len(written)} schemas to {folder}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
