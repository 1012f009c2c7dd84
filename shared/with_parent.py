"""Run a command that must not outlive its parent: `python -I with_parent.py PARENT_PID ARGV...`.

Linux only: it asks the kernel for SIGTERM when the process that started it dies
(prctl PR_SET_PDEATHSIG, which an exec keeps), checks that parent is still there (it may have
died before the request), then becomes the command (same pid). `lanes up` starts its
embedded nats-server through it: killed with SIGKILL (the OOM killer), `lanes up` leaves no
nats-server holding its port and store. Standard library only, run by its path.

The signal follows the *thread* that started the child: start it from a thread that lives as
long as the parent (the main thread, or a pool thread kept until shutdown).
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys

PR_SET_PDEATHSIG = 1


def main(argv: list[str]) -> int:
    parent, command = int(argv[1]), argv[2:]
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0) != 0:
        return 125
    if os.getppid() != parent:  # it died before the request: nothing to serve
        return 0
    os.execv(command[0], command)


if __name__ == "__main__":
    sys.exit(main(sys.argv))
