"""No failure in silence: supervised loops (shared/supervise.py), the restart decision alone, then
the planner, the agent and the gateway over a real nats-server with a failure injected into one
of their loops; a raising subscription callback or endpoint; an agent whose own report is out of
the bus's bounds."""

from __future__ import annotations

import asyncio
import time

import aiohttp
import pytest
import structlog
from fixtures_bus import agent_config, fake_binary, free_port_base
from hypothesis import given
from hypothesis import strategies as st
from prometheus_client.parser import text_string_to_metric_families
from waiting import eventually

from gateway.service import Gateway, run_gateway
from gateway.settings import GatewaySettings
from lanes import online
from lanes.cli import main
from launcher_agent.service import Agent, run_agent
from planner_svc import endpoints
from planner_svc.service import run_planner
from planner_svc.state import PlannerState
from shared import subjects, supervise
from shared.bus import connect
from shared.supervise import LoopGaveUp, Loops, RestartPolicy, after_failure, cancel_and_wait, running

FAST = RestartPolicy(base=0.01, cap=0.05, max_failures=3, window=60.0)


@pytest.fixture
def fast_restarts(monkeypatch):
    monkeypatch.setattr(supervise, "DEFAULT_POLICY", FAST)


@pytest.fixture
def cli_in_process(monkeypatch):
    """The CLI run in this process: its logging setup would cache structlog's loggers for the
    rest of the session (then capture_logs sees nothing), so it is left out."""
    monkeypatch.setattr(online, "setup_logging", lambda *a, **k: None)


# ---------------------------------------------------------------- the decision


def test_backoff_doubles_up_to_its_cap_and_gives_up_after_max_failures():
    policy = RestartPolicy(base=0.5, cap=3.0, max_failures=5, window=100.0)
    failures: tuple[float, ...] = ()
    delays, gave_up = [], []
    for now in (1.0, 2.0, 3.0, 4.0, 5.0):
        verdict = after_failure(failures, now, policy)
        failures = verdict.failures
        delays.append(verdict.delay)
        gave_up.append(verdict.give_up)
    assert delays == [0.5, 1.0, 2.0, 3.0, 3.0]
    assert gave_up == [False, False, False, False, True]


def test_failures_older_than_the_window_are_forgotten():
    policy = RestartPolicy(base=1.0, cap=60.0, max_failures=3, window=10.0)
    verdict = after_failure((0.0, 5.0), 20.0, policy)  # both earlier failures are past the window
    assert verdict.failures == (20.0,)
    assert (verdict.delay, verdict.give_up) == (1.0, False)
    verdict = after_failure((0.0, 15.0), 20.0, policy)  # one is still inside
    assert verdict.failures == (15.0, 20.0) and verdict.delay == 2.0


@given(
    times=st.lists(st.floats(min_value=0, max_value=1e4), max_size=20).map(sorted),
    base=st.floats(min_value=0.001, max_value=10),
    cap=st.floats(min_value=0.001, max_value=100),
    max_failures=st.integers(1, 10),
    window=st.floats(min_value=0.1, max_value=1e3),
)
def test_restart_decision_properties(times, base, cap, max_failures, window):
    policy = RestartPolicy(base=base, cap=cap, max_failures=max_failures, window=window)
    failures: tuple[float, ...] = ()
    for now in times:
        verdict = after_failure(failures, now, policy)
        assert 0 < verdict.delay <= cap
        assert verdict.failures[-1] == now and all(now - t < window for t in verdict.failures[:-1])
        assert verdict.give_up == (len(verdict.failures) >= max_failures)
        failures = verdict.failures


# ---------------------------------------------------------------- the loop runner


async def test_a_loop_that_fails_once_is_restarted_and_counted():
    stop = asyncio.Event()
    runs = []

    async def step():
        runs.append(1)
        if len(runs) == 1:
            raise RuntimeError("injected")
        await stop.wait()

    loops = Loops("test", FAST)
    with structlog.testing.capture_logs() as logs:
        task = loops.task("work", step, stop)
        await eventually(lambda: len(runs) == 2, what="second run")
        stop.set()
        await asyncio.wait_for(task, 5)
    assert loops.restarts == {"work": 1}
    failed = [e for e in logs if e["event"] == "loop failed"]
    assert len(failed) == 1 and failed[0]["loop"] == "work" and failed[0]["exc_info"] is True
    samples = [s for family in loops.collect() for s in family.samples]
    assert [(s.name, s.labels, s.value) for s in samples if s.name.endswith("_total")] == [
        ("lanes_loop_restarts_total", {"service": "test", "loop": "work"}, 1.0)
    ]
    # Failing until it has run a whole window since (an alert on it does not clear in between).
    failing = [(s.labels, s.value) for s in samples if s.name == "lanes_loop_failing"]
    assert failing == [({"service": "test", "loop": "work"}, 1.0)]
    assert loops.failing("work", now=loops.last_failure["work"] + FAST.window - 0.01)
    assert not loops.failing("work", now=loops.last_failure["work"] + FAST.window)
    started = [s.value for s in samples if s.name == "lanes_service_start_time_seconds"]
    assert started == [loops.started_at] and abs(loops.started_at - time.time()) < 60


async def test_a_clean_stop_counts_nothing():
    stop = asyncio.Event()
    started = asyncio.Event()

    async def step():
        started.set()
        await asyncio.sleep(3600)

    loops = Loops("test", FAST)
    task = loops.task("work", step, stop)
    await started.wait()
    stop.set()
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)
    assert loops.restarts == {"work": 0}


async def test_a_loop_that_keeps_failing_gives_up():
    runs = []

    async def step():
        runs.append(1)
        raise RuntimeError("always")

    loops = Loops("test", FAST)
    with pytest.raises(LoopGaveUp, match="'work' failed 3 times"):
        await asyncio.wait_for(loops.run("work", step, asyncio.Event()), 5)
    assert len(runs) == 3 and loops.restarts == {"work": 2}


async def test_a_loop_that_returns_early_is_restarted():
    stop = asyncio.Event()
    runs = []

    async def step():
        runs.append(1)
        if len(runs) > 1:
            await stop.wait()

    loops = Loops("test", FAST)
    task = loops.task("work", step, stop)
    await eventually(lambda: len(runs) == 2, what="second run")
    stop.set()
    await asyncio.wait_for(task, 5)
    assert loops.restarts == {"work": 1}


def _answer_and_cancel(answer: asyncio.Future, task: asyncio.Task) -> None:
    """A NATS answer and a cancel landing together: Python 3.11's wait_for returns the answer
    and drops the cancel (gh-86296). A killed planner's lease loop ran on this way, renewing
    a lease and rewriting plans from a stale view (test_on_demand failed in CI)."""
    answer.set_result(None)
    task.cancel()


async def test_a_cancel_dropped_by_wait_for_still_ends_a_supervised_loop():
    stop = asyncio.Event()
    answers: list[asyncio.Future] = []

    async def body():
        while running(stop):
            answers.append(asyncio.get_running_loop().create_future())
            await asyncio.wait_for(answers[-1], 30)

    loops = Loops("test", FAST)
    task = loops.task("work", body, stop)
    await eventually(lambda: answers, what="the first wait")
    _answer_and_cancel(answers[-1], task)
    with pytest.raises(asyncio.CancelledError):
        await asyncio.wait_for(task, 5)
    assert len(answers) == 1 and loops.restarts == {"work": 0}  # no second wait, no restart


async def test_a_stop_cancels_again_a_task_that_dropped_its_cancel():
    answers: list[asyncio.Future] = []

    async def unaware():  # a loop that does not look at running(): the stop must still end it
        while True:
            answers.append(asyncio.get_running_loop().create_future())
            await asyncio.wait_for(answers[-1], 30)

    task = asyncio.create_task(unaware())
    await eventually(lambda: answers, what="the first wait")
    answers[-1].set_result(None)
    await asyncio.wait_for(cancel_and_wait([task], every=0.05), 5)
    assert task.cancelled()


# ---------------------------------------------------------------- over real NATS


def _restarts(text: str, service: str, loop: str) -> float | None:
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == "lanes_loop_restarts_total" and sample.labels == {"service": service, "loop": loop}:
                return sample.value
    return None


async def _metrics(url: str) -> str:
    async with aiohttp.ClientSession() as http, http.get(url) as resp:
        return await resp.text()


async def _restarted_once(service: asyncio.Task, stop: asyncio.Event, calls: list, port: int, failed: tuple,
                          other: tuple) -> None:  # fmt: skip
    """The injected failure was counted once for its loop (none for another), the loop runs
    again, the service runs on; then it is stopped."""
    try:
        await eventually(lambda: len(calls) >= 3, what=f"the {failed} loop running again")
        text = await eventually(lambda: _metrics(f"http://127.0.0.1:{port}/metrics"), what="metrics")
        assert _restarts(text, *failed) == 1.0
        assert _restarts(text, *other) == 0.0
        assert not service.done()
    finally:
        stop.set()
        await asyncio.wait_for(service, 30)


def _fail_first(monkeypatch, cls, name: str, calls: list, times: int = 1):
    """Patch cls.name so its first `times` calls raise; every call is counted in `calls`."""
    real = getattr(cls, name)

    def patched(self, *args, **kwargs):
        calls.append(1)
        if len(calls) <= times:
            raise RuntimeError(f"injected failure {len(calls)}")
        return real(self, *args, **kwargs)

    monkeypatch.setattr(cls, name, patched)


async def test_planner_liveness_loop_restarts_after_a_failure(nats_server, monkeypatch, fast_restarts):
    calls: list = []
    _fail_first(monkeypatch, PlannerState, "check_liveness", calls)
    port = free_port_base(1)
    stop = asyncio.Event()
    planner = asyncio.create_task(run_planner(nats_server.url, stop, metrics_port=port, metrics_host="127.0.0.1"))
    await _restarted_once(planner, stop, calls, port, ("planner", "liveness"), ("planner", "replan"))


def test_planner_that_keeps_failing_exits_non_zero(nats_server, monkeypatch, fast_restarts, cli_in_process):
    calls: list = []
    _fail_first(monkeypatch, PlannerState, "check_liveness", calls, times=10**9)
    assert main(["planner", "--nats", nats_server.url]) == 1
    assert len(calls) == FAST.max_failures


def test_lanes_up_whose_planner_keeps_failing_stops_everything_and_exits_non_zero(tmp_path, monkeypatch,
                                                                                 fast_restarts, cli_in_process):  # fmt: skip
    calls: list = []
    _fail_first(monkeypatch, PlannerState, "check_liveness", calls, times=10**9)
    models = tmp_path / "models"
    models.mkdir()
    argv = ["up", "--models", str(models), "--data", str(tmp_path / "data"), "--llama-server",
            fake_binary(tmp_path / "bin"), "--nats-port", "0", "--gateway-port", "0", "--host-id", "local",
            "--port-base", str(free_port_base())]  # fmt: skip
    assert main(argv) == 1  # the agent and the gateway were stopped too, or this would not return
    assert len(calls) == FAST.max_failures


async def test_agent_that_keeps_failing_ends_its_run(nats_server, tmp_path, monkeypatch, fast_restarts):
    calls: list = []
    _fail_first(monkeypatch, Agent, "publish_report", calls, times=10**9)
    cfg = agent_config(tmp_path, "h1", tmp_path, fake_binary(tmp_path / "bin"), report_interval=0.05)
    with pytest.raises(LoopGaveUp, match="agent loop 'report'"):
        await asyncio.wait_for(run_agent(cfg, nats_server.url, asyncio.Event()), 30)


async def test_agent_report_loop_restarts_after_a_failure(nats_server, tmp_path, monkeypatch, fast_restarts):
    models = tmp_path / "models"
    models.mkdir()
    calls: list = []
    _fail_first(monkeypatch, Agent, "publish_report", calls)
    port = free_port_base(1)
    cfg = agent_config(tmp_path, "h1", models, fake_binary(tmp_path / "bin"), report_interval=0.2,
                       metrics_port=port, metrics_host="127.0.0.1")  # fmt: skip
    stop = asyncio.Event()
    agent = asyncio.create_task(run_agent(cfg, nats_server.url, stop))
    await _restarted_once(agent, stop, calls, port, ("agent", "report"), ("agent", "control"))


async def test_gateway_demand_loop_restarts_and_a_failing_one_stops_the_gateway(nats_server, monkeypatch,
                                                                                fast_restarts):  # fmt: skip
    calls: list = []
    real = Gateway.publish_activity

    async def publish_activity(self):
        calls.append(1)
        if len(calls) == 1 or fail_always.is_set():
            raise RuntimeError("injected")
        await real(self)

    fail_always = asyncio.Event()
    monkeypatch.setattr(Gateway, "publish_activity", publish_activity)
    gw = Gateway(GatewaySettings(port=0, activity_interval=0.05, wake_repeat=0.05))
    stop = asyncio.Event()
    serving = asyncio.create_task(run_gateway(nats_server.url, stop, gateway=gw))
    try:
        await eventually(lambda: len(calls) >= 3, what="the demand loop running again")
        text = await _metrics(gw.url + "/metrics")
        assert _restarts(text, "gateway", "demand") == 1.0
        assert not serving.done()
        fail_always.set()
        with pytest.raises(LoopGaveUp, match="gateway loop 'demand'"):
            await asyncio.wait_for(serving, 10)
    finally:
        stop.set()
        await asyncio.gather(serving, return_exceptions=True)


async def test_a_subscription_callback_that_raises_is_logged(nats_server):
    nc = await connect(nats_server.url, name="test", retry_forever=False)
    try:
        async def handler(msg):
            raise ValueError("handler broke")

        with structlog.testing.capture_logs() as logs:
            await nc.subscribe("test.raise", cb=handler)
            await nc.publish("test.raise", b"x")
            await nc.flush()
            failed = await eventually(lambda: [e for e in logs if e["event"] == "nats callback failed"],
                                      what="the failure logged")  # fmt: skip
        assert failed[0]["error"] == "handler broke" and isinstance(failed[0]["exc_info"], ValueError)
    finally:
        await nc.close()


async def test_an_endpoint_that_raises_is_logged_and_answered_500(nats_server, monkeypatch):
    async def broken(svc, req):
        raise ValueError("info broke")

    monkeypatch.setattr(endpoints, "_info", broken)
    stop = asyncio.Event()
    with structlog.testing.capture_logs() as logs:
        planner = asyncio.create_task(run_planner(nats_server.url, stop))
        try:
            nc = await connect(nats_server.url, name="test", retry_forever=False)
            try:
                reply = await eventually(lambda: nc.request(subjects.PLANNER_INFO, b"", timeout=1), what="an answer")
            finally:
                await nc.close()
        finally:
            stop.set()
            await asyncio.wait_for(planner, 30)
    assert reply.headers["Nats-Service-Error-Code"] == "500"
    failed = [e for e in logs if e["event"] == "endpoint failed"]
    assert [e["endpoint"] for e in failed] == ["info"] and failed[0]["exc_info"] is True


async def test_an_agent_whose_report_is_out_of_range_says_so(nats_server, tmp_path):
    """Its own options put the report past a bound (a report interval over a day): the planner
    would drop it, so the agent logs why instead of publishing it."""
    cfg = agent_config(tmp_path, "h1", tmp_path, fake_binary(tmp_path / "bin"), report_interval=100_000.0)
    stop = asyncio.Event()
    with structlog.testing.capture_logs() as logs:
        tasks = [asyncio.create_task(run_planner(nats_server.url, stop)),
                 asyncio.create_task(run_agent(cfg, nats_server.url, stop))]  # fmt: skip
        try:
            found = await eventually(lambda: [e for e in logs if e["event"].startswith("report out of range")],
                                     what="the agent's log line")  # fmt: skip
        finally:
            stop.set()
            await asyncio.wait_for(asyncio.gather(*tasks), 30)
    assert "report_interval" in found[0]["reason"]
