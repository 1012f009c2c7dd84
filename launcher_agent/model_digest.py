"""A model file's sha256, read once per file version: what binds a saved slot to the weights that made it.

llama-server restores a slot file into any model of the same shape (another quantization, a base
model's file into its instruct version) and answers with the wrong state; the file's own path,
size and mtime say nothing once a file moves between hosts. The sha256 is also what Hugging Face
lists for each file (its LFS oid), so an operator can compare it by hand.

Hashing reads the whole file (about 1.5 GB/s on one core: 40 s for a 70 GB model), so each
digest is kept in `model-digests.json` under the file's (path, size, mtime, inode) and computed
again only when one of them changes; one computation per file runs at a time, off the event loop.
"""

from __future__ import annotations

import asyncio
import hashlib
import os
from dataclasses import dataclass, field
from pathlib import Path

import msgspec

CHUNK = 8 * 1024 * 1024
KEEP = 1024  # digests remembered: more model versions than a host holds


class Known(msgspec.Struct, frozen=True, gc=False):
    path: str
    size: int
    mtime_ns: int
    inode: int
    sha256: str


def file_sha256(path: str | Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


@dataclass
class ModelDigests:
    file: Path  # where the digests are kept across restarts
    known: dict[str, Known] = field(default_factory=dict)
    _running: dict[tuple, asyncio.Future] = field(default_factory=dict)

    def __post_init__(self) -> None:
        try:
            kept = msgspec.json.decode(self.file.read_bytes(), type=list[Known])
        except (OSError, msgspec.DecodeError, msgspec.ValidationError):
            kept = []
        self.known = {k.path: k for k in kept}

    def cached(self, path: str) -> str | None:
        """The digest of the file now at `path`, if it is known without reading the file."""
        try:
            st = os.stat(path)
        except OSError:
            return None
        k = self.known.get(path)
        return k.sha256 if k is not None and (k.size, k.mtime_ns, k.inode) == _version(st) else None

    async def of(self, path: str) -> str | None:
        """The digest of the file now at `path` (None: it is gone or unreadable)."""
        if (done := self.cached(path)) is not None:
            return done
        try:
            version = _version(os.stat(path))
        except OSError:
            return None
        key = (path, *version)
        if key not in self._running:
            self._running[key] = asyncio.ensure_future(self._compute(path, version))
        try:
            return await asyncio.shield(self._running[key])
        finally:
            if self._running.get(key) is not None and self._running[key].done():
                self._running.pop(key, None)

    async def _compute(self, path: str, version: tuple[int, int, int]) -> str | None:
        try:
            sha = await asyncio.to_thread(file_sha256, path)
        except OSError:
            return None
        self.known[path] = Known(path, *version, sha)
        if len(self.known) > KEEP:
            self.known.pop(next(iter(self.known)))
        try:
            tmp = self.file.with_suffix(".tmp")
            tmp.write_bytes(msgspec.json.encode(list(self.known.values())))
            tmp.replace(self.file)
        except OSError:
            pass  # kept in memory: computed again after a restart
        return sha


def _version(st: os.stat_result) -> tuple[int, int, int]:
    return st.st_size, st.st_mtime_ns, st.st_ino
