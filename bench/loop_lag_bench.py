"""Event-loop lag of a service while it works: how late a 5 ms timer fires on its loop.

    .venv/bin/python bench/loop_lag_bench.py agent [--models 1000] [--rescans 5] [--json out.json]

agent: a real launcher agent (run_agent, no lanes) in this process, with a folder of N small
GGUF files (tests/tinymodels.py), answers its NATS `info` request after every file was touched,
so each answer is a full rescan (facts cache cold). A sampler task on the agent's own loop
records the lag the whole time; p50/p99/max are over the samples taken during the rescans.

A mode is one async function (argparse namespace, LagSampler) -> dict of figures, listed in
MODES; each starts what it measures in this process's loop and marks its measured windows
with `sampler.measuring()`.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

TICK = 0.005  # the sampler's sleep: lag is how much later than this it wakes


class LagSampler:
    """Samples the running loop's lag; only samples inside `measuring()` windows are kept."""

    def __init__(self) -> None:
        self.samples: list[float] = []
        self._on = False
        self._task: asyncio.Task | None = None

    async def _run(self) -> None:
        while True:
            t0 = time.perf_counter()
            await asyncio.sleep(TICK)
            if self._on:
                self.samples.append(max(0.0, time.perf_counter() - t0 - TICK))

    def start(self) -> None:
        self._task = asyncio.create_task(self._run())

    async def stop(self) -> None:
        if self._task:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

    @contextlib.contextmanager
    def measuring(self):
        self._on = True
        try:
            yield
        finally:
            self._on = False

    def figures(self) -> dict[str, float]:
        s = sorted(self.samples) or [0.0]
        pick = lambda q: s[min(len(s) - 1, int(q * len(s)))]  # noqa: E731
        return {"samples": len(self.samples), "p50_ms": round(pick(0.50) * 1e3, 2),
                "p99_ms": round(pick(0.99) * 1e3, 2), "max_ms": round(s[-1] * 1e3, 2)}  # fmt: skip


async def agent_mode(args: argparse.Namespace, sampler: LagSampler) -> dict:
    import msgspec
    import tinymodels

    from launcher_agent.config import AgentConfig
    from launcher_agent.service import run_agent
    from shared import subjects
    from shared.bus import connect, kv_bucket
    from shared.messages.hosts import HostReport, ServerCaps
    from shared.natsserver import NatsServer

    tmp = Path(tempfile.mkdtemp(prefix="loop-lag-"))
    server = NatsServer(tmp / "nats").start()
    stop = asyncio.Event()
    agent = None
    try:
        folder = tmp / "models"
        folder.mkdir()
        first = tinymodels.write_llama(folder / "m0000.gguf")
        for i in range(1, args.models):
            shutil.copyfile(first, folder / f"m{i:04d}.gguf")
        nc = await connect(server.url, name="loop-lag-bench")
        await kv_bucket(nc, create=True)  # the planner's part: the agent waits for the bucket
        cfg = AgentConfig(host_id="bench", model_dirs=[str(folder)], binary="llama-server", caps=ServerCaps(),
                          data_dir=tmp / "agent", dry_run=True, report_interval=3600.0)  # fmt: skip
        agent = asyncio.create_task(run_agent(cfg, server.url, stop))
        subject = subjects.agent_info(subjects.host_token("bench"))
        for _ in range(600):  # until the agent answers (its first report scans every file once)
            try:
                await nc.request(subject, b"", timeout=60)
                break
            except Exception:
                await asyncio.sleep(0.1)
        answers = []
        for _ in range(args.rescans):
            stamp = time.time() + len(answers) + 1
            for path in folder.iterdir():  # a new mtime: every file is read again
                os.utime(path, (stamp, stamp))
            t0 = time.perf_counter()
            with sampler.measuring():
                reply = await nc.request(subject, b"", timeout=120)
            answers.append(time.perf_counter() - t0)
            report = msgspec.json.decode(reply.data, type=HostReport)
            assert len(report.models) == args.models, len(report.models)
        await nc.close()
        return {"models": args.models, "rescans": args.rescans,
                "rescan_s_median": round(statistics.median(answers), 3)}  # fmt: skip
    finally:
        stop.set()
        if agent is not None:
            await asyncio.wait_for(agent, 30)
        server.stop()
        shutil.rmtree(tmp, ignore_errors=True)


MODES = {"agent": agent_mode}


async def run(args: argparse.Namespace) -> dict:
    sampler = LagSampler()
    sampler.start()
    try:
        figures = await MODES[args.mode](args, sampler)
    finally:
        await sampler.stop()
    return {"mode": args.mode, **figures, "loop_lag": sampler.figures()}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("mode", choices=sorted(MODES))
    ap.add_argument("--models", type=int, default=1000, help="agent: GGUF files in the scanned folder")
    ap.add_argument("--rescans", type=int, default=5, help="agent: full rescans measured")
    ap.add_argument("--json", help="also write the figures to this file")
    args = ap.parse_args()
    result = asyncio.run(run(args))
    print(json.dumps(result, indent=1))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
