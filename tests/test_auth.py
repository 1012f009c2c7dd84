"""NATS security against a real nats-server: per-user permissions from the deploy's
docker/nats/auth.conf, token auth, nkey auth and TLS. Nothing is mocked.

The server config written here `include`s docker/nats/auth.conf itself (by a relative
path, which is what nats-server's include accepts), so these tests check the very
permission blocks the compose deploy ships. Its passwords come from the environment of
the nats-server process, as in docker-compose.yml.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import secrets
import shutil
import subprocess
import urllib.request
from pathlib import Path

import msgspec
import nats
import nats.errors
import pytest
import structlog
from fixtures_bus import agent_config, fake_binary, lane_of
from waiting import eventually

from launcher_agent.service import run_agent
from planner_svc.service import run_planner
from shared import subjects
from shared.bus import connect, kv_bucket
from shared.messages.hosts import HostReport
from shared.messages.replies import ConfigSet
from shared.messages.status import HostStatus
from shared.messages.wire import encode
from shared.nats_auth import NatsAuth
from shared.natsserver import NatsServer

REPO = Path(__file__).resolve().parent.parent
AUTH_CONF = REPO / "docker" / "nats" / "auth.conf"
PASSWORD_VARS = ("NATS_ADMIN_PASSWORD", "NATS_PLANNER_PASSWORD", "NATS_AGENT_HOST1_PASSWORD", "NATS_AGENT_HOST2_PASSWORD",
                 "NATS_GATEWAY_PASSWORD")  # fmt: skip


def _write_conf(folder: Path, body: str) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    conf = folder / "server.conf"
    conf.write_text(body)
    return conf


async def _connect(url: str, auth: NatsAuth, errors: list[str] | None = None, **kw) -> nats.aio.client.Client:
    """A plain nats-py client (no reconnect) that records the server's async errors."""

    async def error_cb(exc: Exception) -> None:
        if errors is not None:
            errors.append(str(exc).lower())  # nats-py lowercases the server's -ERR text

    return await nats.connect(
        servers=[url], allow_reconnect=False, connect_timeout=3, error_cb=error_cb, **auth.connect_options(), **kw
    )


async def _why_unseen(server: NatsServer, admin, agent, kv, seen: asyncio.Queue) -> str:
    """What the server and both clients say when a plan update did not reach the agent's subscription."""
    subject = subjects.kv_subject(subjects.plan_key("host1"))
    entry = await kv.get(subjects.plan_key("host1"))
    await admin.publish(subject, b"probe")  # a core message on the same subject, no JetStream
    await admin.flush()
    try:
        probe = (await asyncio.wait_for(seen.get(), 3)).data
    except TimeoutError:
        probe = None
    url = f"{server.monitor}/connz?subs=detail&auth=true"
    conns = (await asyncio.to_thread(lambda: msgspec.json.decode(urllib.request.urlopen(url, timeout=3).read())))
    agents = [{k: c.get(k) for k in ("cid", "name", "authorized_user", "in_msgs", "out_msgs", "subscriptions_list_detail")}
              for c in conns.get("connections", []) if c.get("authorized_user") == "agent-host1"]  # fmt: skip
    return (f"the plan key holds {entry.value!r} at revision {entry.revision}; a core publish on its subject "
            f"{'reached' if probe else 'did not reach'} the subscription ({probe!r}); the agent client's "
            f"stats {dict(agent.stats)}, subscriptions {list(agent._subs)}; the server's view of it: {agents}")


async def _refused(url: str, auth: NatsAuth) -> str:
    """Connecting with these credentials fails; the failure's text."""
    try:
        nc = await asyncio.wait_for(_connect(url, auth), 15)
    except Exception as exc:  # nats.errors.Error('nats: ...Authorization Violation'), ssl errors, ...
        return f"{type(exc).__name__}: {exc}"
    await nc.close()
    raise AssertionError(f"connection with {auth!r} was accepted")


async def _roundtrip(nc) -> None:
    """A request answered by the same connection: proves the client can use the server."""

    async def echo(msg):
        await msg.respond(b"pong:" + msg.data)

    sub = await nc.subscribe("auth.test.echo", cb=echo)
    reply = await nc.request("auth.test.echo", b"ping", timeout=3)
    assert reply.data == b"pong:ping"
    await sub.unsubscribe()


# ------------------------------------------------------------------ users and permissions (auth.conf)


@pytest.fixture
def passwords(monkeypatch):
    """Letters and digits starting with a letter, as auth.conf asks; set for the nats-server process."""
    values = {var: "pw" + secrets.token_hex(12) for var in PASSWORD_VARS}
    for var, value in values.items():
        monkeypatch.setenv(var, value)
    return values


@pytest.fixture
def auth_server(tmp_path, passwords):
    folder = tmp_path / "nats-auth"
    folder.mkdir()
    include = os.path.relpath(AUTH_CONF, folder)
    conf = _write_conf(folder, f'# test server: the deploy\'s users and permissions\ninclude "{include}"\n')
    server = NatsServer(folder, extra=["-c", str(conf)]).start()
    yield server
    server.stop()


def _users(passwords) -> dict[str, NatsAuth]:
    return {
        "admin": NatsAuth(user="admin", password=passwords["NATS_ADMIN_PASSWORD"]),
        "planner": NatsAuth(user="planner", password=passwords["NATS_PLANNER_PASSWORD"]),
        "agent-host1": NatsAuth(user="agent-host1", password=passwords["NATS_AGENT_HOST1_PASSWORD"]),
    }


async def test_anonymous_and_wrong_password_are_refused(auth_server, passwords):
    users = _users(passwords)
    assert "Authorization Violation" in await _refused(auth_server.url, NatsAuth())
    assert "Authorization Violation" in await _refused(
        auth_server.url, NatsAuth(user="planner", password=passwords["NATS_AGENT_HOST1_PASSWORD"])
    )
    nc = await _connect(auth_server.url, users["admin"])
    await _roundtrip(nc)
    await nc.close()


async def test_planner_and_agent_run_with_their_own_users(auth_server, passwords, tmp_path, models):
    """(1) lane healthy with per-user credentials; (2) the agent's user cannot write what is not its own."""
    users = _users(passwords)
    cfg = agent_config(tmp_path, "host1", models, fake_binary(tmp_path / "bin"))
    capture = contextlib.ExitStack()
    logs = capture.enter_context(structlog.testing.capture_logs())  # what the services log
    stop = asyncio.Event()
    planner = asyncio.create_task(run_planner(auth_server.url, stop, auth=users["planner"]))
    agent = asyncio.create_task(run_agent(cfg, auth_server.url, stop, auth=users["agent-host1"]))
    admin = await connect(auth_server.url, name="test-admin", auth=users["admin"], retry_forever=False)
    opened: list = [admin]
    try:
        kv_admin = await eventually(lambda: kv_bucket(admin), what="the planner created the lanes bucket")

        async def healthy():
            try:
                entry = await kv_admin.get(subjects.status_key("host1"))
            except Exception:
                return None
            lane = lane_of(msgspec.json.decode(entry.value, type=HostStatus), "llama8-0")
            return lane if lane and lane.state == "healthy" else None

        lane = await eventually(healthy, timeout=40, what="lane healthy with per-user credentials")
        assert not planner.done() and not agent.done()

        # ---- the agent's own user: its report is allowed, everything else refused
        agent_errors: list[str] = []
        agent_nc = await _connect(auth_server.url, users["agent-host1"], agent_errors,
                                  inbox_prefix=subjects.agent_inbox("host1"))  # fmt: skip
        opened.append(agent_nc)
        agent_kv = await agent_nc.jetstream(timeout=1.0).key_value(subjects.BUCKET)
        report = (await kv_admin.get(subjects.report_key("host1"))).value
        assert await agent_kv.put(subjects.report_key("host1"), report) > 0

        plan_before = await kv_admin.get(subjects.plan_key("host1"))
        config_before = await kv_admin.get(subjects.CONFIG_KEY)
        host2_report = encode(msgspec.structs.replace(msgspec.json.decode(report, type=HostReport), host_id="host2"))
        forbidden = {
            subjects.plan_key("host1"): plan_before.value,
            subjects.CONFIG_KEY: config_before.value,
            subjects.DEMAND_KEY: b'{"kind":"demand","personas":[]}',
            subjects.report_key("host2"): host2_report,
            subjects.status_key("host2"): b'{"kind":"host_status","host_id":"host2"}',
        }
        for key, value in forbidden.items():
            # The server drops the publish (no JetStream ack ever comes) and says why.
            with pytest.raises(nats.errors.TimeoutError):
                await agent_kv.put(key, value)
            subject = subjects.kv_subject(key)
            await eventually(
                lambda: any(f'permissions violation for publish to "{subject.lower()}"' in e for e in agent_errors),
                timeout=5,
                what=f"permissions violation for {subject}",
            )
        # Reading another host's plan is refused too. (The bucket is created without
        # allow_direct, so nats-py reads through $JS.API.STREAM.MSG.GET.KV_lanes, which the
        # agent may not use at all; with allow_direct it would be DIRECT.GET...plan.host2.)
        with pytest.raises((nats.errors.TimeoutError, nats.errors.NoRespondersError, nats.js.errors.NotFoundError)):
            await agent_kv.get(subjects.plan_key("host2"))
        assert any(
            "permissions violation" in e and ("stream.msg.get.kv_lanes" in e or "direct.get.kv_lanes.$kv.lanes.plan.host2" in e)
            for e in agent_errors
        ), agent_errors
        # Nothing the agent's user tried landed in the bucket.
        assert (await kv_admin.get(subjects.plan_key("host1"))).revision == plan_before.revision
        assert (await kv_admin.get(subjects.CONFIG_KEY)).revision == config_before.revision
        for key in (subjects.DEMAND_KEY, subjects.report_key("host2"), subjects.status_key("host2")):
            with pytest.raises(nats.js.errors.NotFoundError):
                await kv_admin.get(key)

        # ---- the planner's user may write all of it
        planner_errors: list[str] = []
        planner_nc = await _connect(auth_server.url, users["planner"], planner_errors)
        opened.append(planner_nc)
        planner_kv = await planner_nc.jetstream(timeout=3).key_value(subjects.BUCKET)
        # Same values as before: the agent sees its applied plan again and changes nothing.
        assert await planner_kv.put(subjects.plan_key("host1"), plan_before.value) > plan_before.revision
        assert await planner_kv.put(subjects.CONFIG_KEY, config_before.value) > config_before.revision
        assert await planner_kv.put(subjects.report_key("host2"), host2_report) > 0
        await planner_kv.delete(subjects.report_key("host2"))
        assert not [e for e in planner_errors if "permissions violation" in e]

        # ---- the agent's user did not disturb the fleet: a config change still reaches the lane
        reply = await admin.request(
            subjects.CONFIG_SET, encode(ConfigSet(changes={"kv_cache_type": "q8_0", "flash_attn": "on"})), timeout=5
        )
        assert "Nats-Service-Error" not in (reply.headers or {}), reply.headers

        async def relaunched():
            found = await healthy()
            return found if found and "q8_0" in found.argv else None

        again = await eventually(relaunched, timeout=40, what="q8_0 lane healthy under per-user credentials")
        assert again.pid != lane.pid
        assert not planner.done() and not agent.done()
        # auth.conf gives both services every permission they use: the server refused them nothing.
        assert any(e.get("event") == "plan written" for e in logs)  # the capture sees the services
        refused = [e for e in logs if "permissions violation" in str(e.get("error", "")).lower()]
        assert not refused, refused
    finally:
        for nc in opened:
            await nc.close()
        stop.set()
        await asyncio.wait_for(asyncio.gather(planner, agent, return_exceptions=True), 30)
        capture.close()


async def _violation(errors: list[str], action: str, subject: str) -> None:
    """The server said no to this publish or subscription (nats-py passes its -ERR on, lowercased)."""
    needle = f'permissions violation for {action} "{subject.lower()}"'
    await eventually(lambda: any(needle in e for e in errors), timeout=5, what=needle)


async def test_agent_user_is_refused_all_but_its_own(auth_server, passwords):
    """Each refusal the shipped auth.conf makes for an agent, proved against the server."""
    users = _users(passwords)
    admin = await connect(auth_server.url, name="test-admin", auth=users["admin"], retry_forever=False)
    errors: list[str] = []
    agent = await _connect(auth_server.url, users["agent-host1"], errors, inbox_prefix=subjects.agent_inbox("host1"))
    try:
        kv = await kv_bucket(admin, create=True)
        for host in ("host1", "host2"):
            await kv.put(subjects.plan_key(host), f'{{"plan for":"{host}"}}'.encode())
        js_admin = admin.jetstream()
        planners_watch = await js_admin.add_consumer(
            "KV_lanes", durable_name="planner_watch", filter_subject=subjects.kv_subject(">")
        )

        # Allowed: its own plan, read (direct get) and followed (a subscription on its key).
        direct = "$JS.API.DIRECT.GET.KV_lanes."
        own = await agent.request(direct + subjects.kv_subject(subjects.plan_key("host1")), b"", timeout=3)
        assert own.data == b'{"plan for":"host1"}'
        seen = asyncio.Queue()
        await agent.subscribe(subjects.kv_subject(subjects.plan_key("host1")), cb=seen.put)
        await agent.flush()
        await kv.put(subjects.plan_key("host1"), b'{"plan for":"host1","v":2}')
        try:  # (it missed in 2 fresh-clone CI runs of the whole suite, never alone: what the server said is kept)
            update = await asyncio.wait_for(seen.get(), 15)
        except TimeoutError:
            raise AssertionError(f"no plan update on the agent's subscription in 15 s; its async errors: {errors}, "
                                 f"connected: {agent.is_connected}; "
                                 f"{await _why_unseen(auth_server, admin, agent, kv, seen)}") from None  # fmt: skip
        assert update.data == b'{"plan for":"host1","v":2}'
        assert not [e for e in errors if "permissions violation" in e]

        # Refused: another host's plan, by direct get or by any other read path.
        for subject in (
            direct + subjects.kv_subject(subjects.plan_key("host2")),
            direct + subjects.kv_subject(subjects.CONFIG_KEY),
            "$JS.API.STREAM.MSG.GET.KV_lanes",
        ):
            with pytest.raises((nats.errors.TimeoutError, nats.errors.NoRespondersError)):
                await agent.request(subject, b'{"last_by_subj":"$KV.lanes.plan.host2"}', timeout=1)
            await _violation(errors, "publish to", subject)
        # Refused: subscribing to anything but its own key, inbox and endpoints.
        for subject in (
            subjects.kv_subject(subjects.plan_key("host2")),
            subjects.kv_subject(">"),
            subjects.kv_subject(subjects.CONFIG_KEY),
            "_INBOX.>",
            f"{subjects.agent_inbox('host2')}.>",
            "lanes.>",
            subjects.slot_ask_subject("host2"),  # another host's hot lanes are not this agent's to spread
        ):
            await agent.subscribe(subject)
            await _violation(errors, "subscription to", subject)
        # Refused: creating consumers (filtered or not, even on its own plan) and deleting them.
        for subject in (
            "$JS.API.CONSUMER.CREATE.KV_lanes",
            "$JS.API.CONSUMER.CREATE.KV_lanes.mine.$KV.lanes.plan.host1",
            "$JS.API.CONSUMER.CREATE.KV_lanes.theirs.$KV.lanes.plan.host2",
            "$JS.API.CONSUMER.DURABLE.CREATE.KV_lanes.mine",
            f"$JS.API.CONSUMER.DELETE.KV_lanes.{planners_watch.name}",
        ):
            with pytest.raises((nats.errors.TimeoutError, nats.errors.NoRespondersError)):
                await agent.request(subject, b"{}", timeout=1)
            await _violation(errors, "publish to", subject)
        assert (await js_admin.consumer_info("KV_lanes", planners_watch.name)).name == planners_watch.name
        # Refused: another host's events, telemetry and rejections, and its slot offers and pieces
        # (a host cannot offer conversations' caches in another's name).
        for subject in ("lanes.event.host2.x-0.started", "lanes.telemetry.host2", "lanes.rejected.host2",
                        "lanes.slots.host2.offer", "lanes.slots.host2.m.s0.0"):  # fmt: skip
            await agent.publish(subject, b"{}")
            await _violation(errors, "publish to", subject)
    finally:
        await agent.close()
        await admin.close()

    # Without its own inbox prefix the agent's user gets no replies at all (it may not read _INBOX.>).
    errors.clear()
    plain = await _connect(auth_server.url, users["agent-host1"], errors)
    try:
        with pytest.raises((nats.errors.TimeoutError, nats.errors.NoRespondersError)):
            await plain.request(direct + subjects.kv_subject(subjects.plan_key("host1")), b"", timeout=1)
        await eventually(lambda: any('permissions violation for subscription to "_inbox.' in e for e in errors),
                         timeout=5, what="the default inbox refused")  # fmt: skip
    finally:
        await plain.close()


# ------------------------------------------------------------------ token


async def test_token_auth(tmp_path):
    token = "tok" + secrets.token_hex(16)
    conf = _write_conf(tmp_path / "nats-token", f'authorization {{\n  token: "{token}"\n}}\n')
    server = NatsServer(tmp_path / "nats-token", extra=["-c", str(conf)]).start()
    try:
        nc = await _connect(server.url, NatsAuth(token=token))
        await _roundtrip(nc)
        await nc.close()
        assert "Authorization Violation" in await _refused(server.url, NatsAuth(token=token + "x"))
        assert "Authorization Violation" in await _refused(server.url, NatsAuth())
    finally:
        server.stop()


# ------------------------------------------------------------------ nkeys


def _nkey_user(folder: Path, name: str) -> tuple[str, Path]:
    """A fresh user nkey: (public key U..., path of its seed file S...)."""
    import nkeys  # nats-py[nkeys], a dependency of lanes
    seed = nkeys.encode_seed(os.urandom(32), nkeys.PREFIX_BYTE_USER)
    kp = nkeys.from_seed(bytearray(seed))
    public = kp.public_key.decode()
    path = folder / f"{name}.nk"
    path.write_bytes(seed + b"\n")
    path.chmod(0o600)
    return public, path


async def test_nkey_auth(tmp_path):
    folder = tmp_path / "nats-nkey"
    folder.mkdir()
    public, seed = _nkey_user(folder, "good")
    _, other_seed = _nkey_user(folder, "stranger")
    assert public.startswith("U") and seed.read_text().startswith("SU")
    conf = _write_conf(folder, f"authorization {{\n  users: [\n    {{ nkey: {public} }}\n  ]\n}}\n")
    server = NatsServer(folder, extra=["-c", str(conf)]).start()
    try:
        nc = await _connect(server.url, NatsAuth(nkey_seed=str(seed)))
        await _roundtrip(nc)
        await nc.close()
        # The services' own connect() (what `lanes ... --nkey FILE` uses) works too.
        nc = await connect(server.url, name="test-nkey", auth=NatsAuth(nkey_seed=str(seed)), retry_forever=False)
        await _roundtrip(nc)
        await nc.close()
        assert "Authorization Violation" in await _refused(server.url, NatsAuth(nkey_seed=str(other_seed)))
        assert "Authorization Violation" in await _refused(server.url, NatsAuth())
    finally:
        server.stop()


# ------------------------------------------------------------------ TLS


def _openssl(*args: str, cwd: Path) -> None:
    run = subprocess.run(["openssl", *args], cwd=cwd, capture_output=True, text=True)
    assert run.returncode == 0, f"openssl {' '.join(args)}: {run.stderr}"


def _make_ca_and_server_cert(folder: Path) -> tuple[Path, Path, Path]:
    """A self-signed CA and a server certificate for 127.0.0.1/localhost signed by it."""
    if shutil.which("openssl") is None:
        pytest.skip("openssl CLI not installed")
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "ca.ext").write_text(
        "basicConstraints=critical,CA:TRUE\nkeyUsage=critical,keyCertSign,cRLSign\n"
        "subjectKeyIdentifier=hash\nauthorityKeyIdentifier=keyid:always\n"
    )
    (folder / "server.ext").write_text(
        "basicConstraints=critical,CA:FALSE\nkeyUsage=critical,digitalSignature,keyEncipherment\n"
        "extendedKeyUsage=serverAuth\nsubjectAltName=IP:127.0.0.1,DNS:localhost\n"
        "subjectKeyIdentifier=hash\nauthorityKeyIdentifier=keyid,issuer\n"
    )
    _openssl("req", "-new", "-newkey", "rsa:2048", "-nodes", "-keyout", "ca.key", "-out", "ca.csr",
             "-subj", "/CN=lanes test CA", cwd=folder)  # fmt: skip
    _openssl("x509", "-req", "-in", "ca.csr", "-signkey", "ca.key", "-out", "ca.pem", "-days", "2",
             "-extfile", "ca.ext", cwd=folder)  # fmt: skip
    _openssl("req", "-new", "-newkey", "rsa:2048", "-nodes", "-keyout", "server.key", "-out", "server.csr",
             "-subj", "/CN=localhost", cwd=folder)  # fmt: skip
    _openssl("x509", "-req", "-in", "server.csr", "-CA", "ca.pem", "-CAkey", "ca.key", "-CAcreateserial",
             "-out", "server.pem", "-days", "2", "-extfile", "server.ext", cwd=folder)  # fmt: skip
    return folder / "ca.pem", folder / "server.pem", folder / "server.key"


async def test_tls(tmp_path):
    ca, cert, key = _make_ca_and_server_cert(tmp_path / "pki")
    folder = tmp_path / "nats-tls"
    conf = _write_conf(folder, f'tls {{\n  cert_file: "{cert}"\n  key_file: "{key}"\n  timeout: 3\n}}\n')
    server = NatsServer(folder, extra=["-c", str(conf)]).start()
    try:
        tls_url = server.url.replace("nats://", "tls://")
        for url in (server.url, tls_url):
            nc = await _connect(url, NatsAuth(tls_ca=str(ca)))
            assert nc.is_connected
            await _roundtrip(nc)
            await nc.close()
        # The services' connect() with TLS: JetStream (the lanes bucket) works over it.
        nc = await connect(server.url, name="test-tls", auth=NatsAuth(tls_ca=str(ca)), retry_forever=False)
        kv = await kv_bucket(nc, create=True)
        rev = await kv.put(subjects.CONFIG_KEY, b"{}")
        assert (await kv.get(subjects.CONFIG_KEY)).revision == rev
        await nc.close()

        # Without the CA the server's certificate is not trusted.
        failure = await _refused(tls_url, NatsAuth())
        assert "CERTIFICATE_VERIFY_FAILED" in failure or "certificate verify failed" in failure, failure
        # A CA that did not sign the server's certificate is not enough either.
        other_ca, _, _ = _make_ca_and_server_cert(tmp_path / "other-pki")
        failure = await _refused(tls_url, NatsAuth(tls_ca=str(other_ca)))
        assert "CERTIFICATE_VERIFY_FAILED" in failure or "certificate verify failed" in failure, failure
        # A nats:// URL is upgraded to TLS by the client (the server requires it): same refusal.
        failure = await _refused(server.url, NatsAuth())
        assert "CERTIFICATE_VERIFY_FAILED" in failure or "certificate verify failed" in failure, failure
    finally:
        server.stop()
