"""The gateway's NATS user from docker/nats/auth.conf: it reads the whole fleet and writes nothing
but its wakes and activity reports to the planner (models on demand)."""

from __future__ import annotations

import asyncio
import contextlib

import nats
import nats.errors
import pytest
import structlog
from fixtures_bus import agent_config, fake_binary
from waiting import eventually
from test_auth import _connect, _users, auth_server, passwords  # noqa: F401 (fixtures)

from gateway.edge import COOKIE_SECRET
from gateway.service import Gateway, run_gateway
from gateway.settings import GatewaySettings
from launcher_agent.service import run_agent
from planner_svc.service import run_planner
from shared import subjects
from shared.messages.activity import GatewayActivity, ModelWake, TenantUsage
from shared.messages.replies import ConfigSet
from shared.messages.slots import SlotsAsk
from shared.messages.wire import encode
from shared.nats_auth import NatsAuth


async def test_gateway_user_reads_plans_status_reports_config_and_writes_nothing(
    auth_server, passwords, tmp_path, models
):
    users = _users(passwords)
    gateway_auth = NatsAuth(user="gateway", password=passwords["NATS_GATEWAY_PASSWORD"])
    cfg = agent_config(tmp_path, "host1", models, fake_binary(tmp_path / "bin"))
    logs = contextlib.ExitStack()
    captured = logs.enter_context(structlog.testing.capture_logs())
    stop = asyncio.Event()
    gw = Gateway(GatewaySettings(port=0))
    tasks = [
        asyncio.create_task(run_planner(auth_server.url, stop, auth=users["planner"])),
        asyncio.create_task(run_agent(cfg, auth_server.url, stop, auth=users["agent-host1"])),
        asyncio.create_task(run_gateway(auth_server.url, stop, gateway_auth, gateway=gw)),
    ]
    errors: list[str] = []
    nc = None
    try:
        # ---- it reads: the lane, its host's report and the config revision reach the view
        lane = await eventually(lambda: next(iter(gw.view.routable("llama8")), None), timeout=40, what="lane routable")
        assert lane.host_id == "host1" and gw.view.synced
        assert "host1" in gw.view.reports and gw.view.config is not None

        # ---- it writes nothing: every put and every request to the planner is refused
        # its NATS user, then its instance: the ids it may report activity under are the user's
        assert gw.gateway_id.startswith("gateway.") and gw.gateway_id.count(".") == 1, gw.gateway_id
        nc = await _connect(auth_server.url, gateway_auth, errors, inbox_prefix=subjects.gateway_inbox("gateway"))
        kv = await nc.jetstream(timeout=1.0).key_value(subjects.BUCKET)
        assert (await kv.get(subjects.plan_key("host1"))).value  # reading a key is allowed
        status_key = subjects.status_key("host1")
        for key in (subjects.plan_key("host1"), status_key, subjects.report_key("host1"), subjects.CONFIG_KEY,
                    subjects.DEMAND_KEY):  # fmt: skip
            with pytest.raises(nats.errors.TimeoutError):
                await kv.put(key, b"{}")
            subject = subjects.kv_subject(key).lower()
            await eventually(lambda: any(f'publish to "{subject}"' in e for e in errors), timeout=5, what=subject)
        change = encode(ConfigSet(changes={"kv_cache_type": "q8_0"}))
        with pytest.raises((nats.errors.TimeoutError, nats.errors.NoRespondersError)):
            await nc.request(subjects.CONFIG_SET, change, timeout=1)
        await nc.publish(subjects.event_subject("host1", "llama8-0", "crashed"), b"{}")
        await nc.flush()
        for subject in (subjects.CONFIG_SET, subjects.event_subject("host1", "llama8-0", "crashed")):
            await eventually(lambda: any(f'publish to "{subject}"' in e for e in errors), timeout=5, what=subject)
        # Models on demand: it may ask the planner to load a model and report its own activity, nothing more.
        await nc.publish(subjects.wake_subject("llama8"), encode(ModelWake(name="llama8", gateway="gateway")))
        await nc.publish(subjects.activity_subject("gateway"), encode(GatewayActivity(gateway="gateway")))
        # ... and ask a hot lane to spread its conversations (docs/slot-cache.md, "Hot spots")
        await nc.publish(subjects.slot_ask_subject("host1"),
                         encode(SlotsAsk(host="host1", lane="llama8-0", to_host="host2", to_lane="llama8-0")))
        await nc.flush()
        await asyncio.sleep(0.3)
        assert not [e for e in errors if "lanes.wake" in e or "lanes.activity" in e or "lanes.slots" in e], errors
        # ... not as another gateway, not deleting a consumer (the planner's watch), not reading others' replies
        other = subjects.activity_subject("gateway2")
        await nc.publish(other, encode(GatewayActivity(gateway="gateway2")))
        await nc.publish(subjects.activity_subject("gateway2.b"), encode(GatewayActivity(gateway="gateway2.b")))
        await nc.publish("$JS.API.CONSUMER.DELETE.KV_lanes.any", b"")
        await nc.flush()
        for subject in (other, "lanes.activity.gateway2.b", "$js.api.consumer.delete.kv_lanes.any"):
            await eventually(lambda: any(f'publish to "{subject}"' in e for e in errors), timeout=5, what=subject)
        # Tenants' usage: its own keys of the lanes-usage bucket only (the service created the bucket).
        usage = await eventually(lambda: nc.jetstream(timeout=1.0).key_value(subjects.USAGE_BUCKET), timeout=10,
                                 what="the usage bucket")  # fmt: skip
        mine = TenantUsage(tenant="team", gateway="gateway", day_tokens=5.0)
        assert await usage.put(subjects.usage_key("team", "gateway"), encode(mine)) > 0
        with pytest.raises(nats.errors.TimeoutError):
            await usage.put(subjects.usage_key("team", "gateway2"), encode(mine))
        await eventually(lambda: any('publish to "$kv.lanes-usage.usage.team.gateway2"' in e for e in errors), timeout=5,
                         what="another gateway's usage key refused")  # fmt: skip
        await nc.subscribe("_INBOX.>")
        await eventually(lambda: any('subscription to "_inbox.>"' in e for e in errors), timeout=5,
                         what="_INBOX.> refused")  # fmt: skip
        # ---- lanes' keys: the gateway reads them; the planner and the agents cannot
        keyed = await eventually(lambda: next((r for r in gw.view.routable("llama8") if r.api_key), None),
                                 timeout=10, what="the lane's key read from lanes-secrets")  # fmt: skip
        assert keyed.api_key == (cfg.data_dir / "lanes" / "llama8-0.key").read_text().strip()
        secret_key = subjects.lane_secret_key("host1", "llama8-0")
        for user, inbox in (("planner", None), ("agent-host1", subjects.agent_inbox("host1"))):
            said: list[str] = []
            other = await _connect(auth_server.url, users[user], said, **({"inbox_prefix": inbox} if inbox else {}))
            try:
                stream = subjects.SECRETS_STREAM
                for subject in (f"$JS.API.DIRECT.GET.{stream}.$KV.{subjects.SECRETS_BUCKET}.{secret_key}",
                                f"$JS.API.STREAM.MSG.GET.{stream}", f"$JS.API.CONSUMER.CREATE.{stream}",
                                f"$JS.API.CONSUMER.CREATE.{stream}.x.$KV.{subjects.SECRETS_BUCKET}.>",
                                f"$JS.API.CONSUMER.DURABLE.CREATE.{stream}.x", f"$JS.API.STREAM.UPDATE.{stream}",
                                f"$JS.API.STREAM.CREATE.{stream}" if user != "planner" else "$JS.API.STREAM.CREATE.copy"):  # fmt: skip
                    with pytest.raises((nats.errors.TimeoutError, nats.errors.NoRespondersError)):
                        await other.request(subject, b'{"last_by_subj":"$KV.lanes-secrets.>"}', timeout=1)
                    await eventually(lambda: any(f'publish to "{subject.lower()}"' in e for e in said), timeout=5,
                                     what=f"{user} refused {subject}")  # fmt: skip
                await other.subscribe(f"$KV.{subjects.SECRETS_BUCKET}.>")
                await eventually(lambda: any("subscription to \"$kv.lanes-secrets.>\"" in e for e in said),
                                 timeout=5, what=f"{user} refused the secrets' subjects")  # fmt: skip
            finally:
                await other.close()
        # An agent puts its own lanes' keys only.
        said = []
        agent_nc = await _connect(auth_server.url, users["agent-host1"], said, inbox_prefix=subjects.agent_inbox("host1"))
        try:
            bucket = await agent_nc.jetstream(timeout=1.0).key_value(subjects.SECRETS_BUCKET)
            for key in (subjects.lane_secret_key("host2", "llama8-0"), subjects.SESSION_SECRET_KEY):
                with pytest.raises(nats.errors.TimeoutError):
                    await bucket.put(key, b"{}")
                subject = f"$kv.lanes-secrets.{key}"
                await eventually(lambda: any(f'publish to "{subject}"' in e for e in said), timeout=5, what=subject)
        finally:
            await agent_nc.close()
        # The dashboard's cookie secret: the gateway put it there (not derived from any key).
        assert gw.app[COOKIE_SECRET].shared
        # The refused config change did not happen, and the lane is still there and routable.
        assert gw.view.config.kv_cache_type is None
        await asyncio.sleep(0.5)
        assert gw.view.routable("llama8")
        # The gateway service itself was refused nothing while it ran.
        refused = [e for e in captured if "permissions violation" in str(e.get("error", "")).lower()]
        assert not refused, refused
    finally:
        if nc is not None:
            await nc.close()
        stop.set()
        await asyncio.wait_for(asyncio.gather(*tasks, return_exceptions=True), 30)
        logs.close()


async def test_gateways_sharing_one_nats_user_keep_their_usage_and_activity_apart(auth_server, passwords):
    """Two replicas on user `gateway` (what `--scale gateway=2` runs): each has its own id, its
    own usage keys and activity subject, and neither overwrites the other's."""
    import time

    from shared.messages.activity import GatewayActivity as Activity
    from shared.messages.wire import decode

    users = _users(passwords)
    gateway_auth = NatsAuth(user="gateway", password=passwords["NATS_GATEWAY_PASSWORD"])
    stop = asyncio.Event()
    first, second = Gateway(GatewaySettings(port=0)), Gateway(GatewaySettings(port=0))
    planner = asyncio.create_task(run_planner(auth_server.url, stop, auth=users["planner"]))
    heard: dict[str, str] = {}  # subject -> the gateway its report names
    admin = await _connect(auth_server.url, users["admin"])

    async def on_activity(msg) -> None:
        heard[msg.subject] = decode(msg.data, Activity).gateway

    await admin.subscribe(subjects.ALL_ACTIVITY, cb=on_activity)
    tasks = [asyncio.create_task(run_gateway(auth_server.url, stop, gateway_auth, gateway=g)) for g in (first, second)]
    try:
        for g in (first, second):
            await asyncio.wait_for(g.started.wait(), 10)
        ids = {first.gateway_id, second.gateway_id}
        assert len(ids) == 2 and all(i.startswith("gateway.") for i in ids), ids
        # Each counts a tenant's tokens; both counts land in NATS, under two keys.
        from gateway.edge import USAGE

        now = time.time()
        first.app[USAGE].add("team", 100.0, now)
        second.app[USAGE].add("team", 7.0, now)
        usage = await eventually(lambda: admin.jetstream(timeout=2).key_value(subjects.USAGE_BUCKET), timeout=10,
                                 what="the usage bucket")  # fmt: skip

        async def both_counted() -> dict[str, float] | None:
            found = {}
            for gw in (first, second):
                try:
                    entry = await usage.get(subjects.usage_key("team", gw.gateway_id))
                except Exception:
                    return None
                found[gw.gateway_id] = decode(entry.value, TenantUsage).day_tokens
            return found

        counted = await eventually(both_counted, timeout=20, what="both gateways' usage keys")
        assert counted == {first.gateway_id: 100.0, second.gateway_id: 7.0}
        # ... and each sees the other's: the tenant's day is the sum at both doors.
        await eventually(lambda: all(g.app[USAGE].used("team", time.time())[1] == 107.0 for g in (first, second)),
                         timeout=20, what="each gateway sees both counts")  # fmt: skip
        # Activity: one subject each, the report naming its sender, none refused by the server.
        await eventually(lambda: {heard.get(subjects.activity_subject(g)) for g in ids} == ids, timeout=20,
                         what="both gateways' activity")  # fmt: skip
    finally:
        stop.set()
        await asyncio.wait_for(asyncio.gather(planner, *tasks, return_exceptions=True), 30)
        await admin.close()
