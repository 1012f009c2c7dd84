"""Each lane answers its key only (issue 36 point 1): llama-server's --api-key-file as lanes
uses it, the real binary beside the suite's fake, which must refuse exactly what the binary
refuses (measured on b11434: every path but /health and /v1/health, loading or not)."""

from __future__ import annotations

import json
import subprocess
import urllib.error
import urllib.request

import pytest
from fixtures_bus import fake_binary, free_port_base
from waiting import eventually_blocking

from launcher_agent import lane_secret

REFUSED = {"error": {"message": "Invalid API Key", "type": "authentication_error", "code": 401}}
CLOSED = ("/props", "/slots", "/metrics", "/v1/models", "/models", "/tokenize", "/v1/chat/completions",
          "/slots/0?action=erase", "/slots/0?action=save")  # fmt: skip
POSTED = {"/tokenize": {"content": "hi"}, "/v1/chat/completions": {"messages": [{"role": "user", "content": "hi"}],
          "max_tokens": 1}, "/slots/0?action=erase": {}, "/slots/0?action=save": {"filename": "x.bin"}}  # fmt: skip


def _ask(port: int, path: str, headers: dict[str, str] | None = None) -> tuple[int, object]:
    body = POSTED.get(path)
    request = urllib.request.Request(f"http://127.0.0.1:{port}{path}", headers={"Content-Type": "application/json",
                                     **(headers or {})}, data=None if body is None else json.dumps(body).encode())  # fmt: skip
    try:
        with urllib.request.urlopen(request, timeout=30) as resp:
            return resp.status, resp.read()
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read() or b"null")


@pytest.fixture(params=["fake", "real"])
def binary(request, tmp_path) -> str:
    if request.param == "fake":
        return fake_binary(tmp_path / "bin", {"FAKE_LLAMA_LOAD_SECONDS": "0"})
    return request.getfixturevalue("llama_server")


def test_a_lane_started_with_its_key_file_answers_the_key_alone(binary, tmp_path, tiny_models):
    key = lane_secret.new_key()
    key_file = tmp_path / "lane.key"
    lane_secret.write_key(key_file, key)
    port = free_port_base(1)
    proc = subprocess.Popen([binary, "-m", str(tiny_models["llama8"]), "--port", str(port), "-c", "1024", "-np", "1",
                             "--metrics", "--api-key-file", str(key_file)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)  # fmt: skip
    try:
        eventually_blocking(lambda: _ask(port, "/health")[0] == 200 if _port_open(port) else False, timeout=60,
                            what="the lane healthy")  # fmt: skip
        assert _ask(port, "/v1/health")[0] == 200
        for path in CLOSED:  # no key, or another one: refused, with the binary's own answer
            assert _ask(port, path) == (401, REFUSED), path
            assert _ask(port, path, {"Authorization": "Bearer lane-not-this-one-at-all"}) == (401, REFUSED), path
        for headers in ({"Authorization": f"Bearer {key}"}, {"X-Api-Key": key}):  # OpenAI's and Anthropic's way
            assert _ask(port, "/slots", headers)[0] == 200
            assert _ask(port, "/props", headers)[0] == 200
    finally:
        proc.terminate()
        proc.wait(15)


def _port_open(port: int) -> bool:
    import socket

    with socket.socket() as s:
        s.settimeout(0.5)
        return s.connect_ex(("127.0.0.1", port)) == 0


def test_key_files_are_written_whole_and_private(tmp_path):
    path = tmp_path / "lanes" / "m-0.key"
    first, second = lane_secret.new_key(), lane_secret.new_key()
    assert first != second and first.startswith("lane-") and len(first) > 40
    lane_secret.write_key(path, first)
    assert path.stat().st_mode & 0o777 == 0o600 and lane_secret.read_key(path) == first
    lane_secret.write_key(path, second)  # a restart: the old key opens nothing
    assert lane_secret.read_key(path) == second and [p.name for p in path.parent.iterdir()] == ["m-0.key"]
    lane_secret.remove_key(path)
    assert lane_secret.read_key(path) is None
    lane_secret.remove_key(path)  # gone already: nothing to do
