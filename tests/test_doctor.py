"""`lanes doctor` on a host that can serve (every line ok, exit 0) and on hosts broken in each way
it names (that line FAIL with its fix, exit 1). Real nats-server, real sockets and files; the
suite's fake llama-server answers --help/--version as the real binary does."""

from __future__ import annotations

import asyncio
import shutil
import socket
import subprocess
import sys

import pytest
from fixtures_bus import fake_binary, free_port_base

from shared.bus import connect, kv_bucket
from shared.natsserver import NatsServer

LANES = [sys.executable, "-m", "lanes.cli"]


def doctor(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*LANES, "doctor", *args], capture_output=True, text=True, timeout=120)


async def _make_bucket(url: str) -> None:
    nc = await connect(url, name="test", retry_forever=False)
    await kv_bucket(nc, create=True)
    await nc.close()


@pytest.fixture
def host(tmp_path, tiny_models, nats_server):
    """The agent options of a host that can serve: a binary, NATS with the bucket, free ports, a
    writable data folder, a readable model."""
    asyncio.run(_make_bucket(nats_server.url))
    models = tmp_path / "models"
    models.mkdir()
    shutil.copy(tiny_models["llama8"], models / "llama8.gguf")
    return {"--nats": nats_server.url, "--llama-server": fake_binary(tmp_path / "bin"), "--models": str(models),
            "--data": str(tmp_path / "data"), "--port-base": str(free_port_base(4)), "--port-count": "4",
            "--host-id": "h1"}  # fmt: skip


def _argv(options: dict[str, str]) -> list[str]:
    return [part for key, value in options.items() for part in (key, value)]


def _lines(done: subprocess.CompletedProcess[str], what: str) -> list[str]:
    return [line for line in done.stdout.splitlines() if line.split()[1:2] == [f"{what}:"]]


def test_a_host_that_can_serve(host):
    done = doctor(*_argv(host))
    assert done.returncode == 0, done.stdout + done.stderr
    checks = done.stdout.splitlines()[:-1]
    assert {line.split()[1] for line in checks} == {"llama-server:", "gpus:", "nats:", "memory:", "ports:", "data:",
                                                    "models:"}  # fmt: skip
    assert all(line.startswith("ok ") for line in checks), done.stdout
    assert "llama8.gguf" in "".join(_lines(done, "models")) and "cache types" in _lines(done, "llama-server")[0]
    assert done.stdout.splitlines()[-1] == "this host can serve lanes"


def _no_binary(host, tmp_path):
    host["--llama-server"] = str(tmp_path / "no-such-llama-server")
    return "llama-server"


def _nats_down(host, tmp_path):
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        host["--nats"] = f"nats://127.0.0.1:{s.getsockname()[1]}"
    return "nats"


def _data_unwritable(host, tmp_path):
    (tmp_path / "a-file").write_text("")
    host["--data"] = str(tmp_path / "a-file" / "data")  # a folder under a file: refused even to root
    return "data"


def _models_unreadable(host, tmp_path):
    broken = tmp_path / "broken-models"
    broken.mkdir()
    (broken / "truncated.gguf").write_bytes(b"GGUF\x03\x00")
    host["--models"] = str(broken)
    return "models"


@pytest.mark.parametrize("breaking", [_no_binary, _nats_down, _data_unwritable, _models_unreadable],
                         ids=["no-binary", "nats-down", "data-unwritable", "models-unreadable"])  # fmt: skip
def test_each_broken_host_is_named_with_its_fix(host, tmp_path, breaking):
    what = breaking(host, tmp_path)
    done = doctor(*_argv(host))
    assert done.returncode == 1, done.stdout + done.stderr
    failed = [line for line in done.stdout.splitlines() if line.startswith("FAIL")]
    assert failed and all(line.split()[1] == f"{what}:" and "  -> " in line for line in failed), done.stdout
    if what == "models":
        assert "truncated.gguf (not a GGUF file" in done.stdout
    assert "cannot serve" in done.stdout.splitlines()[-1]


def test_every_port_taken(host):
    base, count = int(host["--port-base"]), int(host["--port-count"])
    held = []
    try:
        for port in range(base, base + count):
            s = socket.socket()
            s.bind(("127.0.0.1", port))
            s.listen()
            held.append(s)
        done = doctor(*_argv(host))
        assert done.returncode == 1
        (line,) = _lines(done, "ports")
        assert line.startswith("FAIL") and "--port-base" in line
        held.pop().close()  # one free again: the host serves, with a warning that names the taken ports
        done = doctor(*_argv(host))
        assert done.returncode == 0
        (line,) = _lines(done, "ports")
        assert line.startswith("warn") and str(base) in line
    finally:
        for s in held:
            s.close()


def test_nats_credentials_and_rights(host, tmp_path):
    folder = tmp_path / "nats-auth"
    folder.mkdir()
    conf = folder / "server.conf"
    conf.write_text("""authorization {
  users = [
    {user: "narrow", password: "narrow-pw", permissions: {publish: {allow: ["$JS.API.INFO"]}, subscribe: {allow: ["_INBOX_h1.>"]}}}
  ]
}
""")
    server = NatsServer(folder, extra=["-c", str(conf)]).start()
    try:
        host["--nats"] = server.url
        wrong = doctor(*_argv(host), "--user", "narrow", "--password", "wrong")
        (line,) = _lines(wrong, "nats")
        assert wrong.returncode == 1 and line.startswith("FAIL") and "authorization" in line.lower(), wrong.stdout
        narrow = doctor(*_argv(host), "--user", "narrow", "--password", "narrow-pw")
        assert narrow.returncode == 1
        failed = [line for line in _lines(narrow, "nats") if line.startswith("FAIL")]
        assert len(failed) == 1 and "permission" in failed[0].lower() and "plan" in failed[0], narrow.stdout
    finally:
        server.stop()


def test_memory_is_the_containers_where_it_runs_under_a_limit(host):
    """In a memory cgroup with a limit (as a container's), the line names that limit, which is what
    the agent reports; --max-ram caps it further."""
    import os

    from test_cgroup_memory import GIB, limited_group

    group, _ = limited_group(f"lanes-doctor-{os.getpid()}", 3 * GIB)
    try:
        joined = subprocess.run([*LANES, "doctor", *_argv(host), "--max-ram", "2GiB"], capture_output=True, text=True,
                                timeout=120, preexec_fn=lambda: (group / "cgroup.procs").write_text(str(os.getpid())))  # fmt: skip
        line = _lines(joined, "memory")
        assert len(line) == 1 and line[0].startswith("ok "), joined.stdout + joined.stderr
        assert "(a container's limit) allows 3.0 of the machine's" in line[0], line
        assert "of 2.0 GiB" in line[0] and "--max-ram caps the lanes at 2.0 GiB" in line[0], line
    finally:
        group.rmdir()
