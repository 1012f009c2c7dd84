"""docs/schemas/ must match the wire messages in shared.messages."""

from __future__ import annotations

import json

import msgspec
import msgspec.inspect

from shared.messages import WIRE_TYPES, FleetConfig, HostReport
from shared.schemas import DEFAULT_FOLDER, render_schemas, write_schemas

FIX = "docs/schemas/ is stale: run `python -m shared.schemas` and commit the result"


def test_schemas_up_to_date():
    rendered = render_schemas()
    on_disk = {p.name: p.read_bytes() for p in DEFAULT_FOLDER.glob("*.json")} if DEFAULT_FOLDER.is_dir() else {}
    missing = sorted(set(rendered) - set(on_disk))
    extra = sorted(set(on_disk) - set(rendered))
    changed = sorted(n for n in set(rendered) & set(on_disk) if rendered[n] != on_disk[n])
    assert not (missing or extra or changed), f"{FIX} (missing: {missing}, extra: {extra}, changed: {changed})"


def test_one_schema_per_wire_type_named_by_tag():
    rendered = render_schemas()
    assert len(rendered) == len(WIRE_TYPES)
    assert "host_report.json" in rendered and "fleet_config.json" in rendered
    for kind in WIRE_TYPES:
        assert f"{kind.__struct_config__.tag}.json" in rendered


def test_schemas_are_deterministic_pretty_json():
    first, second = render_schemas(), render_schemas()
    assert first == second
    for name, data in first.items():
        assert data.endswith(b"\n") and not data.endswith(b"\n\n"), name
        parsed = json.loads(data)
        assert data.decode() == json.dumps(parsed, indent=2, sort_keys=True, ensure_ascii=False) + "\n"
        kind = next(k for k in WIRE_TYPES if f"{k.__struct_config__.tag}.json" == name)
        assert parsed == json.loads(msgspec.json.encode(msgspec.json.schema(kind)))


def test_schema_content():
    report = json.loads(render_schemas()["host_report.json"])
    definition = report["$defs"]["HostReport"]
    assert definition["properties"]["kind"]["enum"] == ["host_report"]
    assert "host_id" in definition["required"]
    config = json.loads(render_schemas()["fleet_config.json"])["$defs"]["FleetConfig"]
    assert config["additionalProperties"] is False  # forbid_unknown_fields
    assert HostReport.__struct_config__.tag == "host_report"
    assert FleetConfig.__struct_config__.tag == "fleet_config"


def test_write_schemas_removes_stale_files(tmp_path):
    (tmp_path / "old_message.json").write_text("{}\n")
    (tmp_path / "notes.txt").write_text("kept")
    written = write_schemas(tmp_path)
    assert sorted(p.name for p in tmp_path.glob("*.json")) == sorted(render_schemas())
    assert len(written) == len(WIRE_TYPES)
    assert (tmp_path / "notes.txt").exists()
    for path in written:
        assert path.read_bytes() == render_schemas()[path.name]


def _unbounded(info, path: str, seen: set) -> list[str]:
    """Fields of a msgspec type with no range: numbers without an upper bound, strings without a
    length (or a pattern that bounds it), tuples and dicts without a count."""
    if isinstance(info, msgspec.inspect.StructType):
        if info.cls in seen:
            return []
        seen.add(info.cls)
        return [p for f in info.fields for p in _unbounded(f.type, f"{path}.{f.name}", seen)]
    if isinstance(info, msgspec.inspect.UnionType):
        return [p for t in info.types for p in _unbounded(t, path, seen)]
    if isinstance(info, msgspec.inspect.TupleType):
        return [p for t in info.item_types for p in _unbounded(t, f"{path}()", seen)]
    if isinstance(info, msgspec.inspect.VarTupleType):
        return ([path] if info.max_length is None else []) + _unbounded(info.item_type, f"{path}[]", seen)
    if isinstance(info, msgspec.inspect.DictType):
        keys, values = _unbounded(info.key_type, f"{path}{{key}}", seen), _unbounded(info.value_type, f"{path}{{}}", seen)
        return ([path] if info.max_length is None else []) + keys + values
    if isinstance(info, (msgspec.inspect.IntType, msgspec.inspect.FloatType)):
        low, high = (info.ge, info.gt), (info.le, info.lt)
        return [] if any(v is not None for v in low) and any(v is not None for v in high) else [path]
    if isinstance(info, msgspec.inspect.StrType):
        return [] if info.max_length is not None or info.pattern else [path]
    return []


def test_every_field_of_every_wire_message_has_a_range():
    """Bus input is bounded: one message cannot carry a huge count, interval, size or name."""
    seen: set = set()
    unbounded = [p for kind in WIRE_TYPES for p in _unbounded(msgspec.inspect.type_info(kind), kind.__name__, seen)]
    assert not unbounded, unbounded
