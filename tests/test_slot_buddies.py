"""Each lane's buddy: where its saved slots go when it stops or restarts (planner_svc/slot_buddies.py)."""

from __future__ import annotations

import msgspec

from planner_svc.planner import plan
from planner_svc.slot_buddies import with_buddies
from shared.messages.config import Demand, FleetConfig, Persona
from shared.messages.hosts import HostReport, ModelFacts, ServerCaps
from shared.messages.plans import HostPlan, LaneSpec


def lane(lane_id: str, model: str = "m", buddy: tuple[str, str] | None = None, alias: str | None = None) -> LaneSpec:
    spec = LaneSpec(lane_id=lane_id, model=model, model_path=f"/models/{model}.gguf", alias=alias or model, port=8080,
                    ctx_total=4096, ctx_per_slot=4096, parallel=1)  # fmt: skip
    return msgspec.structs.replace(spec, slot_buddy_host=buddy[0], slot_buddy_lane=buddy[1]) if buddy else spec


def host(host_id: str, *lanes: LaneSpec, revision: int = 1) -> HostPlan:
    return HostPlan(host_id=host_id, lanes=lanes, plan_revision=revision)


def buddies(plans: dict[str, HostPlan]) -> dict[tuple[str, str], tuple[str | None, str | None]]:
    return {(h, s.lane_id): (s.slot_buddy_host, s.slot_buddy_lane) for h, p in plans.items() for s in p.lanes}


def test_a_lane_goes_to_its_models_lane_on_its_own_host_first_then_the_first_other_host():
    fleet = {"b": host("b", lane("m-0", buddy=("c", "m-0"))), "c": host("c", lane("m-0", buddy=("b", "m-0")))}
    new = {"a": host("a", lane("m-0"), lane("m-1"), lane("x-0", model="x"))}
    made = buddies(with_buddies(new, fleet))
    assert made == {("a", "m-0"): ("a", "m-1"), ("a", "m-1"): ("a", "m-0"), ("a", "x-0"): (None, None)}
    assert buddies(with_buddies({"a": host("a", lane("m-0"))}, fleet)) == {("a", "m-0"): ("b", "m-0")}
    lost = with_buddies({"a": host("a", lane("m-0"))}, fleet, lost={"b"})
    assert buddies(lost) == {("a", "m-0"): ("c", "m-0"), ("c", "m-0"): ("a", "m-0")}  # c's buddy was on lost b
    assert lost["c"].plan_revision == 2  # rewritten for its buddy alone: its next revision


def test_lanes_dedicated_to_a_tenant_and_shared_lanes_of_one_model_are_never_buddies():
    """A private cache's conversations (an alias dedicated to one tenant, docs/tenants.md) never
    move into a lane other tenants share, nor theirs into it: buddies are of one persona."""
    fleet = {"b": host("b", lane("m-0"), lane("acme-0", alias="m-acme"))}
    new = {"a": host("a", lane("m-0"), lane("acme-0", alias="m-acme"))}
    made = buddies(with_buddies(new, fleet))
    assert made[("a", "m-0")] == ("b", "m-0") and made[("a", "acme-0")] == ("b", "acme-0"), made
    alone = buddies(with_buddies({"a": host("a", lane("m-0"), lane("acme-0", alias="m-acme"))}, {}))
    assert alone == {("a", "m-0"): (None, None), ("a", "acme-0"): (None, None)}  # not each other's


def test_a_lane_keeps_its_buddy_while_that_lane_serves_its_model():
    fleet = {"a": host("a", lane("m-0", buddy=("c", "m-0"))), "b": host("b", lane("m-0", buddy=("a", "m-0"))),
             "c": host("c", lane("m-0", buddy=("a", "m-0")))}  # fmt: skip
    again = {"a": host("a", lane("m-0"))}  # the replan's fresh spec: its old buddy is kept, not the first host's
    made = with_buddies(again, fleet)
    assert buddies(made) == {("a", "m-0"): ("c", "m-0")} and made["a"] == fleet["a"]  # nothing new to write
    moved = with_buddies({"c": host("c")}, fleet)  # c no longer serves m: its plan's change rewrites a's
    assert buddies(moved)[("a", "m-0")] == ("b", "m-0") and moved["a"].plan_revision == 2
    assert buddies(with_buddies(again, fleet | {"c": host("c")})) == {("a", "m-0"): ("c", "m-0")}  # a's own replan: kept


def test_a_host_planned_before_its_models_other_host_reported_gets_a_buddy_when_it_does():
    """Hosts report one at a time: the first one's lane has no buddy until the second host's lane
    exists; planning the second host alone rewrites the first's plan with its buddy."""
    first = with_buddies({"a": host("a", lane("m-0"))}, {})
    assert buddies(first) == {("a", "m-0"): (None, None)}
    second = with_buddies({"b": host("b", lane("m-0"))}, first)
    assert buddies(second) == {("a", "m-0"): ("b", "m-0"), ("b", "m-0"): ("a", "m-0")}
    assert second["a"].plan_revision == first["a"].plan_revision + 1


def test_a_replan_that_changes_nothing_keeps_the_plan_and_its_buddies():
    """plan() compares plans without buddies, and buddies are chosen again only when lanes change:
    a replan that changes no lane (a restarted planner) writes no revision."""
    facts = ModelFacts(path="/models/m.gguf", name="m", architecture="llama", n_layer=8, n_embd=512, n_head=8,
                       n_head_kv=(8,) * 8, head_dim_k=64, head_dim_v=64, n_ctx_train=4096, n_vocab=32000,
                       weight_bytes=2**28)  # fmt: skip
    reports = [HostReport(host_id=h, cpu_cores=4, ram_total=16 << 30, ram_available=12 << 30, server=ServerCaps(),
                          models=(facts,)) for h in ("a", "b")]  # fmt: skip
    demand = Demand(personas=(Persona(model="m"),))
    first = {h.host_id: h for h in plan(reports, FleetConfig(), demand).hosts}
    written = with_buddies(first, {})
    again = {h.host_id: h for h in plan(reports, FleetConfig(), demand, previous=written).hosts}
    assert with_buddies(again, written) == written
