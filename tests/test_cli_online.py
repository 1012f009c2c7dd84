"""`lanes up` as a user runs it: one command, then config set / status / explain, then Ctrl-C."""

from __future__ import annotations

import json
import re
import shlex
import shutil
import signal
import subprocess
import sys
import urllib.request

import psutil
from closed_pipe import run_into_closed_pipe
from fixtures_bus import fake_binary
from ops_helpers import kill_lanes_under
from waiting import eventually_blocking

LANES = [sys.executable, "-m", "lanes.cli"]


def _lanes(*args: str, timeout: float = 20) -> subprocess.CompletedProcess:
    return subprocess.run([*LANES, *args], capture_output=True, text=True, timeout=timeout)


def test_lanes_up_config_status_and_clean_stop(tmp_path, tiny_models):
    models = tmp_path / "models"
    models.mkdir()
    shutil.copy(tiny_models["llama8"], models / "llama8.gguf")
    binary = fake_binary(tmp_path / "bin")
    up = subprocess.Popen(
        [*LANES, "up", "--models", str(models), "--data", str(tmp_path / "data"), "--llama-server", binary,
         "--nats-port", "0", "--gateway-port", "0", "--host-id", "local", "--max-ram", "1GiB", "--port-base", "18400"],
        stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
    )  # fmt: skip
    try:
        first = up.stdout.readline()
        url = re.search(r"nats (nats://\S+)", first).group(1)

        def lane(state: str, needle: str | None = None):
            out = _lanes("status", "--nats", url, "--json")
            if out.returncode != 0:
                return None
            status = json.loads(out.stdout)
            for host in status["statuses"]:
                for lane in host["lanes"]:
                    if lane["state"] == state and (needle is None or needle in lane["argv"]):
                        return lane
            return None

        f16 = eventually_blocking(lambda: lane("healthy"), what="f16 lane healthy")
        # The printed first request is a text completion (what a pretrained model does well), and it answers.
        try_line = next(line for line in iter(up.stdout.readline, "") if line.startswith("  try: "))
        command = shlex.split(try_line.removeprefix("  try: "))
        assert command[:2] == ["curl", "-s"] and command[2].endswith("/v1/completions")
        body = json.loads(command[command.index("-d") + 1])
        assert body["model"] == "llama8" and body["prompt"] and "messages" not in body
        ask = urllib.request.Request(command[2], data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})  # fmt: skip
        with urllib.request.urlopen(ask, timeout=30) as answer:
            assert answer.status == 200 and json.loads(answer.read())  # the fake's text; the real one: test_gateway
        changed = _lanes("config", "set", "--nats", url, "kv_cache_type=q8_0", "flash_attn=on")
        assert changed.returncode == 0, changed.stderr
        assert json.loads(changed.stdout)["kv_cache_type"] == "q8_0"
        q8 = eventually_blocking(lambda: lane("healthy", "q8_0"), what="q8_0 lane healthy")
        assert q8["ctx_total"] > f16["ctx_total"]

        for args in (["status"], ["status", "--json"], ["config", "get"], ["explain", "local"]):  # `| head -1`
            gone = run_into_closed_pipe([*LANES, *args, "--nats", url])
            assert (gone.returncode, gone.stderr) == (141, ""), args
        table = _lanes("status", "--nats", url)
        assert table.returncode == 0 and "q8_0/q8_0" in table.stdout and "healthy" in table.stdout
        explain = _lanes("explain", "--nats", url, "local")
        assert "flash attention on" in explain.stdout
        bad = _lanes("config", "set", "--nats", url, "kv_cache_type=q9_0")
        assert bad.returncode == 2 and len(bad.stderr.strip().splitlines()) == 1 and "q9_0" in bad.stderr
        assert json.loads(_lanes("config", "get", "--nats", url).stdout)["kv_cache_type"] == "q8_0"
        children = psutil.Process(up.pid).children(recursive=True)
        assert any("fake_llama_server" in " ".join(c.cmdline()) for c in children)
        up.send_signal(signal.SIGINT)
        assert up.wait(30) == 0
        for child in children:
            assert not child.is_running() or child.status() == psutil.STATUS_ZOMBIE
    finally:
        if up.poll() is None:  # a failed check: stop it as Ctrl-C does, else kill it and what it left
            up.send_signal(signal.SIGINT)
            try:
                up.wait(30)
            except subprocess.TimeoutExpired:
                up.kill()
        kill_lanes_under(tmp_path)  # (none after a clean stop)


def _nats_servers_on(store: str) -> list[psutil.Process]:
    found = []
    for p in psutil.process_iter(["cmdline"]):
        cmd = p.info["cmdline"] or []
        if cmd and cmd[0].endswith("nats-server") and store in cmd:
            try:
                if p.status() != psutil.STATUS_ZOMBIE:
                    found.append(p)
            except psutil.Error:
                pass
    return found


def test_lanes_up_killed_with_sigkill_comes_back_on_its_folder_and_adopts_its_lane(tmp_path, tiny_models):
    from fixtures_bus import free_port_base

    models = tmp_path / "models"
    models.mkdir()
    shutil.copy(tiny_models["llama8"], models / "llama8.gguf")
    data = tmp_path / "data"
    store = str(data / "nats" / "jetstream")
    argv = [*LANES, "up", "--models", str(models), "--data", str(data), "--llama-server", fake_binary(tmp_path / "bin"),
            "--nats-port", "0", "--gateway-port", "0", "--host-id", "local", "--max-ram", "1GiB",
            "--port-base", str(free_port_base())]  # fmt: skip

    def start() -> tuple[subprocess.Popen, str]:
        up = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
        return up, re.search(r"nats (nats://\S+)", up.stdout.readline()).group(1)

    def healthy_lane(url: str):
        out = _lanes("status", "--nats", url, "--json")
        lanes = [lane for h in json.loads(out.stdout)["statuses"] for lane in h["lanes"]] if out.returncode == 0 else []
        return next((lane for lane in lanes if lane["state"] == "healthy"), None)

    up, url = start()
    try:
        lane = eventually_blocking(lambda: healthy_lane(url), what="the lane healthy")
        (nats,) = _nats_servers_on(store)
        up.kill()  # SIGKILL alone, as the OOM killer sends it
        up.wait(10)
        eventually_blocking(lambda: not _nats_servers_on(store), timeout=10, what="the nats-server to go with it")
        assert psutil.Process(lane["pid"]).is_running()  # the lane outlives it, for adoption
        assert not nats.is_running() or nats.status() == psutil.STATUS_ZOMBIE

        up, url = start()  # the same data folder: it comes up
        again = eventually_blocking(lambda: healthy_lane(url), what="the lane healthy after the restart")
        assert again["pid"] == lane["pid"]  # adopted, not started a second time
        assert len(_nats_servers_on(store)) == 1
        up.send_signal(signal.SIGINT)
        assert up.wait(30) == 0
        assert not _nats_servers_on(store)  # no orphan after a clean stop
        eventually_blocking(lambda: not psutil.pid_exists(lane["pid"])
                            or psutil.Process(lane["pid"]).status() == psutil.STATUS_ZOMBIE,
                            timeout=10, what="the adopted lane stopped with it")  # fmt: skip
    finally:
        if up.poll() is None:
            up.kill()
            up.wait(10)
        for p in _nats_servers_on(store):
            p.kill()
        kill_lanes_under(tmp_path)
