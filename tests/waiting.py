"""The tests' one way to wait for something the system does on its own time.

`eventually(check)` polls until the check returns something truthy and returns it. A falsy
value, or an error on the way (the bus may be mid-restart, a port not yet open), means "not
yet". An AssertionError raised by the check means it saw a final wrong value (a lane that
failed for good, a process that exited): the wait fails at once instead of timing out.
`eventually_blocking` is the same for code outside an event loop (subprocess-driven tests).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Any


class _Wait:
    def __init__(self, timeout: float, what: str) -> None:
        self.deadline = time.monotonic() + timeout
        self.what = what
        self.last: Any = None

    def running(self) -> bool:
        return time.monotonic() < self.deadline

    def settled(self, value: Any) -> bool:
        self.last = value
        return bool(value) and not isinstance(value, Exception)

    def timed_out(self) -> AssertionError:
        return AssertionError(f"timed out waiting for {self.what}; last: {self.last!r}")


async def eventually(check: Callable, timeout: float = 30.0, interval: float = 0.2, what: str = "condition"):
    wait = _Wait(timeout, what)
    while wait.running():
        try:
            value = check()
            if asyncio.iscoroutine(value):
                value = await value
        except AssertionError:
            raise
        except Exception as exc:
            value = exc
        if wait.settled(value):
            return value
        await asyncio.sleep(interval)
    raise wait.timed_out()


def eventually_blocking(check: Callable, timeout: float = 30.0, interval: float = 0.2, what: str = "condition"):
    wait = _Wait(timeout, what)
    while wait.running():
        try:
            value = check()
        except AssertionError:
            raise
        except Exception as exc:
            value = exc
        if wait.settled(value):
            return value
        time.sleep(interval)
    raise wait.timed_out()
