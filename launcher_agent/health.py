"""What each lane's process did since the last look, decided: came up, serves the wrong shape, died.

Pure: `transition` takes what the agent saw of one lane (a Probe) and returns the
lane's new health with the events to publish, the feedback to note and whether to
kill it; the supervisor looks and applies. A death is classified from llama-server's
own log lines: a refusal or an out-of-memory at start fails the lane (restarting the
same argv cannot help), other crashes back off and retry until they loop.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Literal

from launcher_agent.reconcile import MAX_FAILURES, backoff
from shared import defaults
from shared.lane_key import lane_key
from shared.llama.logs import classify_failure
from shared.messages.plans import LaneSpec

HEALTHY_RESETS_FAILURES_AFTER = 30.0
COMING_UP = ("starting", "loading")
ENDED = ("crashed", "failed", "stopped")


@dataclass(frozen=True)
class LaneHealth:
    """The part of a lane (launcher_agent.lane.Lane, same field names) that health decides."""

    spec: LaneSpec
    state: str = "starting"
    failures: int = 0
    retry_at: float = 0.0
    healthy_since: float | None = None
    last_error: str = ""
    failure: str | None = None
    last_good: LaneSpec | None = None
    next_probe: float = 0.0
    missed_probes: int = 0
    loop_mark: tuple = ()  # (task, tokens decoded) of each busy slot, as last seen
    stuck_since: float | None = None  # since when its inference loop has shown no progress

    @property
    def broken_by_change(self) -> bool:
        return self.last_good is not None and lane_key(self.last_good) != lane_key(self.spec)


@dataclass(frozen=True)
class Rules:
    backoff_base: float = 1.0
    probe_interval: float = defaults.PROBE_INTERVAL
    probe_failures: int = defaults.PROBE_FAILURES
    # Seconds without progress of the inference loop (its /slots unanswered, or busy slots
    # with the same counters) before the lane is stalled: above the longest prompt batch
    # (2048 tokens took 8 to 21 s for Gemma 270M on 2 cores: bench/RESULTS.md, "A busy loop").
    stall_seconds: float = defaults.STALL_SECONDS


@dataclass(frozen=True)
class Probe:
    """What the agent saw of one lane's process: its exit, its log's tail and the probe asked for."""

    returncode: int | None = None
    tail: tuple[str, ...] = ()
    ready: tuple[str, str] | None = None  # (loading | healthy | mismatch, detail), for a lane coming up
    alive: bool | None = None  # /health of a serving lane, when its probe was due
    # /slots of a serving lane, asked with /health: (task, tokens decoded) of each busy slot;
    # None: it did not answer in time; "unasked": not asked this tick.
    loop: tuple | None | Literal["unasked"] = "unasked"


# Feedback to note for the planner (launcher_agent.feedback).
@dataclass(frozen=True)
class CheckUse:
    """Compare what the lane uses (KV printed, resident memory) with its plan."""


@dataclass(frozen=True)
class PortBusy:
    detail: str


@dataclass(frozen=True)
class Failed:
    kind: str
    detail: str


Note = CheckUse | PortBusy | Failed


@dataclass(frozen=True)
class Outcome:
    health: LaneHealth
    events: tuple[tuple[str, str], ...] = ()  # (event, detail) to publish
    feedback: tuple[Note, ...] = ()
    kill: bool = False  # SIGKILL it: its exit is seen on the next look and handled like a crash
    exited: bool = False
    halts: str | None = None  # why the rollout must stop, when a change broke the lane


def what_to_probe(health: LaneHealth, now: float) -> Literal["ready", "alive"] | None:
    """Which question to ask a running lane this tick."""
    if health.state in COMING_UP:
        return "ready"
    if health.state == "healthy" and now >= health.next_probe:
        return "alive"
    return None


def transition(health: LaneHealth, probe: Probe, *, now: float, rules: Rules = Rules()) -> Outcome:
    if probe.returncode is not None and health.state not in ENDED:
        return _exited(health, probe, now, rules)
    if health.state in COMING_UP and probe.ready is not None:
        ready, detail = probe.ready
        if ready == "healthy":
            up = replace(health, state="healthy", healthy_since=now, last_error="", last_good=health.spec,
                         loop_mark=(), stuck_since=None)  # fmt: skip
            return Outcome(up, (("healthy", ""),), (CheckUse(),))
        if ready == "mismatch":
            return Outcome(replace(health, state="mismatch", last_error=detail), (("mismatch", detail),))
        return Outcome(replace(health, state="loading"))
    if health.state == "healthy":
        return _serving(health, probe, now, rules)
    if health.state == "unresponsive":
        return Outcome(health, kill=True)
    return Outcome(health)


def _serving(health: LaneHealth, probe: Probe, now: float, rules: Rules) -> Outcome:
    since = health.healthy_since
    if health.failures and since and now - since > HEALTHY_RESETS_FAILURES_AFTER:
        health = replace(health, failures=0)
    if probe.alive is None:
        return Outcome(health, feedback=(CheckUse(),))
    health = replace(health, next_probe=now + rules.probe_interval)
    if probe.alive:
        health = _loop_progress(replace(health, missed_probes=0), probe.loop, now)
        if health.stuck_since is not None and now - health.stuck_since >= rules.stall_seconds:
            seen = "/slots unanswered" if probe.loop is None else "busy slots processed no prompt batch and no token"
            quiet = now - health.stuck_since
            why = f"stalled: its inference loop made no progress for {quiet:.0f} s ({seen}; /health answers)"
            down = replace(health, state="unresponsive", last_error=why)
            return Outcome(down, (("unresponsive", why),), (CheckUse(),))
        return Outcome(health, feedback=(CheckUse(),))
    missed = health.missed_probes + 1
    if missed < rules.probe_failures:
        return Outcome(replace(health, missed_probes=missed), feedback=(CheckUse(),))
    why = f"unresponsive: no answer to {missed} /health probes in a row"
    down = replace(health, missed_probes=missed, state="unresponsive", last_error=why)
    return Outcome(down, (("unresponsive", why),), (CheckUse(),))


def _loop_progress(health: LaneHealth, loop: tuple | None | str, now: float) -> LaneHealth:
    """Fold one /slots look into the lane's progress record.

    Progress: the loop answered and is idle, or its busy slots' counters moved (a batch of
    the prompt, a token). No progress: /slots unanswered, or the same busy slots at the same
    counts as last time (a batch takes seconds: `stall_seconds` must exceed the longest).
    """
    if loop == "unasked":
        return health
    moving = loop is not None and (not loop or loop != health.loop_mark)
    if moving:
        return replace(health, loop_mark=loop, stuck_since=None)
    return replace(health, stuck_since=health.stuck_since if health.stuck_since is not None else now)


def _exited(health: LaneHealth, probe: Probe, now: float, rules: Rules) -> Outcome:
    kind, line = classify_failure(list(probe.tail))
    if health.state == "unresponsive":  # killed by the agent: the restart is reported like a crash
        kind, line = "unresponsive", health.last_error
    died_at_start = health.state in COMING_UP
    failures = health.failures + 1
    error = f"exit {probe.returncode}: {line}"
    halts = f"{health.spec.lane_id} failed with the change: {line}" if health.broken_by_change else None
    health = replace(health, failures=failures, last_error=error)
    if died_at_start and kind == "port_busy":  # taken between the agent's look and the bind
        note: Note = PortBusy(line)
        state, failure, event = "failed", kind, error
    elif died_at_start and (kind in ("unsupported", "oom") or health.broken_by_change):
        # llama-server refused this spec (or a change broke a lane that ran): restarting
        # the same argv cannot help; the planner corrects or reverts it.
        note, state, failure, event = Failed(kind, line), "failed", kind, error
    elif failures >= MAX_FAILURES:
        note, state, failure = Failed("crash_loop", line), "failed", "crash_loop"
        event = f"crash loop: {failures} failures; {error}"
    else:
        crashed = replace(health, state="crashed", failure=kind, retry_at=now + backoff(failures, rules.backoff_base))
        return Outcome(crashed, (("crashed", error),), exited=True, halts=halts)
    return Outcome(replace(health, state=state, failure=failure), (("failed", event),), (note,), exited=True, halts=halts)
