"""A lane's log writer: copies the lane's output (stdin) to its log file, rotated by size.

    python -I logpump.py LOG_PATH MAX_BYTES FILES [QUIET_AFTER]

llama-server writes to its stdout and never reopens a log file, so it cannot be rotated from
outside without losing lines (copytruncate). Instead its output goes through a pipe to this
small process, started beside it in its own session (like Apache's rotatelogs): it survives
the agent, so a lane keeps its log across an agent restart and is adopted with it, and exits
when the lane does (end of input). The file is opened for append; at MAX_BYTES (at a line's
end) it becomes LOG_PATH.1, the older ones shift up, and at most FILES files are kept.

QUIET_AFTER (a regular expression): once a line matches it (the model is loaded), debug lines
are dropped with the unprefixed lines that continue them. Lanes run at verbosity 4 for the
KV size and buffer lines printed while loading; llama.cpp builds whose debug lines print each
request's prompt (`D formatted_chat: ...`, `D prompt token ...`, request bodies) must not put
it on disk (build 11434 prints none of these, even with -v). A crash report that follows a
debug line is kept.

Standard library only, run by path (not as a package module): nothing of the agent's
environment is needed to start it.
"""

from __future__ import annotations

import os
import re
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


class Writer:
    """The log file, appended to and rotated. A failing disk (full, gone) loses lines, never the
    lane: input is read on regardless (a writer that died would kill the lane with SIGPIPE)."""

    def __init__(self, path: str, max_bytes: int, files: int) -> None:
        self.path, self.max_bytes, self.files = path, max_bytes, files
        self.fd: int | None = None
        self.size = 0

    def write(self, data: bytes) -> None:
        try:
            if self.fd is None:
                self.fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o640)
                self.size = os.fstat(self.fd).st_size
            view = memoryview(data)
            while view:
                view = view[os.write(self.fd, view) :]
            self.size += len(data)
            if self.size >= self.max_bytes:  # whole lines only: no line is split between two files
                self.close()
                rotate(self.path, self.files)
                self.write(b"")  # LOG_PATH exists again at once, even when no line follows
        except OSError:
            self.close()

    def close(self) -> None:
        if self.fd is not None:
            try:
                os.close(self.fd)
            except OSError:
                pass
            self.fd = None


# llama.cpp's common log prefix: `M.SS.mmm.uuu L ` (L: I, W, E or D); a line without it continues the last.
_PREFIXED = re.compile(rb"^\d+\.\d{2}\.\d{3}\.\d{3} ([A-Z]) ")
_CRASH = re.compile(rb"GGML_ASSERT|GGML_ABORT|^terminate called|CUDA error|std::bad_alloc")


class Quiet:
    """Which lines to keep: all, until a line matches `after`; then all but debug ones."""

    def __init__(self, after: str | None) -> None:
        self.after = re.compile(after.encode()) if after else None
        self.quiet = False
        self.dropping = False  # the last prefixed line was a dropped debug line

    def keep(self, line: bytes) -> bool:
        if self.after is None:
            return True
        prefixed = _PREFIXED.match(line)
        if prefixed:
            self.dropping = self.quiet and prefixed.group(1) == b"D"
        elif self.dropping and _CRASH.search(line):
            return True
        if not self.quiet and self.after.search(line):
            self.quiet = True
        return not self.dropping


def pump(source: int, path: str, max_bytes: int, files: int, quiet_after: str | None = None) -> None:
    out = Writer(path, max_bytes, files)
    out.write(b"")  # the file exists from the start
    lines = Quiet(quiet_after)
    partial = b""
    while True:
        try:
            chunk = os.read(source, CHUNK)
        except InterruptedError:
            continue
        parts = (partial + chunk).split(b"\n")
        partial = parts.pop() if chunk else b""
        if len(partial) > CHUNK:  # one line longer than this is taken as it is
            parts.append(partial)
            partial = b""
        if not chunk and not parts[-1]:
            parts.pop()  # the input ended with a line's end
        kept = b"".join(line + b"\n" for line in parts if lines.keep(line))
        if kept:
            out.write(kept)
        if not chunk:
            break
    out.close()


def main(argv: list[str]) -> int:
    # The agent's terminal (Ctrl-C) and its session ending must not stop a lane's log.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGHUP, signal.SIG_IGN)
    path, max_bytes, files = argv[1], int(argv[2]), int(argv[3])
    pump(sys.stdin.fileno(), path, max_bytes, files, argv[4] if len(argv) > 4 else None)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
