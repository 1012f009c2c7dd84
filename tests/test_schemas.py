"""docs/schemas/ must match the wire messages in shared/messages/."""

from __future__ import annotations

import gc
import json
import pkgutil

import msgspec
import msgspec.inspect

from shared import messages
from shared.messages import catalog
from shared.messages.catalog import WIRE_TYPES
from shared.messages.config import FleetConfig
from shared.messages.hosts import HostReport
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


def _nodes(info, path: str, seen: set):
    """(path, type) of every type a msgspec type is made of, each struct once."""
    yield path, info
    if isinstance(info, msgspec.inspect.StructType):
        if info.cls in seen:
            return
        seen.add(info.cls)
        for f in info.fields:
            yield from _nodes(f.type, f"{path}.{f.name}", seen)
    elif isinstance(info, msgspec.inspect.UnionType):
        for t in info.types:
            yield from _nodes(t, path, seen)
    elif isinstance(info, msgspec.inspect.TupleType):
        for t in info.item_types:
            yield from _nodes(t, f"{path}()", seen)
    elif isinstance(info, (msgspec.inspect.VarTupleType, msgspec.inspect.ListType, msgspec.inspect.SetType)):
        yield from _nodes(info.item_type, f"{path}[]", seen)
    elif isinstance(info, msgspec.inspect.DictType):
        yield from _nodes(info.key_type, f"{path}{{key}}", seen)
        yield from _nodes(info.value_type, f"{path}{{}}", seen)


def _unbounded(info, path: str, seen: set) -> list[str]:
    """Fields of a msgspec type with no range: numbers without an upper bound, strings without a
    length (or a pattern that bounds it), tuples and dicts without a count."""
    out = []
    for where, t in _nodes(info, path, seen):
        if isinstance(t, (msgspec.inspect.VarTupleType, msgspec.inspect.DictType)):
            bounded = t.max_length is not None
        elif isinstance(t, (msgspec.inspect.IntType, msgspec.inspect.FloatType)):
            bounded = any(v is not None for v in (t.ge, t.gt)) and any(v is not None for v in (t.le, t.lt))
        elif isinstance(t, msgspec.inspect.StrType):
            bounded = t.max_length is not None or bool(t.pattern)
        else:
            bounded = True
        out += [] if bounded else [where]
    return out


def test_every_field_of_every_wire_message_has_a_range():
    """Bus input is bounded: one message cannot carry a huge count, interval, size or name."""
    seen: set = set()
    unbounded = [p for kind in WIRE_TYPES for p in _unbounded(msgspec.inspect.type_info(kind), kind.__name__, seen)]
    assert not unbounded, unbounded


_SCALARS = (
    msgspec.inspect.IntType, msgspec.inspect.FloatType, msgspec.inspect.StrType, msgspec.inspect.BoolType,
    msgspec.inspect.NoneType, msgspec.inspect.LiteralType, msgspec.inspect.BytesType,
)  # fmt: skip


def _cycle_risks(info, path: str, seen: set) -> list[str]:
    """Fields through which a message could end up referring to itself: a mutable container
    (list, set, dict) holding anything but scalars."""
    mutable = (msgspec.inspect.ListType, msgspec.inspect.SetType, msgspec.inspect.DictType)
    return [
        where for where, t in _nodes(info, path, seen)
        if isinstance(t, mutable) and not all(isinstance(n, _SCALARS + (msgspec.inspect.UnionType,))
                                              for _, n in list(_nodes(t, "", set()))[1:])
    ]  # fmt: skip


def test_messages_are_not_tracked_by_the_garbage_collector_and_cannot_form_a_cycle():
    """Every struct in shared/messages/ is frozen with gc=False (a 10,000-host replan holds tens
    of thousands of them; bench/planner_bench.py): safe only while no message can refer to
    itself, so each one is frozen and its mutable containers hold scalars only."""
    kinds = catalog.structs()
    assert len(kinds) > len(WIRE_TYPES)
    assert [k.__name__ for k in kinds if k.__struct_config__.gc or not k.__struct_config__.frozen] == []
    seen: set = set()
    assert [p for k in kinds for p in _cycle_risks(msgspec.inspect.type_info(k), k.__name__, seen)] == []
    report = HostReport(host_id="h", cpu_cores=1, ram_total=1, ram_available=1)
    assert not gc.is_tracked(report)


def test_the_catalog_walks_every_module_of_the_package():
    """catalog.structs() (this file, docs/reference/messages.md) misses no module."""
    found = {m.name for m in pkgutil.iter_modules(messages.__path__, f"{messages.__name__}.")}
    assert found - {catalog.__name__} == {m.__name__ for m in catalog.MODULES}
