"""deploy/systemd's units booted under a real systemd: a Debian container with systemd as its init
(podman --systemd=always; the image from scripts/build-systemd-image, offline once its base is
cached), NATS as a unit beside them, deploy/systemd/install run as an operator runs it, and the
real Gemma file served through the gateway. Then what the units promise: `systemctl restart` of the
agent keeps its lane (same pid, adopted), `systemctl kill` of the agent (SIGKILL, the agent
alone) is followed by a restart that adopts the lane, `systemctl stop` stops the lane, and
`systemd-analyze verify` passes on the installed units.

Found by booting them: `SupplementaryGroups=video render` failed the agent's start (216/GROUP)
on a host without a render group; the groups now come from the lanes user.

Needs root, podman and (until ~/.cache/lanes/deploy holds the bases) debootstrap; skipped, with
the apt line, when one is missing (CI installs them: scripts/test). About a minute warm."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import urllib.request
from pathlib import Path

import pytest
from fixtures_bus import free_port_base
from waiting import eventually_blocking

ROOT = Path(__file__).resolve().parents[1]
NAME = "lanes-systemd-test"
APT = "apt-get install -y podman debootstrap catatonit"


def _env() -> dict:
    cache = Path(os.environ.get("LANES_CACHE_DIR", Path.home() / ".cache" / "lanes")) / "deploy"
    cache.mkdir(parents=True, exist_ok=True)
    conf = cache / "containers.conf"
    if "CONTAINERS_CONF" not in os.environ:  # podman's default ulimits cannot be set in some sandboxes
        conf.write_text("[containers]\ndefault_ulimits = []\n")
    return {**os.environ, "CONTAINERS_CONF": os.environ.get("CONTAINERS_CONF", str(conf))}


def _podman(*args: str, timeout: float = 120, check: bool = True) -> subprocess.CompletedProcess:
    done = subprocess.run(["podman", *args], capture_output=True, text=True, timeout=timeout, env=_env())
    if check and done.returncode != 0:
        raise AssertionError(f"podman {' '.join(args)}: {done.returncode}\n{done.stdout}\n{done.stderr}")
    return done


def _in(command: str, timeout: float = 120, check: bool = True) -> str:
    return _podman("exec", NAME, "sh", "-c", command, timeout=timeout, check=check).stdout.strip()


def _lane_pid() -> str:
    return _in("pgrep -x llama-server || true")


def _complete(url: str, key: str) -> dict:
    body = json.dumps({"model": "gemma", "prompt": "The three primary colors are", "max_tokens": 8}).encode()
    ask = urllib.request.Request(url + "/v1/completions", data=body,
                                 headers={"Content-Type": "application/json", "Authorization": f"Bearer {key}"})
    with urllib.request.urlopen(ask, timeout=60) as resp:
        assert resp.status == 200
        return json.loads(resp.read())


def _ready(url: str, key: str) -> bool:
    try:
        ask = urllib.request.Request(url + "/v1/models", headers={"Authorization": f"Bearer {key}"})
        with urllib.request.urlopen(ask, timeout=5) as resp:
            models = json.loads(resp.read())["data"]
    except OSError:
        return False
    return any(m["id"] == "gemma" and m["state"] == "ready" for m in models)


@pytest.fixture(scope="module")
def image() -> str:
    missing = [t for t in ("podman", "debootstrap") if shutil.which(t) is None]
    if os.geteuid() != 0 or missing:
        pytest.skip(f"booting the systemd units needs root and {missing or 'root'} ({APT})")
    done = subprocess.run(["bash", str(ROOT / "scripts" / "build-systemd-image")], capture_output=True, text=True,
                          timeout=1200, env=_env())  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    return "localhost/lanes-systemd:latest"


def test_the_units_boot_serve_and_keep_their_lane_across_an_agent_restart_and_kill(image, gemma_model, tmp_path):
    port = free_port_base(1)
    model = tmp_path / "gemma.gguf"
    shutil.copy(gemma_model, model)
    _podman("rm", "-f", NAME, check=False)
    _podman("run", "-d", "--name", NAME, "--systemd=always", "-p", f"127.0.0.1:{port}:8000",
            "-v", f"{model}:/srv/gemma.gguf:ro", image)  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    try:
        eventually_blocking(lambda: _in("systemctl is-system-running", check=False) in ("running", "degraded"),
                            timeout=60, what="systemd booted")  # fmt: skip
        assert _in("systemctl is-active nats") == "active"
        # As docs/systemd.md says: install, edit /etc/lanes/lanes.env (NATS), restart; the model in its folder.
        _in("/opt/lanes-deploy/systemd/install planner agent gateway", timeout=180)
        assert _in("stat -c '%U:%G %a' /etc/lanes/lanes.env /etc/lanes/gateway.env").split("\n") == ["root:lanes 640"] * 2
        # install made the gateway's key (it listens on 0.0.0.0: without one it would not start)
        key = _in("sed -n 's/^LANES_GATEWAY_API_KEYS=//p' /etc/lanes/gateway.env")
        assert key.startswith("sk-lanes-") and len(key) == 57, key
        _in("sed -i 's|^LANES_NATS_URL=.*|LANES_NATS_URL=nats://127.0.0.1:4222|' /etc/lanes/lanes.env"
            " && printf 'LLAMA_SERVER_BIN=/app/llama-server\\n' > /etc/lanes/agent.env"
            " && cp /srv/gemma.gguf /var/lib/lanes/models/gemma.gguf"
            " && systemctl restart lanes-planner lanes-agent lanes-gateway")
        assert _in("stat -c '%U:%G %a' /etc/lanes/lanes.env") == "root:lanes 640"
        assert _in("systemctl is-active lanes-planner lanes-agent lanes-gateway").split() == ["active"] * 3
        assert _in("systemctl show -p User --value lanes-agent") == "root"  # so its lanes run as lanes-lane
        try:
            eventually_blocking(lambda: _ready(url, key), timeout=180, what="gemma ready through the gateway")
        except AssertionError:
            journal = _in("journalctl -u lanes-planner -u lanes-agent -u lanes-gateway --no-pager | tail -60", check=False)
            raise AssertionError(f"gemma not ready through the gateway; the units' journal:\n{journal}") from None
        assert _complete(url, key)["choices"][0]["text"]
        lane = _lane_pid()
        assert lane and _in(f"ps -o user= -p {lane}") == "lanes-lane"
        # What a compromised lane would try, as its user: the agent's environment and the credentials file.
        agent = _in("systemctl show -p MainPID --value lanes-agent")
        for path in (f"/proc/{agent}/environ", "/etc/lanes/lanes.env", "/etc/lanes/gateway.env"):
            denied = _in(f"runuser -u lanes-lane -- cat {path} 2>&1; echo rc=$?", check=False)
            assert "Permission denied" in denied and not denied.endswith("rc=0"), (path, denied)

        _in("systemctl restart lanes-agent")  # SIGUSR1: the agent leaves its lane to the next one
        eventually_blocking(lambda: "adopted running lane" in _in("journalctl -u lanes-agent --no-pager"),
                            timeout=60, what="the restarted agent adopted the lane")  # fmt: skip
        assert _lane_pid() == lane
        assert _complete(url, key)["choices"][0]["text"]

        restarts = int(_in("systemctl show -p NRestarts --value lanes-agent"))
        _in("systemctl kill -s SIGKILL --kill-whom=main lanes-agent")  # as the OOM killer would
        eventually_blocking(lambda: int(_in("systemctl show -p NRestarts --value lanes-agent")) == restarts + 1
                            and _in("systemctl is-active lanes-agent", check=False) == "active",
                            timeout=60, what="the killed agent restarted by systemd")  # fmt: skip
        eventually_blocking(lambda: _in("journalctl -u lanes-agent --no-pager").count("adopted running lane") == 2,
                            timeout=60, what="the new agent adopted the lane")  # fmt: skip
        assert _lane_pid() == lane
        assert _complete(url, key)["choices"][0]["text"]

        _in("systemctl stop lanes-agent", timeout=150)  # a stop stops the lanes too
        assert _lane_pid() == ""
        assert _in("systemctl is-active lanes-agent", check=False) == "inactive"
        _in("systemd-analyze verify /etc/systemd/system/lanes-planner.service /etc/systemd/system/lanes-agent.service"
            " /etc/systemd/system/lanes-gateway.service /etc/systemd/system/nats.service")
    finally:
        _podman("rm", "-f", "-t", "5", NAME, check=False, timeout=60)
