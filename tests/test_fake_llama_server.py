"""The fake llama-server keeps the real binary's rules (tests/fake_llama_server.py)."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
sys.path.insert(0, str(Path(__file__).parent.parent))

from tinymodels import write_gemma3, write_llama  # noqa: E402

from shared.llama.flags import parse_caps  # noqa: E402
from shared.gguf_facts import read_model_facts  # noqa: E402
from shared.memory import MIB, kv_size  # noqa: E402

FAKE = Path(__file__).parent / "fake_llama_server.py"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run(*args: str, env: dict | None = None, timeout: float = 10) -> subprocess.CompletedProcess:
    full_env = {**os.environ, "FAKE_LLAMA_LOAD_SECONDS": "0", **(env or {})}
    return subprocess.run([sys.executable, str(FAKE), *args], capture_output=True, text=True,
                          env=full_env, timeout=timeout)


class Fake:
    """A running fake with its stderr collected by a thread."""

    def __init__(self, *args: str, env: dict | None = None):
        full_env = {**os.environ, "FAKE_LLAMA_LOAD_SECONDS": "0", **(env or {})}
        self.proc = subprocess.Popen([sys.executable, str(FAKE), *args], stderr=subprocess.PIPE, text=True,
                                     env=full_env)
        self.lines: list[str] = []
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.proc.stderr is not None
        for line in self.proc.stderr:
            self.lines.append(line.rstrip("\n"))

    @property
    def text(self) -> str:
        return "\n".join(self.lines)

    def wait_line(self, needle: str, timeout: float = 10) -> str:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for line in list(self.lines):
                if needle in line:
                    return line
            if self.proc.poll() is not None:
                self._reader.join(2)
                break
            time.sleep(0.02)
        for line in self.lines:
            if needle in line:
                return line
        raise AssertionError(f"no line with {needle!r} in:\n{self.text}")

    def wait(self, timeout: float = 10) -> int:
        rc = self.proc.wait(timeout)
        self._reader.join(2)
        return rc

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(5)


@pytest.fixture
def fakes():
    started: list[Fake] = []

    def start(*args: str, env: dict | None = None) -> Fake:
        fake = Fake(*args, env=env)
        started.append(fake)
        return fake

    yield start
    for fake in started:
        fake.stop()


def get(port: int, path: str) -> tuple[int, object]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=2) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def wait_healthy(port: int, timeout: float = 10) -> list[int]:
    """Poll /health until 200; returns every status seen."""
    seen: list[int] = []
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            status, _ = get(port, "/health")
            seen.append(status)
            if status == 200:
                return seen
        except (urllib.error.URLError, ConnectionError):
            pass
        time.sleep(0.02)
    raise AssertionError(f"not healthy; statuses seen: {seen}")


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, Path]:
    d = tmp_path_factory.mktemp("models")
    return {
        "llama": write_llama(d / "llama.gguf", n_layer=8, n_embd=512, n_head=8, n_head_kv=8, head_dim=64,
                             n_ctx_train=32768),
        "gemma3": write_gemma3(d / "gemma3.gguf"),
        "small": write_llama(d / "small.gguf"),
    }


# ---------------------------------------------------------------------------- flags


def test_help_and_version_new_build():
    help_run, version_run = run("--help"), run("--version")
    assert help_run.returncode == 0 and version_run.returncode == 0
    assert "-fa,   --flash-attn [on|off|auto]" in help_run.stdout
    assert "allowed values: f32, f16, bf16, q8_0, q4_0, q4_1, iq4_nl, q5_0, q5_1" in help_run.stdout
    assert "version: 11434 (deadbeef)" in version_run.stderr
    caps = parse_caps(help_run.stdout, version_run.stderr)
    assert (caps.build, caps.flash_attn_form, caps.has_fit, caps.has_kv_unified, caps.kv_layout) == (
        11434, "value", True, True, "streams")


def test_old_build_help_and_bare_switch():
    env = {"FAKE_LLAMA_HELP_OLD": "1", "FAKE_LLAMA_CACHE_TYPES": "f16,q8_0"}
    help_run = run("--help", env=env)
    assert help_run.returncode == 0
    assert "-fa,   --flash-attn                     enable Flash Attention (default: disabled)" in help_run.stdout
    caps = parse_caps(help_run.stdout)
    assert (caps.flash_attn_form, caps.has_fit, caps.has_kv_unified, caps.cache_types) == (
        "switch", False, False, ("f16", "q8_0"))
    refused = run("-fa", "on", "--port", "1", env=env)
    assert refused.returncode == 1
    assert "invalid argument: on" in refused.stderr


def test_bare_flash_attn_is_refused_by_a_new_build():
    result = run("--flash-attn", "--port", "1")
    assert result.returncode == 1
    assert "error: unknown value for --flash-attn: '--port'" in result.stderr
    last = run("--port", "1", "--flash-attn")
    assert last.returncode == 1
    assert "expected value for argument" in last.stderr


def test_unknown_flag_and_unsupported_cache_type():
    gone = run("--no-mmap")
    assert gone.returncode == 1 and "error: invalid argument: --no-mmap" in gone.stderr
    q6 = run("--cache-type-v", "q6_K")
    assert q6.returncode == 1 and "Unsupported cache type: q6_K" in q6.stderr
    lacking = run("-ctk", "q4_0", env={"FAKE_LLAMA_CACHE_TYPES": "f16,q8_0"})
    assert lacking.returncode == 1 and "Unsupported cache type: q4_0" in lacking.stderr


# ---------------------------------------------------------------------------- loading


def test_quantized_v_needs_flash_attention(models):
    port = str(free_port())
    off = run("-m", str(models["small"]), "--port", port, "-ctv", "q4_0", "--flash-attn", "off")
    assert off.returncode == 1
    assert "E llama_init_from_model: quantized V cache requires flash_attn to be enabled" in off.stderr
    assert f"failed to load model, '{models['small']}'" in off.stderr
    assert "exiting due to model loading error" in off.stderr


def test_bad_model_file_exits_1(tmp_path):
    junk = tmp_path / "junk.gguf"
    junk.write_bytes(b"not a gguf at all")
    result = run("-m", str(junk), "--port", str(free_port()))
    assert result.returncode == 1
    assert "llama_model_load: error loading model:" in result.stderr


def test_503_while_loading_then_200_and_sigterm(models, fakes):
    port = free_port()
    fake = fakes("-m", str(models["small"]), "--port", str(port), "-ctv", "q8_0", env={"FAKE_LLAMA_LOAD_SECONDS": "1"})
    seen = wait_healthy(port)
    assert 503 in seen and seen[-1] == 200
    fake.wait_line("enabling flash_attn since it is required for quantized V cache")
    fake.wait_line(f"main: server is listening on http://127.0.0.1:{port} - starting the main loop")
    fake.proc.send_signal(signal.SIGTERM)
    assert fake.wait(5) == 0
    assert "srv    operator(): operator(): cleaning up before exit..." in fake.text


def test_every_endpoint_503_while_loading(models, fakes):
    port = free_port()
    fakes("-m", str(models["small"]), "--port", str(port), env={"FAKE_LLAMA_LOAD_SECONDS": "2"})
    deadline = time.monotonic() + 5
    while True:
        try:
            status, body = get(port, "/props")
            break
        except (urllib.error.URLError, ConnectionError):
            assert time.monotonic() < deadline
            time.sleep(0.02)
    assert status == 503
    assert body == {"error": {"code": 503, "message": "Loading model", "type": "unavailable_error"}}


def test_props_slots_models_per_slot_context(models, fakes):
    port = free_port()
    fakes("-m", str(models["small"]), "--alias", "tiny", "--port", str(port), "--ctx-size", "1000",
          "--parallel", "3")
    wait_healthy(port)
    status, props = get(port, "/props")
    assert status == 200
    assert props["default_generation_settings"]["n_ctx"] == 512
    assert props["total_slots"] == 3
    assert props["model_alias"] == "tiny" and props["model_path"] == str(models["small"])
    assert props["build_info"] == "b11434-deadbeef" and props["is_sleeping"] is False
    _, slots = get(port, "/slots")
    assert [s["n_ctx"] for s in slots] == [512, 512, 512]
    _, listing = get(port, "/v1/models")
    meta = listing["data"][0]["meta"]
    facts = read_model_facts(models["small"])
    assert meta["n_ctx"] == 1536 and meta["n_ctx_train"] == 4096 and meta["size"] == facts.weight_bytes
    assert meta["n_params"] > 0
    assert get(port, "/nope")[0] == 404


def test_kv_line_llama_q8_0(models, fakes):
    port = free_port()
    fake = fakes("-m", str(models["llama"]), "--port", str(port), "--ctx-size", "32768", "--parallel", "1",
                 "-ctk", "q8_0", "-ctv", "q8_0", "--flash-attn", "on", "-fit", "off", "--verbosity", "4")
    line = fake.wait_line("llama_kv_cache: size =")
    assert line.endswith("llama_kv_cache: size =  272.00 MiB ( 32768 cells,   8 layers,  1/1 seqs), "
                         "K (q8_0):  136.00 MiB, V (q8_0):  136.00 MiB")
    fake.wait_line("srv    load_model: initializing, n_slots = 1, n_ctx_slot = 32768, kv_unified = 'false'")
    fake.wait_line("main: model loaded")


def test_kv_lines_sliding_window_sum_to_memory_model(models, fakes):
    port = free_port()
    fake = fakes("-m", str(models["gemma3"]), "--port", str(port), "-c", "8192", "-np", "2", "-lv", "4")
    fake.wait_line("main: model loaded")
    kv_lines = [line for line in fake.lines if "llama_kv_cache: size =" in line]
    assert len(kv_lines) == 2
    total = sum(float(line.split("size =")[1].split("MiB")[0]) for line in kv_lines)
    expected = kv_size(read_model_facts(models["gemma3"]), ctx=8192, parallel=2).total / MIB
    assert abs(total - expected) < 0.02
    assert "(  4096 cells,   1 layers,  2/2 seqs)" in kv_lines[0]
    assert "(  1024 cells,   5 layers,  2/2 seqs)" in kv_lines[1]


def test_no_kv_lines_below_verbosity_4(models, fakes):
    port = free_port()
    fake = fakes("-m", str(models["small"]), "--port", str(port), "-c", "4096")
    fake.wait_line("n_ctx_slot = 4096, kv_unified = 'true'")  # auto slots: 4, unified
    fake.wait_line("main: model loaded")
    assert "llama_kv_cache" not in fake.text


# ---------------------------------------------------------------------------- failures


def test_port_taken(models):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        result = run("-m", str(models["small"]), "--port", str(port))
    assert result.returncode == 1
    assert f"couldn't bind HTTP server socket, hostname: 127.0.0.1, port: {port}" in result.stderr


def test_simulated_oom_and_crash(models):
    oom = run("-m", str(models["small"]), "--port", str(free_port()), "-c", "8192",
              env={"FAKE_LLAMA_OOM_ABOVE_CTX": "4096"})
    assert oom.returncode == 1
    assert "failed to allocate buffer for kv cache" in oom.stderr
    crash = run("-m", str(models["small"]), "--port", str(free_port()), "-c", "2048",
                env={"FAKE_LLAMA_CRASH_AFTER": "0.1"})
    assert crash.returncode == 139
    assert "main: model loaded" in crash.stderr and "Segmentation fault" in crash.stderr


def test_reads_the_model_without_lanes_code(models):
    """The fake is a stand-in for an outside program: it loads a model (its facts read from the
    file by llama.cpp's gguf package, its figures from the recorded table) with every module of
    lanes unimportable."""
    port = free_port()
    blocked = "import runpy, sys\nfor name in ('shared', 'launcher_agent', 'planner_svc', 'lanes', 'gateway'):\n" \
              "    sys.modules[name] = None\nsys.argv = sys.argv[1:]\nrunpy.run_path(sys.argv[0], run_name='__main__')\n"
    args = [str(FAKE), "-m", str(models["gemma3"]), "--port", str(port), "-c", "8192", "-np", "2", "-lv", "4"]
    env = {**os.environ, "FAKE_LLAMA_LOAD_SECONDS": "0"}
    proc = subprocess.Popen([sys.executable, "-c", blocked, *args], stderr=subprocess.PIPE, text=True, env=env)
    lines = []
    try:
        assert proc.stderr is not None
        for line in proc.stderr:
            lines.append(line.rstrip("\n"))
            if "main: model loaded" in line or "exiting" in line:
                break
    finally:
        proc.terminate()
        proc.wait(10)
    text = "\n".join(lines)
    assert "main: model loaded" in text, text
    assert "(  4096 cells,   1 layers,  2/2 seqs)" in text and "print_info: arch             = gemma3" in text


def test_refuses_a_context_it_has_no_figures_for(models, fakes):
    """The same shape as a recorded one at another context: refused, not worked out from the record."""
    port = free_port()
    fake = fakes("-m", str(models["llama"]), "--port", str(port), "--ctx-size", "30720", "--parallel", "1",
                 "-ctk", "q8_0", "-ctv", "q8_0", "--flash-attn", "on", "-fit", "off", "--verbosity", "4",
                 env={"FAKE_LLAMA_RECORD_TO": ""})  # not recording (which serves the memory model's figures)
    assert fake.wait() == 1
    assert "no figures recorded from the real llama-server" in fake.text and "ctx=30720" in fake.text
    assert "llama_kv_cache: size =" not in fake.text
