"""Services as real processes, for the tests that kill -9 them."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import msgspec
import psutil

from shared import subjects
from shared.bus import kv_bucket, read_all
from shared.messages.activity import PlannerLease
from shared.messages.plans import HostPlan

REPO = Path(__file__).resolve().parent.parent


class Procs:
    """`lanes ...` commands started as processes, with their output in files; all killed at the end."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        folder.mkdir(parents=True, exist_ok=True)
        self.procs: dict[str, subprocess.Popen] = {}

    def start(self, name: str, *args: str) -> subprocess.Popen:
        out = open(self.folder / f"{name}.log", "ab")
        proc = subprocess.Popen([sys.executable, "-m", "lanes.cli", *args], cwd=REPO, stdout=out, stderr=out,
                                stdin=subprocess.DEVNULL)  # fmt: skip
        out.close()
        self.procs[name] = proc
        return proc

    def kill9(self, name: str) -> None:
        proc = self.procs.pop(name)
        proc.send_signal(signal.SIGKILL)
        proc.wait(10)

    def log(self, name: str) -> str:
        return (self.folder / f"{name}.log").read_text(errors="replace")

    def close(self) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.terminate()
        for proc in self.procs.values():
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()


def kill_lanes_under(folder: Path) -> None:
    """Lanes a kill -9'd agent left running (they outlive it by design)."""
    for p in psutil.process_iter(["cmdline"]):
        cmd = p.info["cmdline"] or []
        if any("fake_llama_server" in c for c in cmd) and any(str(folder) in c for c in cmd):
            try:
                os.kill(p.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


async def lease_holder(nc) -> str | None:
    kv = await kv_bucket(nc)
    try:
        entry = await kv.get(subjects.LEASE_KEY)
    except Exception:
        return None
    return msgspec.json.decode(entry.value, type=PlannerLease).holder if entry.value else None


async def plans(nc) -> dict[str, HostPlan]:
    """Every host's plan, read by one watch to its end (kv.keys() can end at nats-py's early caught-up
    marker with no key at all on a loaded machine: NoKeysError in CI)."""
    values = await read_all(await kv_bucket(nc), "plan.>")
    return {key.removeprefix("plan."): msgspec.json.decode(value, type=HostPlan) for key, value in values.items()}
