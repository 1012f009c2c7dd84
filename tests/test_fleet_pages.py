"""The fleet's status in pages (issue 37, point 1): at 10,000 simulated hosts no page is over
256 KiB, the pages cover every host once, filters narrow them, and the summary stays small."""

from __future__ import annotations

import msgspec
import pytest
from planner_bench import fleet as simulated_fleet

from planner_svc.fleet_pages import NAMED_HOSTS, PAGE_BYTES, Fleet, hosts_value, models_value, page, summary
from planner_svc.planner import plan
from shared.messages.activity import ModelState, ModelStates
from shared.messages.config import FleetConfig
from shared.messages.replies import FleetQuery, FleetStatus, HostLiveness
from shared.messages.status import HostStatus, LaneFeedback, LaneStatus

HEAD = FleetStatus(config=FleetConfig(), planner_id="p1")


def _fleet(n: int) -> Fleet:
    reports = simulated_fleet(n)
    plans = plan(reports, FleetConfig(kv_cache_type="q8_0")).hosts
    statuses = {}
    for i, p in enumerate(plans):
        state = "failed" if i % 1000 == 7 else "healthy"
        lanes = tuple(LaneStatus(lane_id=s.lane_id, state=state, port=s.port, pid=1000 + i, ctx_total=s.ctx_total,
                                 planned_bytes=s.memory.total_bytes, rss_bytes=s.memory.total_bytes // 2,
                                 argv=("llama-server", "--model", s.model_path, "--ctx-size", str(s.ctx_total)))
                      for s in p.lanes)  # fmt: skip
        feedback = (LaneFeedback(lane_id=p.lanes[0].lane_id, model=p.lanes[0].model, kind="oom"),) if state == "failed" else ()
        statuses[p.host_id] = HostStatus(host_id=p.host_id, plan_revision=p.plan_revision, lanes=lanes, feedback=feedback)
    liveness = tuple(HostLiveness(host_id=r.host_id, state="lost" if i % 500 == 3 else "live") for i, r in enumerate(reports))
    models = tuple(ModelState(name=m.name, model=m.name, state="loaded",
                              hosts=tuple(p.host_id for p in plans if any(s.model == m.name for s in p.lanes)),
                              holders=tuple(r.host_id for r in reports)) for m in reports[0].models)  # fmt: skip
    return Fleet(reports={r.host_id: r for r in reports}, plans={p.host_id: p for p in plans}, statuses=statuses,
                 liveness=liveness, models=models)  # fmt: skip


@pytest.fixture(scope="module")
def big() -> Fleet:
    return _fleet(10_000)


def _pages(fleet: Fleet, query: FleetQuery) -> list[FleetStatus]:
    totals = summary(fleet)  # as the planner keeps it between pages
    pages = [page(fleet, query, HEAD, totals)]
    while pages[-1].next_after:
        pages.append(page(fleet, msgspec.structs.replace(query, after=pages[-1].next_after), HEAD, totals))
        assert len(pages) <= 10_000
    return pages


def test_every_page_of_ten_thousand_hosts_is_under_256_kib_and_every_host_comes_once(big):
    whole = len(msgspec.json.encode(FleetStatus(reports=tuple(big.reports.values()), plans=tuple(big.plans.values()),
                                                statuses=tuple(big.statuses.values()), hosts=tuple(big.liveness))))  # fmt: skip
    assert whole > 40 * 2**20  # what one reply held before: 40 times NATS's 1 MiB maximum payload
    pages = _pages(big, FleetQuery(limit=1000))
    sizes = [len(msgspec.json.encode(p)) for p in pages]
    assert max(sizes) <= PAGE_BYTES, max(sizes)
    shown = [h.host_id for p in pages for h in p.hosts]
    assert shown == sorted(big.reports) and len(shown) == 10_000  # in order, each once
    assert all(p.matched == 10_000 and p.summary == pages[0].summary for p in pages)
    first = pages[0]
    assert {r.host_id for r in first.reports} == {p.host_id for p in first.plans} == {h.host_id for h in first.hosts}
    assert all(set(m.hosts) <= {h.host_id for h in first.hosts} for m in first.models)  # the models name the page only
    assert len(_pages(big, FleetQuery(limit=7))[0].hosts) == 7


def test_the_summary_counts_the_whole_fleet_and_stays_small(big):
    s = summary(big)
    assert len(msgspec.json.encode(s)) < 4096
    assert (s.hosts, s.hosts_lost) == (10_000, 20)
    lanes = {(x.model, x.state): x.lanes for x in s.lanes}
    total = sum(len(p.lanes) for p in big.plans.values())
    assert sum(lanes.values()) == total and sum(n for (_, st), n in lanes.items() if st == "failed") == s.lane_errors
    assert s.lane_errors == sum(len(big.plans[h].lanes) for h in big.plans if big.statuses[h].lanes[0].state == "failed")
    assert s.feedback == 10 and s.planned_bytes == sum(x.memory.total_bytes for p in big.plans.values() for x in p.lanes)


def test_filters_narrow_the_pages(big):
    one = page(big, FleetQuery(host="host-00042"), HEAD)
    assert [h.host_id for h in one.hosts] == ["host-00042"] and one.matched == 1 and not one.next_after
    prefix = _pages(big, FleetQuery(host="host-001*", limit=1000))
    assert [h.host_id for p in prefix for h in p.hosts] == [f"host-{i:05d}" for i in range(100, 200)]
    lost = _pages(big, FleetQuery(state="lost", limit=1000))
    assert [h.host_id for p in lost for h in p.hosts] == [f"host-{i:05d}" for i in range(3, 10_000, 500)]
    failed = _pages(big, FleetQuery(state="failed", limit=1000))
    assert [h.host_id for p in failed for h in p.hosts] == [f"host-{i:05d}" for i in range(7, 10_000, 1000)]
    model = next(iter(big.plans.values())).lanes[0].model
    with_model = page(big, FleetQuery(model=model, limit=1000), HEAD)
    assert with_model.matched == sum(any(s.model == model for s in p.lanes) for p in big.plans.values())
    assert with_model.hosts and all(any(s.model == model for s in p.lanes) for p in with_model.plans)
    assert page(big, FleetQuery(model="no-such-model"), HEAD).hosts == ()


def test_a_page_after_the_last_host_is_empty_and_says_no_more(big):
    last = page(big, FleetQuery(after="host-09999"), HEAD)
    assert last.hosts == () and last.next_after == "" and last.matched == 10_000


def test_the_hosts_and_models_keys_stay_small_at_ten_thousand_hosts(big):
    """Every gateway reads them: they held every host (0.7 and 0.75 MiB at 10,000, past NATS's
    1 MiB near 15,000). Now the `hosts` key lists the hosts that are not live, and each model
    names a few of its hosts and counts them all."""
    hosts = hosts_value(big.liveness)
    assert hosts.total == 10_000 and {h.state for h in hosts.hosts} == {"lost"} and len(hosts.hosts) == 20
    assert len(msgspec.json.encode(hosts)) < 4096
    models = models_value(ModelStates(models=tuple(big.models)))
    assert len(msgspec.json.encode(models)) < 16 * 1024
    assert len(msgspec.json.encode(ModelStates(models=tuple(big.models)))) > 256 * 1024  # uncut
    for cut, whole in zip(models.models, big.models):
        assert cut.holders == whole.holders[:NAMED_HOSTS] and cut.holder_count == len(whole.holders) == 10_000
        assert cut.host_count == len(whole.hosts) and cut.hosts == whole.hosts[:NAMED_HOSTS]
    few = ModelStates(models=(ModelState(name="m", model="m", hosts=("a",), holders=("a", "b")),))
    assert models_value(few) == few  # nothing to cut: the lists are whole and counted 0


async def test_lanes_status_reads_a_thousand_hosts_in_pages(nats_server):
    """The issue's failure: with 1,000 more hosts' reports in the bucket, `lanes status` and
    `lanes status --json` ended with MaxPayloadError. Now: the summary and a first page, every
    page on request, filters, each reply under 256 KiB."""
    import asyncio
    import json
    import subprocess
    import sys

    from fixtures_bus import client, services
    from waiting import eventually

    from shared import subjects
    from shared.bus import kv_bucket
    from shared.messages.wire import encode

    def lanes(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "lanes.cli", "status", "--nats", nats_server.url, *args],
                              capture_output=True, text=True, timeout=120)  # fmt: skip

    reports = simulated_fleet(1000)
    async with services(nats_server.url) as s, client(nats_server.url) as nc:
        s.start_planner()
        kv = await eventually(lambda: kv_bucket(nc), what="the planner made the bucket")
        for report in reports:
            await kv.put(subjects.report_key(report.host_id), encode(report))

        async def planned():
            reply = await nc.request(subjects.FLEET_STATUS, b"", timeout=10)
            fleet = msgspec.json.decode(reply.data, type=FleetStatus)
            return fleet if fleet.summary and fleet.summary.hosts == 1000 and fleet.summary.planned_bytes else None

        first = await eventually(planned, timeout=120, what="the planner planned 1,000 hosts")
        assert len(first.hosts) < 1000 and first.next_after and first.matched == 1000

        shown = await asyncio.to_thread(lanes)
        assert shown.returncode == 0, shown.stderr
        assert "fleet: 1000 host(s), 0 lost" in shown.stdout
        assert "of 1000 host(s) shown; the next page: lanes status --after host-" in shown.stdout
        every = await asyncio.to_thread(lanes, "--all", "--json", "--limit", "1000")
        assert every.returncode == 0, every.stderr
        pages = every.stdout.splitlines()
        assert all(len(line.encode()) <= 256 * 1024 for line in pages) and len(pages) > 1
        hosts = [h["host_id"] for line in pages for h in json.loads(line)["hosts"]]
        assert hosts == sorted(r.host_id for r in reports)
        one = await asyncio.to_thread(lanes, "--host", "host-00042", "--json")
        assert [h["host_id"] for h in json.loads(one.stdout)["hosts"]] == ["host-00042"]
