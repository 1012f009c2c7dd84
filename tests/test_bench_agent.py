"""bench/agent_bench.py runs end to end (--small) and writes its report. No timing assertions."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from launcher_agent.probe import find_llama_server

ROOT = Path(__file__).resolve().parent.parent
HEADINGS = (
    "# Agent overhead and launch latency",
    "## Machine",
    "## Idle agent",
    "## Launch: by hand vs through lanes",
    "## Where the time goes",
    "## Rerun",
)


def test_agent_bench_small(tmp_path):
    if find_llama_server() is None:
        pytest.fail("no llama-server: run `lanes install-llama` (scripts/test does) or set LLAMA_SERVER_BIN")
    out = tmp_path / "r.md"
    run = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "agent_bench.py"), "--small", "--out", str(out)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-4000:]
    text = out.read_text()
    for heading in HEADINGS:
        assert heading in text.splitlines(), heading
    assert "| agent |" in text and "ratio lanes / by hand" in text
