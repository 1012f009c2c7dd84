"""The agent's pure decisions: plan validation and reconcile actions."""

from __future__ import annotations

import msgspec
import pytest

from launcher_agent.reconcile import (
    MAX_FAILURES,
    Observed,
    Restart,
    Start,
    Stop,
    backoff,
    decide,
    validate_plan,
)
from shared.lane_key import lane_key
from shared.llama.flags import lane_args
from shared.messages.hosts import ServerCaps
from shared.messages.plans import HostPlan, LaneSpec

CAPS = ServerCaps()


def spec(lane_id: str, port: int, model_path: str = "/models/m.gguf", **kw) -> LaneSpec:
    """A lane spec as the planner writes it: typed fields, no argv."""
    return LaneSpec(lane_id=lane_id, model="m", model_path=model_path, alias="m", port=port, ctx_total=4096,
                    ctx_per_slot=4096, parallel=1, **kw)  # fmt: skip


def changed(s: LaneSpec, **kw) -> LaneSpec:
    return msgspec.structs.replace(s, **kw)


def with_args(s: LaneSpec, args=None) -> LaneSpec:
    """The spec as an older planner wrote it: its argv rendered into `args`."""
    return msgspec.structs.replace(s, args=lane_args(s, CAPS) if args is None else tuple(args))


# ------------------------------------------------------------------ decide


def test_empty_to_plan_starts_everything():
    a, b = spec("a", 8080), spec("b", 8081)
    assert decide([a, b], {}, now=0) == [Start(a, "new in the plan"), Start(b, "new in the plan")]


def test_lane_not_in_plan_is_stopped_and_unchanged_lane_untouched():
    a, b = spec("a", 8080), spec("b", 8081)
    observed = {"a": Observed(a, "healthy"), "b": Observed(b, "healthy")}
    assert decide([a], observed, now=0) == [Stop("b", "no longer in the plan")]


def test_changed_lanes_restart_one_at_a_time():
    a, b = spec("a", 8080), spec("b", 8081)
    a2, b2 = changed(a, cache_type_k="q8_0"), changed(b, cache_type_k="q8_0")
    observed = {"a": Observed(a, "healthy"), "b": Observed(b, "healthy")}
    assert decide([a2, b2], observed, now=0) == [Restart(a2, "spec changed")]
    # a is now loading with its new spec: b waits until a is up.
    observed = {"a": Observed(a2, "loading"), "b": Observed(b, "healthy")}
    assert decide([a2, b2], observed, now=0) == []
    observed = {"a": Observed(a2, "healthy"), "b": Observed(b, "healthy")}
    assert decide([a2, b2], observed, now=0) == [Restart(b2, "spec changed")]
    assert len(decide([a2, b2], {"a": Observed(a, "healthy"), "b": Observed(b, "healthy")}, now=0, max_changes=2)) == 2


def test_a_change_that_broke_a_lane_halts_the_rollout():
    a, b = spec("a", 8080), spec("b", 8081)
    a2, b2 = changed(a, cache_type_k="q4_0"), changed(b, cache_type_k="q4_0")
    broken = Observed(a2, "failed", failures=1, last_good_key=lane_key(a))
    observed = {"a": broken, "b": Observed(b, "healthy", last_good_key=lane_key(b))}
    assert decide([a2, b2], observed, now=0) == []  # b keeps serving its old spec
    # The planner reverts a: the broken lane takes the reverted spec at once; b still waits.
    assert decide([a, b2], observed, now=0) == [Restart(a, "spec changed (lane was down)")]
    assert decide([a, b2], {"a": Observed(a, "healthy"), "b": Observed(b, "healthy")}, now=0, hold_changes=True) == []


def respelled(args: tuple[str, ...]) -> tuple[str, ...]:
    """Another renderer's argv for the same spec: flags in reverse order, two spelled short."""
    groups: list[list[str]] = []
    for tok in args:
        if tok.startswith("-") and not tok.lstrip("-").isdigit():
            groups.append([tok])
        else:
            groups[-1].append(tok)
    short = {"--ctx-size": "-c", "--parallel": "-np"}
    return tuple(t for g in reversed(groups) for t in [short.get(g[0], g[0]), *g[1:]])


def test_two_renderers_of_one_spec_restart_nothing():
    a, b = spec("a", 8080, threads=4, cpus=(0, 1, 2, 3)), spec("b", 8081, cache_type_k="q8_0")
    ours = [with_args(a), with_args(b)]
    theirs = [with_args(s, respelled(lane_args(s, CAPS))) for s in (a, b)]
    assert [s.args for s in theirs] != [s.args for s in ours]  # the argv differ
    observed = {s.lane_id: Observed(s, "healthy", last_good_key=lane_key(s)) for s in theirs}
    assert decide(ours, observed, now=0) == []
    assert decide([a, b], observed, now=0) == []  # a plan without args, lanes run by a renderer that wrote some
    # The same comparison sees a change of what runs.
    assert decide([changed(a, ctx_total=8192), b], observed, now=0) == [Restart(changed(a, ctx_total=8192), "spec changed")]


def test_crashed_lane_restarts_after_backoff_and_stops_after_max_failures():
    a = spec("a", 8080)
    assert decide([a], {"a": Observed(a, "crashed", failures=1, retry_at=5.0)}, now=4.9) == []
    assert decide([a], {"a": Observed(a, "crashed", failures=1, retry_at=5.0)}, now=5.0) == [
        Restart(a, "crashed; retry 1 after backoff")
    ]
    assert decide([a], {"a": Observed(a, "crashed", failures=MAX_FAILURES, retry_at=0)}, now=100) == []
    assert decide([a], {"a": Observed(a, "failed", failures=1)}, now=100) == []


def test_backoff_doubles_and_caps():
    assert [backoff(n) for n in (1, 2, 3, 4)] == [1.0, 2.0, 4.0, 8.0]
    assert backoff(30) == 60.0
    assert backoff(3, base=0.2) == pytest.approx(0.8)


def test_start_never_takes_a_port_a_kept_lane_holds():
    old = spec("old", 8080)
    new = spec("new", 8080)
    # old stays observed (e.g. its stop happens this same round): new may start only when freed.
    assert decide([new], {"old": Observed(old, "healthy")}, now=0) == [Stop("old", "no longer in the plan"), Start(new, "new in the plan")]
    moved = changed(old, port=8081)
    blocked = {"old": Observed(old, "healthy"), "x": Observed(spec("x", 8082), "loading")}
    # old must move to 8081 but the restart budget is used by x: new must not start on 8080 yet.
    assert decide([moved, new, spec("x", 8082)], blocked, now=0) == []


# ------------------------------------------------------------------ validate_plan


MODELS = "/models"
MODEL = "/models/m.gguf"


def exists(path: str) -> bool:
    """The file system as these tests see it: one model file."""
    if len(path) > 255:
        raise OSError(36, "File name too long")
    return path == MODEL


def _check(plan: HostPlan, applied: int = 0, caps: ServerCaps = CAPS) -> str | None:
    return validate_plan(plan, host_id="h", model_dirs=[MODELS], port_range=range(8080, 8090), caps=caps,
                         applied_revision=applied, model_exists=exists)  # fmt: skip


def test_valid_plan_passes():
    ok = HostPlan(host_id="h", plan_revision=2, lanes=(spec("a", 8080, MODEL),))
    assert _check(ok) is None


@pytest.mark.parametrize(
    "mutate, reason",
    [
        (lambda s: {"host_id": "other"}, "not 'h'"),
        (lambda s: {"plan_revision": 1}, "older than the applied"),
        (lambda s: {"lanes": (changed(s, model_path="/etc/passwd"),)}, "outside the model folders"),
        (lambda s: {"lanes": (changed(s, model_path=s.model_path + "/../../../etc/passwd"),)}, "outside the model folders"),
        (lambda s: {"lanes": (changed(s, port=22),)}, "outside 8080..8089"),
        (lambda s: {"lanes": (s, changed(s, lane_id="b"))}, "used twice"),
        (lambda s: {"lanes": (s, changed(s, port=8081))}, "duplicate lane id"),
        (lambda s: {"lanes": (with_args(s, (*lane_args(s, CAPS), "--rpc", "x:1")),)}, "args disagree"),
        (lambda s: {"lanes": (msgspec.structs.replace(with_args(s), ctx_total=8192),)}, "args disagree"),
        (lambda s: {"lanes": (changed(s, cache_type_v="q4_0", flash_attn="off"),)}, "without flash attention"),
        (lambda s: {"lanes": (changed(s, model_path="/models/gone.gguf"),)}, "does not exist"),
        (lambda s: {"lanes": (changed(s, model_path="/models/" + "a" * 300),)}, "unusable model path"),
        (lambda s: {"lanes": (changed(s, model_path="/models/m\0.gguf"),)}, "unusable model path"),
    ],
)
def test_hostile_plans_are_rejected(mutate, reason):
    base = spec("a", 8080, MODEL)
    plan = HostPlan(host_id="h", plan_revision=2, lanes=(base,))
    plan = msgspec.structs.replace(plan, **mutate(base))
    assert reason in (_check(plan, applied=2) or "")


def test_unsupported_cache_type_rejected():
    s = changed(spec("a", 8080, MODEL), cache_type_k="q4_0")
    plan = HostPlan(host_id="h", plan_revision=1, lanes=(s,))
    assert "not supported" in _check(plan, caps=ServerCaps(cache_types=("f16", "q8_0")))
