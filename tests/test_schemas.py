"""docs/schemas/ must match the wire messages in shared.messages."""

from __future__ import annotations

import json

import msgspec

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
