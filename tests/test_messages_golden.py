"""The wire format, held still: every message's schema and the bytes of one filled-in instance,
recorded in tests/golden/messages.json before `shared/messages.py` became a package.

Moving a struct between modules, renaming a Python-only name or splitting a file must change
none of it. Re-record (`python tests/test_messages_golden.py record`) only for an intended wire
change, and say so in the commit.
"""

from __future__ import annotations

import importlib
import json
import pkgutil
import re
import sys
from pathlib import Path

import msgspec
import msgspec.inspect as mi

GOLDEN = Path(__file__).resolve().parent / "golden" / "messages.json"
CANDIDATE_TEXTS = ("gemma", "cpu", "CUDA0", "127.0.0.1:50052", "0", "a", "lane-0123456789abcdef",
                   "secret-0123456789abcdef0123456789abcdef0123456789")  # fmt: skip


def wire_structs() -> dict[str, type[msgspec.Struct]]:
    """Every Struct defined in shared.messages or its modules, by name (names are unique), bases left out."""
    import shared.messages as root

    modules = [root]
    if hasattr(root, "__path__"):
        modules += [importlib.import_module(m.name) for m in pkgutil.iter_modules(root.__path__, "shared.messages.")]
    found: dict[str, type[msgspec.Struct]] = {}
    for module in modules:
        for value in vars(module).values():
            if isinstance(value, type) and issubclass(value, msgspec.Struct) and value.__module__ == module.__name__ \
                    and not value.__subclasses__():  # a base class is never sent: its fields are in each message's
                assert value.__name__ not in found or found[value.__name__] is value, value.__name__
                found[value.__name__] = value
    return found


def _text(info: mi.StrType) -> str:
    for text in CANDIDATE_TEXTS:
        if info.pattern and not re.search(info.pattern, text):
            continue
        if (info.min_length or 0) <= len(text) <= (info.max_length or 10**9):
            return text
    raise AssertionError(f"no sample text fits {info}")


def sample(info: mi.Type) -> object:
    """One value of a type, the same on every run: the smallest that its constraints admit."""
    if isinstance(info, mi.UnionType):
        chosen = [t for t in info.types if not isinstance(t, mi.NoneType)]
        return sample(chosen[0])
    if isinstance(info, mi.LiteralType):
        return info.values[0]
    if isinstance(info, mi.BoolType):
        return True
    if isinstance(info, mi.IntType):
        low = info.ge if info.ge is not None else (info.gt + 1 if info.gt is not None else 0)
        return max(low, min(3, info.le if info.le is not None else 3))
    if isinstance(info, mi.FloatType):
        low = info.ge if info.ge is not None else 0.0
        return max(low, min(1.5, info.le if info.le is not None else 1.5))
    if isinstance(info, mi.StrType):
        return _text(info)
    if isinstance(info, (mi.ListType, mi.TupleType, mi.VarTupleType, mi.SetType, mi.FrozenSetType)):
        item = info.item_type if hasattr(info, "item_type") else None
        if item is None:
            return [sample(t) for t in info.item_types]
        return [] if info.max_length == 0 else [sample(item)]
    if isinstance(info, mi.DictType):
        return {sample(info.key_type): sample(info.value_type)}
    if isinstance(info, mi.StructType) and info.array_like:
        return ([info.tag] if info.tag_field else []) + [sample(f.type) for f in info.fields]
    if isinstance(info, mi.StructType):
        return {f.encode_name: sample(f.type) for f in info.fields} | (
            {info.tag_field: info.tag} if info.tag_field else {})  # fmt: skip
    if isinstance(info, mi.AnyType):
        return None
    raise AssertionError(f"no sample for {info!r}")


def record_of(struct: type[msgspec.Struct]) -> dict:
    filled = msgspec.convert(sample(mi.type_info(struct)), struct)
    (_,), components = msgspec.json.schema_components([struct], ref_template="#/$defs/{name}")
    own = components[struct.__name__]  # the structs it holds are recorded under their own names
    return {"schema": _without_descriptions(json.loads(json.dumps(own))), "sample": msgspec.json.encode(filled).decode(),
            "defaults": msgspec.json.encode(msgspec.convert(_required_only(struct), struct)).decode()}  # fmt: skip


def _without_descriptions(schema: object) -> object:
    """Docstrings are no part of the wire: they may change as code moves."""
    if isinstance(schema, dict):
        return {k: _without_descriptions(v) for k, v in schema.items() if k != "description"}
    if isinstance(schema, list):
        return [_without_descriptions(v) for v in schema]
    return schema


def _required_only(struct: type[msgspec.Struct]) -> dict:
    info = mi.type_info(struct)
    if info.array_like:
        return sample(info)
    return {f.encode_name: sample(f.type) for f in info.fields if f.required} | (
        {info.tag_field: info.tag} if info.tag_field else {})  # fmt: skip


def current() -> dict[str, dict]:
    return {name: record_of(struct) for name, struct in sorted(wire_structs().items())}


def test_every_messages_schema_and_bytes_are_the_recorded_ones():
    recorded = json.loads(GOLDEN.read_text())
    now = current()
    assert sorted(now) == sorted(recorded), "a message was added or removed: re-record for an intended change"
    for name in recorded:
        assert now[name]["schema"] == recorded[name]["schema"], name
        assert now[name]["sample"] == recorded[name]["sample"], name
        assert now[name]["defaults"] == recorded[name]["defaults"], name


def test_the_samples_decode_back_to_what_was_encoded():
    for name, struct in wire_structs().items():
        data = current()[name]["sample"]
        assert msgspec.json.encode(msgspec.json.decode(data, type=struct)).decode() == data, name


def test_the_golden_file_is_not_empty_and_covers_the_tagged_messages():
    recorded = json.loads(GOLDEN.read_text())
    assert {"HostReport", "HostPlan", "HostStatus", "FleetConfig", "PrefixEvent", "GatewayActivity"} <= set(recorded)
    assert all(r["sample"].startswith("{") or r["sample"].startswith("[") for r in recorded.values())


if __name__ == "__main__" and sys.argv[1:] == ["record"]:
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    lines = [f"{json.dumps(name)}: {json.dumps(record, sort_keys=True)}" for name, record in current().items()]
    GOLDEN.write_text("{\n" + ",\n".join(lines) + "\n}\n")  # a message a line: a diff names the messages
    print(f"recorded {len(json.loads(GOLDEN.read_text()))} messages in {GOLDEN}")
