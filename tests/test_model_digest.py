"""A model file's sha256, kept per file version: computed once, again only when the file changes."""

from __future__ import annotations

import asyncio
import hashlib
import os

from launcher_agent import model_digest
from launcher_agent.model_digest import ModelDigests


async def test_a_digest_is_the_files_sha256_computed_once_per_version_and_kept_across_restarts(tmp_path, monkeypatch):
    model = tmp_path / "m.gguf"
    model.write_bytes(b"weights" * 100_000)
    reads = []
    real = model_digest.file_sha256
    monkeypatch.setattr(model_digest, "file_sha256", lambda path: reads.append(path) or real(path))
    digests = ModelDigests(tmp_path / "digests.json")
    assert digests.cached(str(model)) is None
    first = await asyncio.gather(*(digests.of(str(model)) for _ in range(5)))  # five asks, one read
    assert first == [hashlib.sha256(model.read_bytes()).hexdigest()] * 5 and len(reads) == 1
    again = ModelDigests(tmp_path / "digests.json")  # the agent restarted
    assert await again.of(str(model)) == first[0] and len(reads) == 1

    model.write_bytes(b"another quantization" * 100_000)  # replaced in place
    os.utime(model, ns=(1, 1))
    assert again.cached(str(model)) is None
    assert await again.of(str(model)) == hashlib.sha256(model.read_bytes()).hexdigest() != first[0]
    assert len(reads) == 2
    assert await again.of(str(tmp_path / "gone.gguf")) is None
