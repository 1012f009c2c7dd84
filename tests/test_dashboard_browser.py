"""The dashboard in a real browser: headless Chromium against `lanes up` serving the real Gemma model.

`lanes up` runs as a user runs it, with no --models folder, so it also shows the first run:
the demo model assembled from its PyPI packages, the gateway and dashboard lines, and a
chat request through the gateway. The page must show the lane healthy, then follow a
fleet-wide `lanes config set kv_cache_type=q8_0 flash_attn=on` to the new cache type and a
larger window within seconds, pushed over server-sent events, without a reload.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import urllib.request
from pathlib import Path

import pytest
from fixtures_bus import free_port_base
from playwright.async_api import async_playwright, expect

from launcher_agent.probe import probe
from planner_svc.planner import plan
from shared.gguf_facts import read_model_facts
from shared.messages.config import FleetConfig
from shared.messages.hosts import HostReport

LANES = [sys.executable, "-m", "lanes.cli"]
ROOT = Path(__file__).resolve().parent.parent
CHROMIUM_FLAGS = ["--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run", "--disable-sync",
                  "--disable-background-networking", "--disable-component-update"]  # fmt: skip
MIB = 2**20


def _chromium() -> str:
    found = shutil.which("chromium") or shutil.which("chromium-browser")
    if found is None:
        pytest.fail("no chromium: scripts/test installs Debian's chromium package")
    return found


def _window(fleet) -> int:
    (lane,) = fleet.hosts[0].lanes
    return lane.ctx_per_slot


def _memory_bound_ram(model: Path, binary: str) -> int:
    """A --max-ram where the f16 window is memory-bound, so q8_0 visibly buys a longer one."""
    facts = read_model_facts(model)
    caps = probe(binary)
    quantized = FleetConfig(kv_cache_type="q8_0", flash_attn="on")
    for ram in range(256 * MIB, 8192 * MIB, 16 * MIB):
        report = HostReport(host_id="local", cpu_cores=2, ram_total=ram, ram_available=ram, server=caps,
                            models=(facts,))  # fmt: skip
        f16 = plan([report], FleetConfig())
        if f16.hosts[0].lanes and _window(f16) >= 4096:
            q8 = plan([report], quantized)
            if _window(q8) > _window(f16) and _window(f16) < facts.n_ctx_train:
                return ram
    pytest.fail("no RAM size makes the Gemma window memory-bound")


class _Lines:
    """`lanes up`'s stdout, read on a thread so the test can wait for a line with a timeout."""

    def __init__(self, proc: subprocess.Popen) -> None:
        self.lines: list[str] = []
        self._cond = threading.Condition()
        threading.Thread(target=self._read, args=(proc,), daemon=True).start()

    def _read(self, proc: subprocess.Popen) -> None:
        for line in proc.stdout:
            with self._cond:
                self.lines.append(line.rstrip("\n"))
                self._cond.notify_all()
        with self._cond:
            self.lines.append("<eof>")
            self._cond.notify_all()

    def wait_for(self, pattern: str, timeout: float) -> re.Match:
        with self._cond:
            ok = self._cond.wait_for(lambda: any(re.search(pattern, l) for l in self.lines) or "<eof>" in self.lines,
                                     timeout)  # fmt: skip
            for line in self.lines:
                if match := re.search(pattern, line):
                    return match
        raise AssertionError(f"`lanes up` printed no line matching {pattern!r} ({ok=}): {self.lines}")


async def test_first_run_and_live_dashboard_in_chromium(tmp_path, gemma_model, llama_server):
    data = tmp_path / "data"
    # The first run assembles the demo model into its data folder; copying the verified file the
    # session already assembled (and its stamp) saves a second 250 MB write, the path is the same.
    (data / "models").mkdir(parents=True)
    for f in (gemma_model, gemma_model.with_name(gemma_model.name + ".verified")):
        shutil.copy2(f, data / "models" / f.name)
    max_ram = _memory_bound_ram(gemma_model, llama_server)
    up = subprocess.Popen(
        [*LANES, "up", "--data", str(data), "--llama-server", llama_server, "--nats-port", "0",
         "--gateway-port", "0", "--host-id", "local", "--max-ram", str(max_ram),
         "--port-base", str(free_port_base()), "--admin-key", "s3cret"],
        stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, cwd=tmp_path,
    )  # fmt: skip
    out = _Lines(up)
    try:
        demo = out.wait_for(r"serving the demo model (\S+)", 60).group(1)
        assert Path(demo) == data / "models" / gemma_model.name
        nats = out.wait_for(r"nats (nats://\S+)", 30).group(1)
        gateway = out.wait_for(r"^gateway: (http://\S+)$", 30).group(1)
        dashboard = out.wait_for(r"^dashboard: (http://\S+)$", 30).group(1)
        assert dashboard == f"{gateway}/dashboard/"
        curl = out.wait_for(r"try: (curl .*)$", 30).group(1)
        assert f"{gateway}/v1/completions" in curl and gemma_model.stem in curl  # a text completion: a pretrained model

        async with async_playwright() as pw:
            browser = await pw.chromium.launch(executable_path=_chromium(), args=CHROMIUM_FLAGS)
            page = await browser.new_page(viewport={"width": 1400, "height": 900})
            script_errors: list[str] = []
            page.on("pageerror", lambda exc: script_errors.append(str(exc)))
            await page.goto(dashboard)
            await page.evaluate("window.__lanesFirstLoad = true")  # gone if the page ever reloads
            row = page.locator("#lanes tbody tr")
            await expect(row).to_have_count(1, timeout=90_000)
            await expect(row.locator("td.state")).to_have_text("healthy", timeout=120_000)
            await expect(row.locator("td.cache")).to_have_text("f16/f16")
            await expect(page.locator("#config-revision")).to_have_text("revision 0")
            await expect(page.locator("#connection")).to_have_text("live")
            before = int((await row.locator("td.window").inner_text()).split(" x ")[0])

            # The copy-paste request `lanes up` printed works against the gateway.
            body = json.loads(curl.split("-d '", 1)[1].rstrip("'"))
            req = urllib.request.Request(f"{gateway}/v1/completions", data=json.dumps(
                {**body, "max_tokens": 8}).encode(), headers={"Content-Type": "application/json"})  # fmt: skip
            with urllib.request.urlopen(req, timeout=60) as resp:
                assert isinstance(json.load(resp)["choices"][0]["text"], str)  # an answer, whatever its words
            await expect(row.locator("td.rps")).not_to_have_text("0.00", timeout=15_000)  # the gateway counted it

            changed = subprocess.run([*LANES, "config", "set", "--nats", nats, "kv_cache_type=q8_0", "flash_attn=on"],
                                     capture_output=True, text=True, timeout=30)  # fmt: skip
            assert changed.returncode == 0, changed.stderr
            await expect(row.locator("td.cache")).to_have_text("q8_0/q8_0", timeout=10_000)
            await expect(row.locator("td.fa")).to_have_text("on", timeout=10_000)
            after = int((await row.locator("td.window").inner_text()).split(" x ")[0])
            assert after > before
            await expect(row.locator("td.state")).to_have_text("healthy", timeout=120_000)  # the new spec serves
            # The KV size llama-server printed for the new lane equals the plan's, on the page.
            await expect(row.locator("td.kv")).to_have_text(re.compile(r"^(\S+ MiB) / \1$"), timeout=10_000)
            # Revisions count changes, the same on the page, in `lanes status` and in its JSON.
            await expect(page.locator("#config-revision")).to_have_text("revision 1")
            table = subprocess.run([*LANES, "status", "--nats", nats], capture_output=True, text=True, timeout=30)
            assert "config r1:" in table.stdout, table.stdout
            status = json.loads(subprocess.run([*LANES, "status", "--nats", nats, "--json"], capture_output=True,
                                               text=True, timeout=30).stdout)  # fmt: skip
            assert status["config_revision"] == 1 and status["config"]["revision"] == 1
            (host_plan,) = status["plans"]
            assert host_plan["config_revision"] == 1 and host_plan["plan_revision"] == 2
            await expect(page.locator("#events li").first).to_be_visible()
            assert await page.evaluate("window.__lanesFirstLoad === true"), "the page reloaded"
            assert script_errors == []
            # Memory bar: planned parts drawn for the one CPU device.
            await expect(page.locator(".host .device")).to_have_count(1)
            assert await page.locator(".bar .kv").evaluate("e => parseFloat(e.style.width)") > 0

            shot = Path(os.environ.get("LANES_DASHBOARD_SCREENSHOT", tmp_path / "dashboard.png"))
            await page.screenshot(path=str(shot), full_page=True)
            assert shot.stat().st_size > 10_000

            # Read-only without the admin key; the key lets a change through the planner's validation.
            await expect(page.locator("#admin")).to_be_visible()
            await page.fill("#admin-key", "wrong")
            await page.fill("#admin-changes", "kv_cache_type=q9_0")
            await page.click("#admin button")
            await expect(page.locator("#admin-result")).to_have_text("admin key required")
            await page.fill("#admin-key", "s3cret")
            await page.click("#admin button")
            await expect(page.locator("#admin-result")).to_contain_text("q9_0")

            await browser.close()
        up.send_signal(signal.SIGINT)
        assert up.wait(60) == 0
    finally:
        if up.poll() is None:
            up.kill()
            up.wait(10)


async def test_with_api_keys_the_page_asks_once_and_streams_without_the_key_in_a_url():
    """A gateway with keys (no fleet behind it): the page asks for a key, a wrong one is refused,
    the right one opens the live page over a session cookie; no request URL carries the key."""
    from aiohttp.test_utils import TestServer

    from gateway.service import Gateway
    from gateway.settings import GatewaySettings

    key = "sk-browser-0123456789"
    gw = Gateway(GatewaySettings(port=0, api_keys=(key,)))
    server = TestServer(gw.app, host="127.0.0.1")
    await server.start_server()
    dashboard = str(server.make_url("/dashboard/"))
    try:
        async with async_playwright() as pw:
            browser = await pw.chromium.launch(executable_path=_chromium(), args=CHROMIUM_FLAGS)
            page = await browser.new_page()
            urls: list[str] = []
            page.on("request", lambda req: urls.append(req.url))
            script_errors: list[str] = []
            page.on("pageerror", lambda exc: script_errors.append(str(exc)))
            await page.goto(dashboard)
            await expect(page.locator("#login")).to_be_visible(timeout=30_000)
            await expect(page.locator("#main")).to_be_hidden()
            await page.fill("#api-key", "sk-wrong")
            await page.click("#login button")
            await expect(page.locator("#login-result")).to_have_text("key refused")
            await page.fill("#api-key", key)
            await page.click("#login button")
            await expect(page.locator("#main")).to_be_visible()
            await expect(page.locator("#connection")).to_have_text("live", timeout=30_000)  # the stream, by cookie
            # A reload asks nothing: the tab kept the key and trades it again.
            await page.reload()
            await expect(page.locator("#connection")).to_have_text("live", timeout=30_000)
            await expect(page.locator("#login")).to_have_count(0)
            await browser.close()
        assert any(u.endswith("/dashboard/api/stream") for u in urls), urls
        assert not [u for u in urls if key in u], urls
        assert not script_errors, script_errors
    finally:
        await server.close()

