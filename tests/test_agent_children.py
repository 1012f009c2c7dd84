"""What an agent's children get and leave behind: an allow-listed environment, and logs that are
bounded (rotated by size, adopted from their tail) and hold no prompt.

Fast tier: the allow-list, the log writer (launcher_agent/logpump.py) as a process, the reader
following a rotation, adoption, and a planner + agent + fake llama-server over real NATS. The
real binaries (llama-server, ggml-rpc-server; slow by their fixtures) show the environment of
what actually runs, and `lanes up` with the real llama-server shows no prompt on disk.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import subprocess
import sys
import urllib.error
import urllib.request
import uuid
from pathlib import Path

import msgspec
import psutil
import pytest
from fixtures_bus import agent_config, client, fake_binary, free_port_base, healthy_lane, host_status, lane_of, services
from waiting import eventually, eventually_blocking

from launcher_agent.child_env import allowed, child_environment
from launcher_agent.logpump import CHUNK
from launcher_agent.process import TAIL_BYTES, LaneProcess, LogLimits, pump_argv
from shared.llama.logs import LOADED_FOR_GOOD
from shared.messages.config import FleetConfig
from shared.messages.plans import HostPlan, LaneSpec

SECRET = "LANES_TEST_SECRET_TOKEN"
NAMED = "MY_LANE_SETTING"
MIB = 2**20


def _environ(pid: int) -> dict[str, str]:
    raw = Path(f"/proc/{pid}/environ").read_bytes()
    return dict(item.split("=", 1) for item in raw.decode(errors="replace").split("\0") if "=" in item)


# ------------------------------------------------------------------ the allow-list


def test_children_get_the_runtime_variables_and_what_the_operator_names_only():
    env = {
        "PATH": "/usr/bin", "HOME": "/home/x", "LANG": "C.UTF-8", "LC_ALL": "C", "TZ": "UTC", "TMPDIR": "/tmp",
        "LD_LIBRARY_PATH": "/opt/lib", "CUDA_VISIBLE_DEVICES": "0", "CUDA_DEVICE_ORDER": "PCI_BUS_ID",
        "HIP_VISIBLE_DEVICES": "1", "ROCR_VISIBLE_DEVICES": "1", "HSA_OVERRIDE_GFX_VERSION": "10.3.0",
        "GGML_VK_VISIBLE_DEVICES": "0", "VK_ICD_FILENAMES": "/x.json", "ONEAPI_DEVICE_SELECTOR": "level_zero:0",
        "SYCL_CACHE_PERSISTENT": "1", "ZE_AFFINITY_MASK": "0", "GGML_METAL_PATH_RESOURCES": "/m",
        # never
        "LANES_GATEWAY_API_KEYS": "k1", "LANES_NATS_PASSWORD": "pw", "LLAMA_ARG_HOST": "0.0.0.0",
        "AWS_SECRET_ACCESS_KEY": "s", "HF_TOKEN": "hf", "NATS_URL": "nats://x", "OPENAI_API_KEY": "o",
        "CUDA_TOKEN": "looks like a credential", "GGML_API_KEY": "so does this", NAMED: "v",
    }  # fmt: skip
    out = child_environment(env)
    never = {"LANES_GATEWAY_API_KEYS", "LANES_NATS_PASSWORD", "LLAMA_ARG_HOST", "AWS_SECRET_ACCESS_KEY", "HF_TOKEN",
             "NATS_URL", "OPENAI_API_KEY", "CUDA_TOKEN", "GGML_API_KEY", NAMED}  # fmt: skip
    assert set(out) == set(env) - never
    named = child_environment(env, [NAMED, "HF_TOKEN", "LANES_NATS_PASSWORD", "LLAMA_ARG_HOST"])
    assert set(named) == set(out) | {NAMED, "HF_TOKEN"}  # LANES_* and LLAMA_ARG_* not even when named
    assert not allowed("LANES_X", ["LANES_X"]) and allowed("HF_TOKEN", ["HF_TOKEN"])


def test_lane_env_refuses_the_agents_own_variables():
    from lanes.cli import build_parser

    args = build_parser().parse_args(["agent", "--lane-env", "HF_HOME", "--lane-env", "X1"])
    assert args.lane_env == ["HF_HOME", "X1"]
    for bad in ("LANES_NATS_PASSWORD", "LLAMA_ARG_PORT", "A=B", "1X"):
        out = subprocess.run([sys.executable, "-m", "lanes.cli", "agent", "--lane-env", bad], capture_output=True,
                             text=True, timeout=30)  # fmt: skip
        assert out.returncode == 2 and "--lane-env" in out.stderr, (bad, out.stderr)


# ------------------------------------------------------------------ the log writer


def _pump(tmp: Path, data: bytes, max_bytes: int, files: int, quiet_after: str | None = None) -> Path:
    log = tmp / "lane.log"
    out = subprocess.run(pump_argv(log, LogLimits(max_bytes, files), quiet_after), input=data, timeout=60)
    assert out.returncode == 0
    return log


def test_the_log_rotates_by_size_keeps_its_files_and_splits_no_line(tmp_path):
    lines = [f"line {i:06d} {'x' * (i % 50)}" for i in range(20000)]
    log = _pump(tmp_path, "".join(f"{line}\n" for line in lines).encode(), 64 * 1024, 3)
    files = sorted(tmp_path.glob("lane.log*"))
    assert [f.name for f in files] == ["lane.log", "lane.log.1", "lane.log.2"]
    longest = max(len(line) + 1 for line in lines)
    for f in files:  # at most one write past the limit: one read (CHUNK) and the line it completes
        assert f.stat().st_size < 64 * 1024 + CHUNK + longest
    kept = (log.with_name("lane.log.2").read_text() + log.with_name("lane.log.1").read_text() + log.read_text())
    kept_lines = kept.splitlines()
    assert kept.endswith("\n") and kept_lines == lines[-len(kept_lines) :]  # the newest, whole and in order
    assert len(kept_lines) < len(lines)
    # appended, not truncated: a second run adds to the current file (with room in it: how full the
    # first run left it depends on how the pipe's reads fell, and a write that fills it rotates it)
    before = log.stat().st_size
    _pump(tmp_path, b"one more\n", 1 << 20, 3)
    assert log.stat().st_size == before + len(b"one more\n")


def test_the_log_file_exists_again_at_once_after_a_rotation(tmp_path):
    """Input that fills the file exactly at its end rotates it with no line after: the lane's log
    path is there all the same (empty), for the agent's reader and for the next append."""
    log = _pump(tmp_path, b"".join(b"line %04d\n" % i for i in range(10)), 100, 3)
    assert log.exists() and log.stat().st_size == 0
    assert log.with_name("lane.log.1").read_bytes().endswith(b"line 0009\n")


def test_a_log_that_cannot_be_written_loses_lines_never_the_lane(tmp_path):
    """The writer reads its input to the end all the same: a lane never meets a closed pipe."""
    gone = tmp_path / "gone" / "lane.log"
    out = subprocess.run(pump_argv(gone, LogLimits()), input=b"x" * 10 * MIB, timeout=60)
    assert out.returncode == 0 and not gone.exists()
    one = tmp_path / "one.log"  # one file kept: it starts over at the limit
    assert subprocess.run(pump_argv(one, LogLimits(64 * 1024, 1)), input=b"line\n" * 40000, timeout=60).returncode == 0
    assert one.stat().st_size < 64 * 1024 and not one.with_name("one.log.1").exists()


def test_after_the_model_loaded_no_debug_line_is_written_but_a_crash_report_is(tmp_path):
    stamp = "0.00.100.000"
    text = "\n".join([
        f"{stamp} D llama_kv_cache: size = 8.00 MiB",  # a load-time debug line: kept
        f"{stamp} I main: model loaded",
        f"{stamp} I srv  log_server_r: request: POST /v1/chat/completions 127.0.0.1 200",
        f"{stamp} D srv  params_from_: formatted_chat: '<|user|>",
        "SECRET-PROMPT continues here",
        "'",
        f"{stamp} D slot update_slots: id  0 | task 0 | prompt token   1:   1234 'SECRET-PROMPT'",
        "/src/ggml.c:123: GGML_ASSERT(x) failed",
        f"{stamp} I slot      release: id  0 | task 0 | stop processing",
        "a continuation of an info line",
    ]) + "\n"  # fmt: skip
    log = _pump(tmp_path, text.encode(), 16 * MIB, 3, LOADED_FOR_GOOD)
    written = log.read_text()
    assert "SECRET-PROMPT" not in written
    assert written.splitlines() == [
        f"{stamp} D llama_kv_cache: size = 8.00 MiB", f"{stamp} I main: model loaded",
        f"{stamp} I srv  log_server_r: request: POST /v1/chat/completions 127.0.0.1 200",
        "/src/ggml.c:123: GGML_ASSERT(x) failed",
        f"{stamp} I slot      release: id  0 | task 0 | stop processing", "a continuation of an info line",
    ]  # fmt: skip
    assert "SECRET-PROMPT" in _pump(tmp_path / "..", text.encode(), 16 * MIB, 3).read_text()  # unfiltered: there


def _spec(**kw) -> LaneSpec:
    return LaneSpec(lane_id="m-0", model="m", model_path="/m.gguf", alias="m", port=1, ctx_total=512, ctx_per_slot=512,
                    parallel=1, **kw)  # fmt: skip


def test_the_reader_follows_a_rotation_and_starts_at_this_runs_lines(tmp_path):
    log = tmp_path / "lane.log"
    log.write_text("an older run's line: failed to allocate\n")
    spec = _spec()
    lane = LaneProcess(spec, "llama-server", log, ())
    lane._follow(tail=0)  # as start() does: the file's earlier runs are not this one's
    with open(log, "ab") as f:
        f.write(b"first\nsecond, half")
    lane.read_log()
    assert list(lane.tail) == ["first"]
    with open(log, "ab") as f:
        f.write(b" done\n")
    lane.read_log()
    assert list(lane.tail) == ["first", "second, half done"]
    # the writer rotates: the rest of the old file is read, then the new one from its start
    with open(log, "ab") as f:
        f.write(b"last of the old file\n")
    os.replace(log, log.with_name("lane.log.1"))
    log.write_text("first of the new file\n")
    lane.tail.clear()
    for _ in range(3):
        lane.read_log()
    assert list(lane.tail) == ["last of the old file", "first of the new file"]


def test_an_adopted_lane_reads_its_log_from_the_tail_and_its_load_facts_from_the_state_file(tmp_path):
    spec = _spec()
    args = ("--port", "1")
    kv = ("llama_kv_cache: size =    8.00 MiB (  4096 cells,   8 layers,  1/1 seqs),"
          " K (f16):    4.00 MiB, V (f16):    4.00 MiB")
    log = tmp_path / "lane.log"
    with open(log, "w") as f:
        f.write(kv + "\n")  # far before the tail: never read again
        f.write("filler line\n" * (4 * TAIL_BYTES // 12))
        f.write("the last line\n")
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)", *args])
    try:
        eventually_blocking(lambda: psutil.Process(proc.pid).cmdline()[-2:] == list(args), timeout=10,
                            what="the child's exec")  # fmt: skip
        bare = LaneProcess.adopt(spec, args, "llama-server", log, proc.pid)
        assert bare.tail[-1] == "the last line" and bare.kv_bytes() is None  # the KV line is not in the tail
        assert bare._log.tell() <= log.stat().st_size and log.stat().st_size - TAIL_BYTES <= bare._log.tell() - 1
        adopted = LaneProcess.adopt(spec, args, "llama-server", log, proc.pid, facts=[kv])
        assert adopted.kv_bytes() == 8 * MIB and adopted.facts() == [kv]
    finally:
        proc.kill()
        proc.wait()


BUILD = "0.00.003.239 I cmn  common_param: common_params_print_info: build 0 (unknown) with GNU 12.2.0 for Linux x86_64"
SWA_KV = (  # Gemma 3 270M on b11434: a sliding-window model prints two KV caches
    "0.01.346.382 I llama_kv_cache: size =   24.00 MiB (  4096 cells,   3 layers,  2/2 seqs), K (f16):   12.00 MiB, V (f16):   12.00 MiB",
    "0.01.380.185 I llama_kv_cache: size =   30.00 MiB (  1024 cells,  15 layers,  2/2 seqs), K (f16):   15.00 MiB, V (f16):   15.00 MiB",
)


def _adopt_with_log(tmp_path, lines: list[str], facts: list[str]) -> LaneProcess:
    log = tmp_path / "lane.log"
    log.write_text("".join(f"{line}\n" for line in lines))
    args = ("--port", "2")
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)", *args])
    try:
        eventually_blocking(lambda: psutil.Process(proc.pid).cmdline()[-2:] == list(args), timeout=10,
                            what="the child's exec")  # fmt: skip
        return LaneProcess.adopt(_spec(), args, "llama-server", log, proc.pid, facts=facts)
    finally:
        proc.kill()
        proc.wait()


def test_a_young_lane_adopted_counts_its_kv_once(tmp_path):
    """Its whole log is in the tail, the same lines as the facts the last agent saved: the KV is
    what it printed, once (it was read twice: 'lane uses more than planned', exactly twice the plan,
    and every lane restarted after `lanes up` was killed and started again)."""
    run = [BUILD, "llama_model_loader: loaded meta data", *SWA_KV, "main: model loaded", "srv  update_slots: idle"]
    adopted = _adopt_with_log(tmp_path, run, facts=list(SWA_KV))
    assert adopted.kv_bytes() == 54 * MIB and adopted.facts() == list(SWA_KV)
    assert adopted.tail[-1] == "srv  update_slots: idle"
    partial = _adopt_with_log(tmp_path, run[2:], facts=list(SWA_KV))  # the tail starts after the run's start
    assert partial.kv_bytes() == 54 * MIB


def test_a_lane_log_holding_earlier_runs_counts_the_last_run_only(tmp_path):
    older = "llama_kv_cache: size =  512.00 MiB ( 32768 cells,   8 layers,  1/1 seqs), K (f16):  256.00 MiB, V (f16):  256.00 MiB"
    log = [BUILD, older, "main: model loaded", "received SIGTERM", BUILD, *SWA_KV, "main: model loaded"]
    assert _adopt_with_log(tmp_path, log, facts=[]).kv_bytes() == 54 * MIB  # no facts saved: read off the tail
    assert _adopt_with_log(tmp_path, log, facts=list(SWA_KV)).kv_bytes() == 54 * MIB
    lane = LaneProcess(_spec(), "llama-server", tmp_path / "x.log", ())
    lane._take_lines(log)
    assert lane.kv_bytes() == 54 * MIB


# ------------------------------------------------------------------ an agent's lanes (fake llama-server)


def _kill_under(folder: Path) -> None:
    """What a failed run left: any process whose command line names a path under `folder`."""
    for p in psutil.process_iter(["cmdline"]):
        if p.pid != os.getpid() and any(str(folder) in c for c in p.info["cmdline"] or []):
            try:
                p.kill()
            except psutil.Error:
                pass


def _all_files(root: Path, skip: Path) -> list[Path]:
    return [p for p in root.rglob("*") if p.is_file() and skip not in p.parents]


def _chat(url: str, marker: str, model: str, timeout: float = 120, key: str | None = None) -> dict:
    body = json.dumps({"model": model, "max_tokens": 4, "messages": [{"role": "user", "content": f"Say {marker}."}]})
    auth = {"Authorization": f"Bearer {key}"} if key else {}
    req = urllib.request.Request(f"{url}/v1/chat/completions", data=body.encode(),
                                 headers={"Content-Type": "application/json", **auth})  # fmt: skip
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return json.loads(r.read())


async def test_lanes_get_no_secret_and_their_logs_no_prompt(nats_server, tmp_path, models, monkeypatch):
    monkeypatch.setenv(SECRET, "s3cr3t")
    monkeypatch.setenv("LANES_GATEWAY_API_KEYS", "k1")
    monkeypatch.setenv(NAMED, "given")
    cfg = agent_config(tmp_path, "alpha", models, fake_binary(tmp_path / "bin"), max_ram=2**30, lane_env=(NAMED,))
    marker = f"marker-{uuid.uuid4().hex}"
    async with services(nats_server.url) as s, client(nats_server.url) as nc:
        s.start_planner()
        s.start_agent(cfg)

        async def healthy():
            lane = lane_of(await host_status(nc, "alpha"), "llama8-0")
            return lane if lane and lane.state == "healthy" else None

        lane = await eventually(healthy, what="the lane healthy")
        env = _environ(lane.pid)
        assert SECRET not in env and "LANES_GATEWAY_API_KEYS" not in env and "s3cr3t" not in Path(
            f"/proc/{lane.pid}/environ").read_text(errors="replace")  # fmt: skip
        assert env[NAMED] == "given" and env["PATH"] == os.environ["PATH"]
        # The lane answers its key only (the agent's, which gateways read from NATS).
        with pytest.raises(urllib.error.HTTPError) as refused:
            await asyncio.to_thread(_chat, f"http://127.0.0.1:{lane.port}", marker, "llama8")
        assert refused.value.code == 401
        key = (cfg.data_dir / "lanes" / "llama8-0.key").read_text().strip()
        await asyncio.to_thread(_chat, f"http://127.0.0.1:{lane.port}", marker, "llama8", key=key)
    # stopped: the lane's writer has written all it was given
    log = cfg.data_dir / "lanes" / "llama8-0.log"
    assert log.exists() and "main: model loaded" in log.read_text()
    holding = [p for p in _all_files(tmp_path, models) if marker.encode() in p.read_bytes()]
    assert holding == []


def test_the_fake_prints_the_prompt_at_debug_level(tmp_path, models):
    """The check above can fail: unfiltered, the fake's output holds the marker."""
    binary = fake_binary(tmp_path / "bin", {"FAKE_LLAMA_LOAD_SECONDS": "0"})
    port = free_port_base(1)
    out = open(tmp_path / "raw.log", "wb")
    proc = subprocess.Popen([binary, "-m", str(models / "llama8.gguf"), "--port", str(port), "-c", "1024", "-np", "1"],
                            stdout=out, stderr=out)  # fmt: skip
    out.close()
    def asked() -> bool:
        try:
            _chat(f"http://127.0.0.1:{port}", "marker-raw", "llama8", timeout=2)
        except urllib.error.HTTPError:  # answered, if only with "loading"
            pass
        return True

    try:
        eventually_blocking(asked, what="an answer")
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    assert "marker-raw" in (tmp_path / "raw.log").read_text()


def test_the_fleet_config_carries_the_log_limits_into_each_plan():
    from planner_svc.planner import plan
    from shared.messages.hosts import HostReport, ServerCaps

    report = HostReport(host_id="h", cpu_cores=2, ram_total=8 * 2**30, ram_available=8 * 2**30, server=ServerCaps())
    (host,) = plan([report], FleetConfig(lane_log_max_bytes=MIB, lane_log_files=5)).hosts
    assert (host.lane_log_max_bytes, host.lane_log_files) == (MIB, 5)
    assert (HostPlan(host_id="h").lane_log_max_bytes, HostPlan(host_id="h").lane_log_files) == (16 * MIB, 3)
    with pytest.raises(msgspec.ValidationError):
        msgspec.convert({"lane_log_files": 0}, FleetConfig)


# ------------------------------------------------------------------ the real binaries (slow)


async def test_real_llama_server_lanes_get_no_secret(nats_server, tmp_path, models, llama_server, monkeypatch):
    monkeypatch.setenv(SECRET, "s3cr3t")
    monkeypatch.setenv(NAMED, "given")
    cfg = agent_config(tmp_path, "real", models, llama_server, max_ram=2**30, lane_env=(NAMED,))
    async with services(nats_server.url) as s, client(nats_server.url) as nc:
        s.start_planner()
        s.start_agent(cfg)
        lane = await eventually(healthy_lane(nc, "real", "llama8-0"), timeout=120, what="the real lane healthy")
        assert Path(psutil.Process(lane.pid).exe()).name.startswith("llama-server")
        env = _environ(lane.pid)
        assert SECRET not in env and "s3cr3t" not in Path(f"/proc/{lane.pid}/environ").read_text(errors="replace")
        assert env[NAMED] == "given"
        assert lane.kv_bytes is not None  # its load-time lines were read through the log writer


def _listening(port: int, popen: subprocess.Popen, timeout: float = 30.0) -> bool:
    """The server accepts connections on its port (True), or exited first (False)."""
    import socket
    import time

    end = time.monotonic() + timeout
    while time.monotonic() < end and popen.poll() is None:
        with socket.socket() as sock:
            if sock.connect_ex(("127.0.0.1", port)) == 0:
                return True
        time.sleep(0.05)
    return False


def test_real_ggml_rpc_servers_get_no_secret(tmp_path, rpc_bin, monkeypatch):
    from launcher_agent.rpc_worker import RpcWorkers, WorkerSettings
    from shared.messages.plans import RpcWorkerSpec

    monkeypatch.setenv(SECRET, "s3cr3t")
    monkeypatch.setenv(NAMED, "given")
    for _ in range(3):  # a port found free may be taken before the server binds it: it exits, try another
        port = free_port_base(1)
        settings = WorkerSettings(str(rpc_bin / "ggml-rpc-server"), "127.0.0.1", port, 1, tmp_path / "rpc-cache",
                                  env_names=(NAMED,))  # fmt: skip
        workers = RpcWorkers(settings, tmp_path / "rpc-workers.json")
        spec = RpcWorkerSpec(lane_id="m-0", serving_host="h", bind="127.0.0.1", port=port)
        asyncio.run(workers.apply([spec], now=0))
        if _listening(port, workers.procs[port].popen):
            break
        asyncio.run(workers.stop_all())
    try:
        pid = workers.procs[port].pid
        assert Path(psutil.Process(pid).exe()).name == "ggml-rpc-server"
        env = _environ(pid)
        assert SECRET not in env and "s3cr3t" not in Path(f"/proc/{pid}/environ").read_text(errors="replace")
        assert env[NAMED] == "given" and env["LLAMA_CACHE"] == str(tmp_path / "rpc-cache")
    finally:
        asyncio.run(workers.stop_all())
    assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE


def test_lanes_up_with_the_real_binary_writes_no_prompt_anywhere(tmp_path, models, llama_server):
    """A chat through the gateway with a unique marker: at the defaults, no file the agent, planner
    or gateway writes (their own output included) holds it."""
    marker = f"marker-{uuid.uuid4().hex}"
    data, out_file = tmp_path / "data", tmp_path / "up.out"
    out = open(out_file, "wb")
    up = subprocess.Popen([sys.executable, "-m", "lanes.cli", "up", "--models", str(models), "--data", str(data),
                           "--llama-server", llama_server, "--nats-port", "0", "--gateway-port", "0",
                           "--host-id", "local", "--max-ram", "1GiB", "--port-base", str(free_port_base())],
                          stdout=out, stderr=out, stdin=subprocess.DEVNULL)  # fmt: skip
    out.close()
    try:
        url = eventually_blocking(lambda: re.search(r"gateway: (http://\S+)", out_file.read_text()).group(1),
                                  what="the gateway's address")  # fmt: skip
        answer = eventually_blocking(lambda: _chat(url, marker, "llama8", timeout=60), timeout=180,
                                     what="an answer through the gateway")  # fmt: skip
        assert answer["choices"]
        up.send_signal(signal.SIGINT)
        assert up.wait(60) == 0
    finally:
        if up.poll() is None:
            up.kill()
            up.wait(10)
        _kill_under(tmp_path)
    written = _all_files(tmp_path, models)
    assert any(p.name == "llama8-0.log" for p in written) and out_file in written
    assert re.search(LOADED_FOR_GOOD, (data / "agent" / "lanes" / "llama8-0.log").read_text())
    assert [p for p in written if marker.encode() in p.read_bytes()] == []


# ------------------------------------------------------------------ lanes as an unprivileged user (issue 36 point 4)

LANE_USER = "lanes-test-lane"


@pytest.fixture
def unprivileged():
    """A system user for lanes, made here as deploy/systemd/install makes lanes-lane (needs root:
    CI runs as root)."""
    from launcher_agent.lane_user import lane_user

    if os.geteuid() != 0:
        pytest.skip("starting lanes as another user needs an agent running as root")
    if subprocess.run(["id", LANE_USER], capture_output=True).returncode != 0:
        subprocess.run(["useradd", "--system", "--no-create-home", "--shell", "/usr/sbin/nologin", LANE_USER],
                       check=True, capture_output=True)  # fmt: skip
    return lane_user(LANE_USER)


def _as(user, *argv: str) -> subprocess.CompletedProcess:
    return subprocess.run(list(argv), capture_output=True, text=True, timeout=10, **user.spawn_args())


async def test_an_agent_running_as_root_starts_its_lanes_as_the_lane_user(nats_server, tiny_models, llama_server,
                                                                           unprivileged, monkeypatch):  # fmt: skip
    """The real llama-server as the lane user: it serves (it read its key file, wrote nothing it
    may not), and that user may not read the agent's environment, the agent's credentials file,
    nor the key it does not hold."""
    import shutil
    import tempfile

    monkeypatch.setenv(SECRET, "s3cr3t")
    base = Path(tempfile.mkdtemp(prefix="lanes-lane-user-"))  # pytest's tmp_path is root's alone (0700)
    try:
        base.chmod(0o755)
        models = base / "models"
        models.mkdir(mode=0o755)
        shutil.copy(tiny_models["llama8"], models / "llama8.gguf")
        (models / "llama8.gguf").chmod(0o644)
        credentials = base / "lanes.env"  # as deploy/systemd's: root:lanes 0640, the lane user not in the group
        credentials.write_text("LANES_NATS_PASSWORD=s3cr3t\n")
        credentials.chmod(0o640)
        cfg = agent_config(base, "unpriv", models, llama_server, max_ram=2**30, lane_user=unprivileged)
        async with services(nats_server.url) as s, client(nats_server.url) as nc:
            s.start_planner()
            s.start_agent(cfg)
            lane = await eventually(healthy_lane(nc, "unpriv", "llama8-0"), timeout=120,
                                    what="the lane healthy as the lane user")  # fmt: skip
            proc = psutil.Process(lane.pid)
            assert proc.uids().real == unprivileged.uid and proc.uids().effective == unprivileged.uid
            assert Path(proc.exe()).name.startswith("llama-server")
            key_file = cfg.data_dir / "lanes" / "llama8-0.key"
            assert key_file.stat().st_uid == unprivileged.uid and key_file.stat().st_mode & 0o777 == 0o600
            # What a compromised lane could try, as its user: every one denied.
            for path in (f"/proc/{os.getpid()}/environ", str(credentials), str(cfg.data_dir / "agent-state.json")):
                denied = _as(unprivileged, "cat", path)
                if path.endswith("agent-state.json"):  # readable state (no secret in it); the others not
                    continue
                assert denied.returncode != 0 and "Permission denied" in denied.stderr, (path, denied)
                assert "s3cr3t" not in denied.stdout
            assert _as(unprivileged, "ls", str(cfg.data_dir / "lanes")).returncode != 0  # pass through, not list
            assert _as(unprivileged, "cat", str(key_file)).returncode == 0  # its own key it reads
    finally:
        shutil.rmtree(base, ignore_errors=True)


def test_a_lane_user_that_cannot_be_used_is_refused_in_one_line(tmp_path):
    from launcher_agent.lane_user import lane_user
    from test_cli_offline import assert_one_line_error

    assert lane_user(None) is None and lane_user("") is None  # the agent's own user
    with pytest.raises(ValueError, match="no user 'no-such-lane-user'"):
        lane_user("no-such-lane-user")
    with pytest.raises(ValueError, match="is root"):
        lane_user("root")
    run = subprocess.run([sys.executable, "-m", "lanes.cli", "agent", "--nats", "nats://127.0.0.1:1", "--models",
                          str(tmp_path), "--lane-user", "no-such-lane-user", "--data", str(tmp_path / "d")],
                         capture_output=True, text=True, timeout=60)  # fmt: skip
    assert_one_line_error(run, "--lane-user", "no user 'no-such-lane-user'")


def test_a_lane_user_that_cannot_reach_the_data_folder_is_refused_at_start(tmp_path, unprivileged, tiny_models):
    """--data under a folder only root may pass (root's home, pytest's tmp): the lane could never
    read its key file; the agent says so in one line instead of starting lanes that die."""
    from test_cli_offline import assert_one_line_error

    closed = tmp_path / "closed"
    closed.mkdir(mode=0o700)
    models = tmp_path / "models"
    models.mkdir()
    run = subprocess.run([sys.executable, "-m", "lanes.cli", "agent", "--nats", "nats://127.0.0.1:1", "--models",
                          str(models), "--lane-user", LANE_USER, "--data", str(closed / "agent")],
                         capture_output=True, text=True, timeout=60)  # fmt: skip
    assert_one_line_error(run, f"--lane-user {LANE_USER} cannot pass through", "--data")
    assert unprivileged.blocked_at(closed / "agent") is not None
    open_base = Path("/tmp")
    assert unprivileged.blocked_at(open_base / "somewhere" / "agent") is None  # /tmp: 1777
