"""The cyclic garbage collector paused while the planner plans.

A replan of a large fleet allocates hundreds of thousands of short-lived objects and no
cycles, yet each collection walks every tracked object: at 10,000 hosts about 7% of the
replan (bench/planner_bench.py). Paused only for the call; nested or concurrent calls (the
planning thread, `explain` on the event loop) keep it paused until the last one returns, and
it is re-enabled only if it was on before. Reference counting frees memory as usual meanwhile.
"""

from __future__ import annotations

import functools
import gc
import threading

_lock = threading.Lock()
_depth = 0
_was_enabled = False


def gc_paused(fn):
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        global _depth, _was_enabled
        with _lock:
            if _depth == 0:
                _was_enabled = gc.isenabled()
                gc.disable()
            _depth += 1
        try:
            return fn(*args, **kwargs)
        finally:
            with _lock:
                _depth -= 1
                if _depth == 0 and _was_enabled:
                    gc.enable()

    return wrapper
