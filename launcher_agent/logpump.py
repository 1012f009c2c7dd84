"""A lane's log writer: copies the lane's output (stdin) to its log file, rotated by size.

    python -I logpump.py LOG_PATH MAX_BYTES FILES

llama-server writes to its stdout and never reopens a log file, so it cannot be rotated from
outside without losing lines (copytruncate). Instead its output goes through a pipe to this
small process, started beside it in its own session (like Apache's rotatelogs): it survives
the agent, so a lane keeps its log across an agent restart and is adopted with it, and exits
when the lane does (end of input). The file is opened for append; at MAX_BYTES (at a line's
end) it becomes LOG_PATH.1, the older ones shift up, and at most FILES files are kept.

Standard library only, run by path (not as a package module): nothing of the agent's
environment is needed to start it.
"""

from __future__ import annotations

import os
import signal
import sys

CHUNK = 64 * 1024


def rotate(path: str, files: int) -> None:
    """LOG_PATH -> .1 -> .2 ...; the oldest beyond FILES is removed."""
    if files <= 1:
        os.truncate(path, 0)
        return
    for i in range(files - 1, 0, -1):
        src = path if i == 1 else f"{path}.{i - 1}"
        try:
            os.replace(src, f"{path}.{i}")
        except FileNotFoundError:
            pass


def _open(path: str) -> int:
    return os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o640)


def _write(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]


def pump(source: int, path: str, max_bytes: int, files: int) -> None:
    fd = _open(path)
    size = os.fstat(fd).st_size
    while True:
        try:
            chunk = os.read(source, CHUNK)
        except InterruptedError:
            continue
        if not chunk:
            break
        _write(fd, chunk)
        size += len(chunk)
        # Rotate at a line's end, so a reader never sees a line split between two files
        # (one line longer than a whole file is cut all the same).
        if size >= max_bytes and (chunk.endswith(b"\n") or size >= 2 * max_bytes):
            os.close(fd)
            rotate(path, files)
            fd = _open(path)
            size = 0
    os.close(fd)


def main(argv: list[str]) -> int:
    # The agent's terminal (Ctrl-C) and its session ending must not stop a lane's log.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGHUP, signal.SIG_IGN)
    path, max_bytes, files = argv[1], int(argv[2]), int(argv[3])
    pump(sys.stdin.fileno(), path, max_bytes, files)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
