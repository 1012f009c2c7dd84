"""The agent's pure decisions about running lanes: health.transition and drain.decide, every transition."""

from __future__ import annotations

import msgspec
import pytest

from launcher_agent import health
from launcher_agent.drain import DRAIN_GRACE, IDLE_SETTLE, decide, idle_after, to_ask, verdict
from launcher_agent.health import CheckUse, Failed, LaneHealth, Outcome, PortBusy, Probe, Rules, transition
from launcher_agent.reconcile import MAX_FAILURES, Restart, Start, Stop, backoff
from shared.messages.plans import LaneSpec

SPEC = LaneSpec(lane_id="a", model="m", model_path="/m.gguf", alias="m", port=8080, ctx_total=4096,
                ctx_per_slot=2048, parallel=2, args=("--ctx-size", "4096"))  # fmt: skip
OLD = msgspec.structs.replace(SPEC, ctx_total=2048, args=("--ctx-size", "2048"))  # what it ran before the change
RULES = Rules(backoff_base=1.0, probe_interval=5.0, probe_failures=3)


def lane(state: str, **kw) -> LaneHealth:
    return LaneHealth(spec=SPEC, state=state, **kw)


def step(h: LaneHealth, probe: Probe = Probe(), now: float = 100.0) -> Outcome:
    return transition(h, probe, now=now, rules=RULES)


# ------------------------------------------------------------------ what to ask


@pytest.mark.parametrize(
    "h, now, ask",
    [
        (lane("starting"), 0, "ready"),
        (lane("loading"), 0, "ready"),
        (lane("healthy", next_probe=10), 10, "alive"),
        (lane("healthy", next_probe=10), 9.9, None),
        (lane("mismatch"), 0, None),
        (lane("unresponsive"), 0, None),
        (lane("crashed"), 0, None),
    ],
)
def test_what_to_probe(h, now, ask):
    assert health.what_to_probe(h, now) == ask


# ------------------------------------------------------------------ coming up


def test_a_lane_that_answers_with_the_planned_shape_turns_healthy():
    out = step(lane("loading", last_error="old"), Probe(ready=("healthy", "")))
    h = out.health
    assert (h.state, h.healthy_since, h.last_error, h.last_good) == ("healthy", 100.0, "", SPEC)
    assert out.events == (("healthy", ""),) and out.feedback == (CheckUse(),)
    assert not out.kill and not out.exited


def test_a_lane_serving_another_shape_is_a_mismatch():
    out = step(lane("starting"), Probe(ready=("mismatch", "serves 4096 x 1")))
    assert (out.health.state, out.health.last_error) == ("mismatch", "serves 4096 x 1")
    assert out.events == (("mismatch", "serves 4096 x 1"),) and out.feedback == ()


def test_a_lane_that_does_not_answer_yet_is_loading():
    out = step(lane("starting"), Probe(ready=("loading", "/health answered 503")))
    assert out.health == lane("loading") and out.events == () and out.feedback == ()


def test_a_mismatched_lane_that_runs_is_left_alone():
    assert step(lane("mismatch", last_error="x")) == Outcome(lane("mismatch", last_error="x"))


# ------------------------------------------------------------------ serving


def test_a_serving_lane_between_probes_is_checked_against_its_plan():
    h = lane("healthy", next_probe=200.0, healthy_since=90.0)
    assert step(h) == Outcome(h, feedback=(CheckUse(),))


def test_failures_are_forgotten_after_a_while_healthy():
    assert step(lane("healthy", failures=2, healthy_since=60.0, next_probe=1e9)).health.failures == 0
    assert step(lane("healthy", failures=2, healthy_since=80.0, next_probe=1e9)).health.failures == 2


def test_an_answer_clears_missed_probes_and_schedules_the_next():
    out = step(lane("healthy", missed_probes=2), Probe(alive=True))
    assert (out.health.missed_probes, out.health.next_probe, out.health.state) == (0, 105.0, "healthy")


def test_missed_probes_make_a_lane_unresponsive_at_the_limit():
    out = step(lane("healthy", missed_probes=1), Probe(alive=False))
    assert (out.health.missed_probes, out.health.state, out.events) == (2, "healthy", ())
    out = step(out.health, Probe(alive=False), now=105.0)
    why = "unresponsive: no answer to 3 /health probes in a row"
    assert (out.health.state, out.health.last_error, out.health.next_probe) == ("unresponsive", why, 110.0)
    assert out.events == (("unresponsive", why),) and not out.kill


# ------------------------------------------------------------------ a stalled inference loop


def looks(h: LaneHealth, *seen, start: float = 100.0, every: float = 5.0) -> list[Outcome]:
    """Alive probes one interval apart, each with what /slots said (None: unanswered)."""
    out = []
    for i, loop in enumerate(seen):
        out.append(step(h, Probe(alive=True, loop=loop), now=start + i * every))
        h = out[-1].health
    return out


STALL = RULES.stall_seconds  # 120 s: above the longest prompt batch measured


def prefill(tokens: int, done: int) -> tuple:
    """/slots of one busy slot in task 40: the counters the binary moves once per batch."""
    return ((40, tokens, done, 0),)


def test_a_long_prefill_that_moves_a_batch_at_a_time_is_never_stalled():
    # A batch every 20 s (2048 tokens at ~100 tok/s), looked at every 5 s: the counters stand still
    # in between (as recorded), and move before stall_seconds pass.
    seen = [prefill(2048 * (i // 4 + 1), 2048 * (i // 4)) for i in range(60)]
    outs = looks(lane("healthy"), *seen)
    assert all(o.health.state == "healthy" for o in outs)


def test_a_generation_that_decodes_tokens_is_never_stalled():
    outs = looks(lane("healthy"), *[((40, 2501 + n, 2501, n),) for n in range(1, 60)])
    assert all(o.health.state == "healthy" and o.health.stuck_since is None for o in outs)


@pytest.mark.parametrize("stuck", [None, prefill(1985, 1), ((40, 2511, 2501, 10),)],
                         ids=["slots-unanswered", "stuck-prefill", "stuck-generation"])  # fmt: skip
def test_a_loop_without_progress_for_stall_seconds_makes_the_lane_unresponsive(stuck):
    looks_needed = int(STALL / 5)  # one look every 5 s
    first = stuck if stuck is not None else ((40, 2511, 2501, 9),)  # seen once working, then no progress
    outs = looks(lane("healthy"), first, *[stuck] * (looks_needed + 1))
    assert [o.health.state for o in outs[:-1]] == ["healthy"] * (looks_needed + 1)
    last = outs[-1]
    assert last.health.state == "unresponsive" and last.health.last_error.startswith("stalled: ")
    assert last.events == (("unresponsive", last.health.last_error),)
    what = "/slots unanswered" if stuck is None else "busy slots processed no prompt batch and no token"
    assert what in last.health.last_error and "/health answers" in last.health.last_error
    assert step(last.health) == Outcome(last.health, kill=True)  # then killed and restarted like a wedged lane


def test_progress_resets_the_stall_clock_and_an_idle_loop_is_fine():
    outs = looks(lane("healthy"), *[None] * 20, (), *[None] * 20, prefill(10, 1), *[prefill(10, 1)] * 20)
    assert all(o.health.state == "healthy" for o in outs)
    assert looks(lane("healthy"), *[()] * 60)[-1].health.stuck_since is None
    # A /health miss is the older rule's: /slots is not read into progress then.
    h = lane("healthy", stuck_since=50.0)
    assert step(h, Probe(alive=False, loop=None)).health.stuck_since == 50.0
    # Not asked this tick: nothing changes.
    assert step(h, Probe(alive=True)).health.stuck_since == 50.0


def test_a_lane_healthy_again_starts_a_fresh_stall_clock():
    out = step(lane("loading", stuck_since=1.0, loop_mark=((1, 1, 1, 1),)), Probe(ready=("healthy", "")))
    assert (out.health.stuck_since, out.health.loop_mark) == (None, ())


def test_an_unresponsive_lane_is_killed():
    h = lane("unresponsive", last_error="unresponsive: no answer")
    assert step(h) == Outcome(h, kill=True)


# ------------------------------------------------------------------ exits


def test_an_exit_after_the_lane_ended_changes_nothing():
    for state in ("crashed", "failed", "stopped"):
        assert step(lane(state), Probe(returncode=1)) == Outcome(lane(state))


def test_a_crash_backs_off():
    out = step(lane("healthy", failures=1), Probe(returncode=-11, tail=("I build: 1", "Segmentation fault")))
    h = out.health
    assert (h.state, h.failure, h.failures, h.retry_at) == ("crashed", "other", 2, 100.0 + backoff(2))
    assert h.last_error == "exit -11: Segmentation fault"
    assert out.events == (("crashed", h.last_error),) and out.feedback == () and out.exited and out.halts is None


def test_a_killed_unresponsive_lane_restarts_like_a_crash():
    out = step(lane("unresponsive", last_error="unresponsive: no answer to 3"), Probe(returncode=-9, tail=("x",)))
    assert (out.health.state, out.health.failure) == ("crashed", "unresponsive")
    assert out.health.last_error == "exit -9: unresponsive: no answer to 3"


def test_port_taken_at_start_fails_the_lane_and_is_fed_back():
    line = "E srv    start: couldn't bind HTTP server socket, hostname: 127.0.0.1, port: 8080"
    out = step(lane("starting"), Probe(returncode=1, tail=(line,)))
    assert (out.health.state, out.health.failure) == ("failed", "port_busy")
    assert out.feedback == (PortBusy(line),) and out.events == (("failed", f"exit 1: {line}"),)


@pytest.mark.parametrize(
    "line, kind",
    [("E llama_init_from_model: quantized V cache requires flash_attn to be enabled", "unsupported"),
     ("E ggml_backend_cpu_buffer_type_alloc_buffer: failed to allocate buffer of size 536870912", "oom")],
)  # fmt: skip
def test_a_refusal_at_start_fails_the_lane(line, kind):
    out = step(lane("loading"), Probe(returncode=1, tail=(line, "E main: exiting due to model loading error")))
    assert (out.health.state, out.health.failure) == ("failed", kind)
    assert out.feedback == (Failed(kind, line),) and out.events == (("failed", f"exit 1: {line}"),)
    assert out.halts is None


def test_a_change_that_breaks_a_lane_at_start_fails_it_and_halts_the_rollout():
    out = step(lane("loading", last_good=OLD), Probe(returncode=1, tail=("Segmentation fault",)))
    assert (out.health.state, out.health.failure) == ("failed", "other")
    assert out.feedback == (Failed("other", "Segmentation fault"),)
    assert out.halts == "a failed with the change: Segmentation fault"


def test_a_lane_that_keeps_crashing_is_a_crash_loop():
    out = step(lane("healthy", failures=MAX_FAILURES - 1), Probe(returncode=1, tail=("boom error",)))
    assert (out.health.state, out.health.failure, out.health.failures) == ("failed", "crash_loop", MAX_FAILURES)
    assert out.feedback == (Failed("crash_loop", "boom error"),)
    assert out.events == (("failed", f"crash loop: {MAX_FAILURES} failures; exit 1: boom error"),)


# ------------------------------------------------------------------ drain


def test_drain_verdicts():
    def v(since, now, busy=0, timeout=30.0, serving=True, idle_since=None):
        return verdict(serving=serving, since=since, now=now, busy=busy, timeout=timeout, idle_since=idle_since)

    assert v(None, 0, serving=False) == "go"
    assert v(None, 0) == "begin"
    assert v(0, 0.1, idle_since=0) == "wait"  # gateways may not have seen the mark yet
    assert v(0, DRAIN_GRACE, idle_since=DRAIN_GRACE) == "wait"  # idle once: an answer may still be sending
    assert v(0, DRAIN_GRACE + IDLE_SETTLE, idle_since=DRAIN_GRACE) == "done"  # idle for the settle time
    assert v(0, DRAIN_GRACE + IDLE_SETTLE, idle_since=None) == "wait"  # never seen idle
    assert v(0, DRAIN_GRACE, busy=None) == "done"  # nothing answers: nothing serves
    assert v(0, 29.9, busy=2) == "wait"
    assert v(0, 30, busy=2) == "timed_out"
    assert v(0, 0, busy=1, timeout=0) == "timed_out"  # drain_timeout 0: no drain


def _spec(lane_id: str) -> LaneSpec:
    return msgspec.structs.replace(SPEC, lane_id=lane_id)


def test_drain_decide_over_a_pass():
    restart_a, stop_b, restart_c = Restart(_spec("a"), "x"), Stop("b", "x"), Restart(_spec("c"), "x")
    start_d = Start(_spec("d"), "x")
    states = {"a": "healthy", "b": "healthy", "c": "crashed"}
    # a begins, b is still busy, c does not serve, d is new.
    since = {"b": 10.0}
    assert to_ask([restart_a, stop_b, restart_c, start_d], since) == ["b"]
    d = decide([restart_a, stop_b, restart_c, start_d], states, since, {"b": 2}, now=12.0, timeout=30)
    assert d.ready == (restart_c, start_d) and d.begun == ("a",) and d.finished == () and d.dropped == ()
    assert d.since == {"a": 12.0, "b": 10.0} and since == {"b": 10.0}  # the input is not changed
    # b goes idle (seen once: it waits), a is out of time.
    d = decide([restart_a, stop_b], states, {"a": 11.0, "b": 12.0}, {"a": 3, "b": 0}, now=42.0, timeout=31)
    assert d.ready == (restart_a,) and d.finished == (("a", "timed_out", 31.0),)
    assert d.since == {"b": 12.0} and d.idle == {"b": 42.0}
    # b busy again for a moment (an answer was still going): its idle stretch starts over.
    d = decide([stop_b], states, d.since, {"b": 1}, now=42.1, timeout=31, idle=d.idle)
    assert d.ready == () and d.idle == {}
    d = decide([stop_b], states, d.since, {"b": 0}, now=42.2, timeout=31, idle=d.idle)
    assert d.ready == () and d.idle == {"b": 42.2}
    d = decide([stop_b], states, d.since, {"b": 0}, now=42.2 + IDLE_SETTLE, timeout=31, idle=d.idle)
    assert d.ready == (stop_b,) and d.since == d.idle == {}
    ((lane, how, waited),) = d.finished
    assert (lane, how) == ("b", "done") and waited == pytest.approx(30.2 + IDLE_SETTLE)


def test_idle_stretches():
    assert idle_after(None, 0, 5.0) == 5.0 and idle_after(4.0, 0, 5.0) == 4.0 and idle_after(4.0, 2, 5.0) is None


def test_a_drain_the_plan_takes_back_is_dropped_and_a_draining_lane_that_crashed_still_waits():
    d = decide([], {"a": "healthy"}, {"a": 0.0}, {}, now=1.0, timeout=10)
    assert d.ready == () and d.dropped == ("a",) and d.since == {}
    restart = Restart(_spec("a"), "x")
    d = decide([restart], {"a": "crashed"}, {"a": 0.0}, {"a": 1}, now=1.0, timeout=10)
    assert d.ready == () and d.since == {"a": 0.0}
    d = decide([restart], {}, {"a": 0.0}, {}, now=1.0, timeout=10)  # the lane is gone: nothing to drain
    assert d.ready == (restart,) and d.dropped == ("a",)
