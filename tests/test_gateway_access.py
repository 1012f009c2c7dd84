"""Every gateway endpoint behind the API key, except the probes and the dashboard's page shell.

The app is served for real (aiohttp's test server on a free port) with no NATS behind it:
what is checked is who gets through the door, not what the fleet holds.
"""

from __future__ import annotations

import aiohttp
import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer
from waiting import eventually

import gateway.edge.access as access
from gateway.edge.app_keys import KEYS
from gateway.tenants.keys import digest
from gateway.dashboard.hub import STATIC
from gateway.service import Gateway
from gateway.settings import GatewaySettings

KEY = "sk-access-0123456789"
ADMIN = "admin-0123456789"
OPEN = {"/health", "/ready", "/dashboard", "/dashboard/"}


def test_paths_that_need_a_key():
    for path in ("/v1/models", "/v1/chat/completions", "/metrics", "/dashboard/api/state", "/dashboard/api/stream",
                 "/dashboard/static/app.js", "/dashboard/static/style.css", "/anything"):  # fmt: skip
        assert access.needs_key(path), path
    for path in OPEN | {"/dashboard/api/config"}:  # the config change: the admin key, in its handler
        assert not access.needs_key(path), path
    assert access.cookie_may_open("/dashboard/api/stream") and not access.cookie_may_open("/v1/models")
    assert not access.cookie_may_open("/metrics")


def test_session_tokens_are_signed_by_a_random_secret_and_expire():
    mine = frozenset({digest(KEY)})
    secret = access.CookieSecret()
    assert len(secret.value) == 32 and secret.value != access.CookieSecret().value  # random, each gateway at start
    token = access.session_token(secret.value, now=1000.0, key_id=digest(KEY), seconds=60)
    assert access.session_ok(secret.value, token, now=1059.0, key_ids=mine)
    assert not access.session_ok(secret.value, token, now=1060.0, key_ids=mine)  # expired
    assert not access.session_ok(access.CookieSecret().value, token, now=1001.0, key_ids=mine)  # another secret
    # Nothing of the keys signs it: the old derivation (sha256 of the keys) forges nothing.
    import hashlib

    derived = hashlib.sha256(b"lanes-dashboard\0" + KEY.encode()).digest()
    assert not access.session_ok(secret.value, access.session_token(derived, 1000.0, digest(KEY)), 1001.0, mine)
    expires, key_id, signature = token.split(".")
    stretched = f"{int(expires) + 3600}.{key_id}.{signature}"
    assert not access.session_ok(secret.value, stretched, now=1001.0, key_ids=mine)  # stretched
    assert not access.session_ok(secret.value, "", now=0, key_ids=mine) and not access.session_ok(b"", token, 1001.0, mine)
    # Its key revoked or made a tenant's (no longer among those that open the dashboard): it ends.
    assert not access.session_ok(secret.value, token, now=1001.0, key_ids=frozenset())
    other = digest("sk-ops-two")  # a cookie cannot be moved to another key
    assert not access.session_ok(secret.value, f"{expires}.{other}.{signature}", 1001.0, mine | {other})
    # A fixed maximum lifetime: a token that claims to live longer than a session is refused,
    # even when signed (a secret that leaked cannot mint a cookie for ever).
    forever = access.session_token(secret.value, now=1000.0, key_id=digest(KEY), seconds=10 * access.SESSION_SECONDS)
    assert not access.session_ok(secret.value, forever, now=1001.0, key_ids=mine)
    # The fleet's secret, taken from NATS, replaces this gateway's own.
    fleet = access.CookieSecret()
    assert secret.adopt(fleet.text()) and secret.value == fleet.value and secret.shared
    assert not secret.adopt(fleet.text()) and not secret.adopt("short") and not secret.adopt("!!not base64!!")


@pytest.fixture
async def served():
    gw = Gateway(GatewaySettings(port=0, api_keys=(KEY,), admin_key=ADMIN))
    server = TestServer(gw.app)
    await server.start_server()
    try:
        yield gw, str(server.make_url("")).rstrip("/")
    finally:
        await server.close()


def _get_routes(app: web.Application) -> set[str]:
    """Every GET path the app serves (static folders by one file in them)."""
    paths = set()
    for resource in app.router.resources():
        info = resource.get_info()
        if "directory" in info:
            paths |= {info["prefix"].rstrip("/") + "/" + f.name for f in info["directory"].iterdir()}
        elif "path" in info and any(r.method == "GET" for r in resource):
            paths.add(info["path"])
    return paths


async def test_without_a_key_only_the_probes_and_the_page_shell_answer(served):
    gw, url = served
    paths = _get_routes(gw.app)
    assert {"/metrics", "/dashboard/api/state", "/dashboard/static/app.js", "/v1/models"} <= paths
    async with aiohttp.ClientSession() as http:
        for path in sorted(paths):
            async with http.get(url + path, allow_redirects=False) as resp:
                if path in OPEN:
                    assert resp.status in (200, 302, 503), (path, resp.status)  # /ready: 503 until synced
                    if path == "/dashboard/":
                        # The shipped file as it is (no fleet data in it): it asks for the key.
                        assert await resp.text() == (STATIC / "index.html").read_text()
                else:
                    assert resp.status == 401, (path, resp.status)
                    assert (await resp.json())["error"]["code"] == "invalid_api_key"
        for path in ("/v1/chat/completions", access.SESSION_PATH):
            async with http.post(url + path, json={}) as resp:
                assert resp.status == 401, path
        async with http.get(url + "/metrics", headers={"Authorization": "Bearer sk-wrong"}) as resp:
            assert resp.status == 401


async def test_a_bearer_key_opens_metrics_and_the_api(served):
    gw, url = served
    bearer = {"Authorization": f"Bearer {KEY}"}
    async with aiohttp.ClientSession() as http:
        for path in ("/metrics", "/v1/models", "/dashboard/api/state", "/dashboard/static/app.js"):
            async with http.get(url + path, headers=bearer) as resp:
                assert resp.status == 200, path
        async with http.get(url + "/metrics", headers=bearer) as resp:
            assert "lanes_gateway" in await resp.text()


async def test_the_page_trades_its_key_for_a_cookie_that_opens_the_dashboard_only(served):
    gw, url = served
    async with aiohttp.ClientSession() as http:
        async with http.post(url + access.SESSION_PATH, headers={"Authorization": f"Bearer {KEY}"}) as resp:
            assert resp.status == 200
            cookie = resp.cookies[access.COOKIE]
            assert cookie["httponly"] and cookie["samesite"] == "Strict" and cookie["path"] == access.COOKIE_PATH
            assert KEY not in cookie.value
        jar = {access.COOKIE: cookie.value}
        for path in ("/dashboard/api/state", "/dashboard/static/app.js", "/dashboard/static/style.css"):
            async with http.get(url + path, cookies=jar) as resp:
                assert resp.status == 200, path
        async with http.get(url + "/dashboard/api/stream", cookies=jar) as resp:  # the live stream, no key in a URL
            assert resp.status == 200
            assert (await resp.content.readline()).startswith(b"event: snapshot")
        for path in ("/v1/models", "/metrics"):  # the cookie is the dashboard's, not an API key
            async with http.get(url + path, cookies=jar) as resp:
                assert resp.status == 401, path
        forged = cookie.value.rpartition(".")[0] + "." + "0" * 64
        async with http.get(url + "/dashboard/api/state", cookies={access.COOKIE: forged}) as resp:
            assert resp.status == 401


async def test_the_config_change_takes_the_admin_key_not_an_api_key(served):
    gw, url = served
    async with aiohttp.ClientSession() as http:
        async with http.post(url + "/dashboard/api/config", json={}, headers={"Authorization": f"Bearer {KEY}"}) as resp:
            assert resp.status == 401 and "admin key" in (await resp.json())["error"]["message"]


def test_planner_and_agent_metrics_listen_on_loopback_unless_told():
    import inspect

    from lanes.cli import build_parser
    from launcher_agent.config import AgentConfig
    from planner_svc.service import run_planner

    parser = build_parser()
    for command in (["planner"], ["agent"]):
        assert parser.parse_args([*command, "--metrics-port", "9180"]).metrics_bind == "127.0.0.1"
        assert parser.parse_args([*command, "--metrics-bind", "0.0.0.0"]).metrics_bind == "0.0.0.0"
    assert inspect.signature(run_planner).parameters["metrics_host"].default == "127.0.0.1"
    assert AgentConfig.__dataclass_fields__["metrics_host"].default == "127.0.0.1"


# ------------------------------------------------------------------ roles (issue 36 point 3, in part)

ROLE_KEYS = {"tenant": "sk-tenant-0001", "ops": "sk-ops-00001", "admin": "sk-admin-001"}


def _keys_file(path, roles: dict[str, str]) -> None:
    """One [[keys]] a role, the role's key given in full; a key without a role line is a tenant's."""
    path.write_text("".join(f'[[keys]]\nkey = "{ROLE_KEYS[name]}"\ntenant = "t-{name}"\n'
                            + (f'role = "{role}"\n' if role else "") for name, role in roles.items()))  # fmt: skip


def test_a_keys_file_gives_each_key_a_role_a_tenants_by_default():
    from gateway.tenants.keys import parse

    table = parse('[[keys]]\nkey = "sk-tenant-0001"\ntenant = "a"\n[[keys]]\nkey = "sk-ops-00001"\ntenant = "a"\n'
                  'role = "ops"\n', plain_keys=("sk-plain-001",))  # fmt: skip
    assert table.role(digest("sk-tenant-0001")) == "tenant" and table.role(digest("sk-ops-00001")) == "ops"
    assert table.role(digest("sk-plain-001")) == "ops"  # the operator's own --api-key
    with pytest.raises(ValueError, match="role must be one of tenant, ops, admin, not 'root'"):
        parse('[[keys]]\nkey = "sk-tenant-0001"\ntenant = "a"\nrole = "root"\n')


async def test_a_tenant_key_opens_the_api_only_and_an_ops_cookie_ends_with_its_key(tmp_path):
    path = tmp_path / "keys.toml"
    _keys_file(path, {"tenant": "", "ops": "ops", "admin": "admin"})
    gw = Gateway(GatewaySettings(port=0, keys_file=str(path)))
    server = TestServer(gw.app)
    await server.start_server()
    url = str(server.make_url("")).rstrip("/")

    def bearer(role: str) -> dict:
        return {"Authorization": f"Bearer {ROLE_KEYS[role]}"}

    try:
        async with aiohttp.ClientSession() as http:
            async with http.get(url + "/v1/models", headers=bearer("tenant")) as resp:
                assert resp.status == 200
            for path_ in ("/metrics", "/dashboard/api/state", "/dashboard/static/app.js"):
                async with http.get(url + path_, headers=bearer("tenant")) as resp:
                    assert resp.status == 403 and (await resp.json())["error"]["code"] == "role_forbidden", path_
            async with http.post(url + access.SESSION_PATH, headers=bearer("tenant")) as resp:
                assert resp.status == 403  # no cookie for a tenant's key
            for role in ("ops", "admin"):
                for path_ in ("/metrics", "/v1/models", "/dashboard/api/state"):
                    async with http.get(url + path_, headers=bearer(role)) as resp:
                        assert resp.status == 200, (role, path_)
            async with http.post(url + access.SESSION_PATH, headers=bearer("ops")) as resp:
                assert resp.status == 200
                jar = {access.COOKIE: resp.cookies[access.COOKIE].value}
            async with http.get(url + "/dashboard/api/state", cookies=jar) as resp:
                assert resp.status == 200 and (await resp.json())["admin"] is True  # a key of role admin exists
            async with http.post(url + access.SESSION_PATH, cookies=jar) as resp:
                assert resp.status == 401  # a cookie does not mint its successor
            # The config change: an admin key passes the check (then finds no planner here), ops does not.
            async with http.post(url + "/dashboard/api/config", json={}, headers=bearer("ops")) as resp:
                assert resp.status == 401
            async with http.post(url + "/dashboard/api/config", json={}, headers=bearer("admin")) as resp:
                assert resp.status == 503 and "planner" in (await resp.json())["error"]["message"]
            # The ops key made a tenant's: its cookie no longer opens the dashboard.
            _keys_file(path, {"tenant": "", "ops": "tenant", "admin": "admin"})
            gw.app[KEYS].check()
            async with http.get(url + "/dashboard/api/state", cookies=jar) as resp:
                assert resp.status == 401
            async with http.get(url + "/metrics", headers=bearer("ops")) as resp:
                assert resp.status == 403
    finally:
        await server.close()


# ------------------------------------------------------------------ secure by default (issue 36 point 2)


def test_a_gateway_beyond_loopback_without_keys_refuses_to_start(tmp_path):
    """No key and an address others reach: one line naming every way out, exit 2, nothing served."""
    import subprocess
    import sys

    from test_cli_offline import assert_one_line_error

    env = {k: v for k, v in __import__("os").environ.items() if not k.startswith("LANES_GATEWAY_")}
    for host in ("0.0.0.0", "::", "192.0.2.7", "gateway.example"):
        run = subprocess.run([sys.executable, "-m", "lanes.cli", "gateway", "--nats", "nats://127.0.0.1:1",
                              "--host", host], capture_output=True, text=True, timeout=60, env=env)  # fmt: skip
        assert_one_line_error(run, f"--host {host}", "LANES_GATEWAY_API_KEYS", "--keys-file", "--no-auth")
        assert run.returncode == 2, run


def test_keys_or_loopback_or_no_auth_let_it_start():
    from lanes.cli import build_parser
    from lanes.online import gateway_settings
    from gateway.settings import listens_on_loopback

    parser = build_parser()
    assert gateway_settings(parser.parse_args(["gateway"])).host == "127.0.0.1"  # loopback: no key needed
    assert gateway_settings(parser.parse_args(["gateway", "--host", "::1"])).host == "::1"
    assert gateway_settings(parser.parse_args(["gateway", "--host", "0.0.0.0", "--api-key", "k"])).api_keys == ("k",)
    opened = gateway_settings(parser.parse_args(["gateway", "--host", "0.0.0.0", "--no-auth"]))
    assert opened.no_auth and opened.open_beyond_loopback()
    assert [listens_on_loopback(h) for h in ("127.0.0.1", "127.8.9.1", "::1", "[::1]", "localhost")] == [True] * 5
    assert [listens_on_loopback(h) for h in ("0.0.0.0", "::", "", "10.0.0.1", "example.com")] == [False] * 5


async def test_an_open_gateway_warns_at_start_and_every_hour(nats_server, monkeypatch):
    """--no-auth beyond loopback: a warning at start, then again each OPEN_WARNING_EVERY."""
    import asyncio

    import structlog

    import gateway.service as service

    monkeypatch.setattr(service, "OPEN_WARNING_EVERY", 0.2)

    async def warnings(settings: GatewaySettings) -> list[dict]:
        stop = asyncio.Event()
        gw = Gateway(settings)
        with structlog.testing.capture_logs() as logs:
            task = asyncio.create_task(service.run_gateway(nats_server, stop, gateway=gw))
            await asyncio.wait_for(gw.started.wait(), 10)
            await asyncio.sleep(0.5)
            stop.set()
            await asyncio.wait_for(task, 20)
        return [e for e in logs if "serving without keys" in e["event"]]

    said = await warnings(GatewaySettings(host="0.0.0.0", port=0, no_auth=True))
    assert len(said) >= 2 and all(e["log_level"] == "warning" for e in said), said
    # A keyed gateway on the same address says nothing of the kind.
    assert not await warnings(GatewaySettings(host="0.0.0.0", port=0, api_keys=(KEY,)))


async def test_gateways_share_a_random_cookie_secret_through_nats(nats_server):
    """A cookie one gateway gave opens another's dashboard: the first gateway's random secret,
    put in bucket lanes-secrets, is every gateway's (one started later takes it too)."""
    import asyncio

    import gateway.service as service
    from gateway.edge import COOKIE_SECRET
    from planner_svc.service import run_planner

    stop = asyncio.Event()
    planner = asyncio.create_task(run_planner(nats_server.url, stop))  # makes the buckets
    first, second = (Gateway(GatewaySettings(port=0, api_keys=(KEY,), gateway_id=g)) for g in ("g1", "g2"))
    own = first.app[COOKIE_SECRET].value, second.app[COOKIE_SECRET].value
    assert own[0] != own[1]
    tasks = [asyncio.create_task(service.run_gateway(nats_server.url, stop, gateway=g)) for g in (first, second)]
    try:
        for g in (first, second):
            await asyncio.wait_for(g.started.wait(), 10)

        def shared() -> bool:
            a, b = first.app[COOKIE_SECRET], second.app[COOKIE_SECRET]
            return a.shared and b.shared and a.value == b.value

        await eventually(shared, timeout=15, what="one secret for both gateways")
        assert first.app[COOKIE_SECRET].value in own  # one of the two random ones, from neither key
        async with aiohttp.ClientSession() as http:
            async with http.post(first.url + "/dashboard/api/session", headers={"Authorization": f"Bearer {KEY}"}) as r:
                assert r.status == 200
                cookie = r.cookies["lanes_dashboard"].value
        async with aiohttp.ClientSession(cookies={"lanes_dashboard": cookie}) as http:
            async with http.get(second.url + "/dashboard/api/state") as r:
                assert r.status == 200  # the other gateway takes it
            async with http.get(second.url + "/v1/models") as r:
                assert r.status == 401  # a cookie opens the dashboard only
        # A gateway started later signs with the same secret.
        third = Gateway(GatewaySettings(port=0, api_keys=(KEY,), gateway_id="g3"))
        tasks.append(asyncio.create_task(service.run_gateway(nats_server.url, stop, gateway=third)))
        await eventually(lambda: third.app[COOKIE_SECRET].value == first.app[COOKIE_SECRET].value, timeout=15,
                         what="the third gateway took it")  # fmt: skip
    finally:
        stop.set()
        await asyncio.wait_for(asyncio.gather(planner, *tasks, return_exceptions=True), 30)



async def test_a_client_too_slow_to_send_its_request_is_let_go(nats_server):
    """--client-timeout: headers unfinished, the connection is closed; a body unfinished, 408."""
    import asyncio
    import time

    import gateway.service as service

    stop = asyncio.Event()
    gw = Gateway(GatewaySettings(port=0, api_keys=(KEY,), client_timeout=0.5))
    task = asyncio.create_task(service.run_gateway(nats_server.url, stop, gateway=gw))
    try:
        await asyncio.wait_for(gw.started.wait(), 10)
        port = int(gw.url.rsplit(":", 1)[1])

        async def drip(head: bytes, tail: bytes) -> tuple[bytes, float]:
            began = time.monotonic()
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.write(head)
            got = b""
            for byte in tail:
                try:
                    got = await asyncio.wait_for(reader.read(4096), 0.2)
                except asyncio.TimeoutError:
                    writer.write(bytes([byte]))
                    continue
                break
            writer.close()
            return got, time.monotonic() - began

        answer, took = await drip(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n", b"X-Slow: " + b"a" * 40)
        assert answer == b"" and took < 3, (answer, took)  # closed, without an answer, past the deadline
        body = b'{"model": "m", "messages": []}'
        head = (f"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {KEY}\r\n"
                f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n").encode()  # fmt: skip
        answer, took = await drip(head, body)
        assert answer.startswith(b"HTTP/1.1 408") and b"request_timeout" in answer and took < 3, (answer, took)
    finally:
        stop.set()
        await asyncio.wait_for(task, 20)
