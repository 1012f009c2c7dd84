"""deploy/systemd's units: `systemd-analyze verify` passes with no warning, each has the restart
policy, credentials file and hardening an operator expects, and the agent's stop logic keeps lanes
on a restart (SIGUSR1 alone) and stops them on a stop (SIGTERM, waiting for the agent's exit).
What the agent does on those signals: tests/test_agent_signals.py. Not run here: the units under
a real systemd (booting one in a container is too heavy for this suite)."""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import threading
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
UNITS = ROOT / "deploy" / "systemd"
NAMES = ["lanes-planner.service", "lanes-agent.service", "lanes-gateway.service"]


def _settings(name: str) -> dict[str, list[str]]:
    found: dict[str, list[str]] = {}
    for line in (UNITS / name).read_text().splitlines():
        if "=" in line and not line.startswith(("#", "[")):
            key, _, value = line.partition("=")
            found.setdefault(key, []).append(value)
    return found


def test_systemd_analyze_verify(tmp_path):
    analyze = shutil.which("systemd-analyze")
    if analyze is None:
        pytest.fail("no systemd-analyze: install Debian's systemd package")
    lanes = Path(sys.executable).parent / "lanes"  # the installed entry point stands in for /usr/local/bin/lanes
    for name in NAMES:
        (tmp_path / name).write_text((UNITS / name).read_text().replace("/usr/local/bin/lanes", str(lanes)))
    done = subprocess.run([analyze, "verify", "--man=no", *(str(tmp_path / n) for n in NAMES)],
                          capture_output=True, text=True, timeout=120, env={**os.environ, "SYSTEMD_LOG_LEVEL": "notice"})  # fmt: skip
    assert done.returncode == 0 and done.stderr.strip() == "", done.stderr


@pytest.mark.parametrize("name", NAMES)
def test_restart_credentials_and_hardening(name):
    s = _settings(name)
    assert s["Restart"] == ["on-failure"] and s["User"] == ["lanes"]
    assert "/etc/lanes/lanes.env" in s["EnvironmentFile"]
    for key, value in (("NoNewPrivileges", "yes"), ("ProtectSystem", "strict"), ("PrivateTmp", "yes")):
        assert s[key] == [value], key
    assert s["ExecStart"][0].startswith(f"/usr/local/bin/lanes {name.removeprefix('lanes-').removesuffix('.service')}")


def test_the_agent_keeps_lanes_on_restart_and_reaches_gpus():
    s = _settings("lanes-agent.service")
    assert s["KillMode"] == ["process"] and s["KillSignal"] == ["SIGUSR1"]
    assert "PrivateDevices" not in s and any(d.startswith("char-nvidia ") for d in s["DeviceAllow"])
    assert any(d.startswith("/dev/kfd ") for d in s["DeviceAllow"])  # ROCm


def _exec_stop(jobs: str, main_pid: str, tmp_path: Path) -> subprocess.CompletedProcess[str]:
    """The agent unit's ExecStop as systemd would run it ($$ -> $, %n -> the unit), with a
    `systemctl` that lists the given jobs."""
    line = _settings("lanes-agent.service")["ExecStop"][0]
    script = re.fullmatch(r"/bin/sh -c '(.*)'", line).group(1).replace("$$", "$").replace("%n", "lanes-agent.service")
    fake = tmp_path / "bin"
    fake.mkdir(exist_ok=True)
    (fake / "systemctl").write_text(f"#!/bin/sh\nprintf '%s\\n' '{jobs}'\n")
    (fake / "systemctl").chmod(0o755)
    env = {"PATH": f"{fake}:/usr/bin:/bin", "MAINPID": main_pid}
    return subprocess.run(["/bin/sh", "-c", script], env=env, capture_output=True, text=True, timeout=60)


def test_exec_stop_signals_the_agent_only_on_a_stop(tmp_path):
    agent = subprocess.Popen(["sleep", "600"])
    try:
        restart = _exec_stop("7 lanes-agent.service restart running", str(agent.pid), tmp_path)
        assert restart.returncode == 0 and agent.poll() is None  # left for KillSignal=SIGUSR1
        reaper = threading.Thread(target=agent.wait)  # systemd reaps the real agent; here this thread does
        reaper.start()
        other = _exec_stop("8 lanes-planner.service restart running", str(agent.pid), tmp_path)
        assert other.returncode == 0  # another unit's restart is a stop of this one: it waited for the exit
        reaper.join(30)
        assert agent.returncode == -signal.SIGTERM
    finally:
        if agent.poll() is None:
            agent.kill()
    assert _exec_stop("", "", tmp_path).returncode == 0  # the agent already gone (it crashed)
