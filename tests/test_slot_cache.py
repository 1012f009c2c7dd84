"""Saved slots: what to save before a lane goes, what to restore into its next one, what to remove (pure)."""

from __future__ import annotations

import itertools

import msgspec
from hypothesis import given, settings
from hypothesis import strategies as st

from launcher_agent.slot_cache import (
    Entry,
    SlotSeen,
    budget_now,
    decide_restore,
    decide_save,
    discarded_by_change,
    file_name,
    layout_change,
    layout_key,
    missing_or_stray,
    not_reusable,
    origin_of,
    over_budget,
    refusal,
)
from shared.llama import endpoints
from shared.llama.flags import args_problem, lane_args
from shared.messages.hosts import ServerCaps
from shared.messages.plans import LaneSpec, MemoryBreakdown
from shared.messages.slots import SlotOrigin


def spec(**kw) -> LaneSpec:
    base = dict(lane_id="m-0", model="m", model_path="/models/m.gguf", alias="m", port=8080, ctx_total=4096, ctx_per_slot=2048, parallel=2)
    return LaneSpec(**(base | kw))


SHA = "a" * 64


def origin(**kw) -> SlotOrigin:
    base = dict(model_sha256=SHA, build="version: 11434 (abc)", cache_types="f16/f16", flash_attn="auto",
                kv_unified=False, swa_full=False, ctx=4096)  # fmt: skip
    return SlotOrigin(**(base | kw))


def entry(name: str, *, size: int = 100, saved_at: float = 0.0, layout: str = "L", model: str = "/m", lane: str = "a",
          tokens: int = 500, task: int = 0, made: SlotOrigin | None | str = "this lane's") -> Entry:  # fmt: skip
    """A manifest entry; `made` None: saved by an agent that kept no origin."""
    made = origin() if made == "this lane's" else made
    return Entry(file=name, model=model, layout=layout, lane_id=lane, slot=0, tokens=tokens, size=size,
                 saved_at=saved_at, last_task=task, origin=made)  # fmt: skip


# ------------------------------------------------------------------ layout and names


def test_the_layout_key_follows_the_model_file_and_cache_types_not_threads_or_ports():
    base = layout_key(spec(), 1000, 5)
    assert layout_key(spec(threads=3, port=8081, cpus=(0, 1), poll=0), 1000, 5) == base  # a restart keeps the KV
    assert layout_key(spec(cache_type_k="f16", cache_type_v="f16"), 1000, 5) == base  # f16 is the default
    assert layout_key(spec(cache_type_k="q8_0", cache_type_v="q8_0", flash_attn="on"), 1000, 5) != base
    assert layout_key(spec(cache_type_v="q8_0", flash_attn="on"), 1000, 5) != base
    assert layout_key(spec(), 1001, 5) != base and layout_key(spec(), 1000, 6) != base  # the file was replaced
    assert layout_key(spec(model_path="/models/n.gguf"), 1000, 5) != base
    assert layout_key(spec(flash_attn="auto"), 1000, 5) == base  # auto is the default
    for other in (spec(flash_attn="on"), spec(kv_unified=True), spec(swa_full=True)):  # another cache shape
        assert layout_key(other, 1000, 5) != base


def test_file_names_are_plain_and_unique_per_lane_slot_and_moment():
    names = {file_name("abcdef0123456789", lane, slot, t) for lane in ("a", "b") for slot in (0, 1) for t in (1.0, 1.002)}
    assert len(names) == 8
    assert all(n.replace("-", "").replace(".", "").isalnum() for n in names)


def test_the_budget_keeps_a_reserve_of_free_disk():
    assert budget_now(10_000, used=0, disk_free=100_000, reserve=1000) == 10_000
    assert budget_now(10_000, used=2000, disk_free=3000, reserve=1000) == 4000  # what is held counts as room
    assert budget_now(10_000, used=0, disk_free=500, reserve=1000) == 0


# ------------------------------------------------------------------ saving


def test_the_most_recently_used_slots_are_saved_first_within_the_budget():
    slots = [SlotSeen(0, 1000, last_task=5), SlotSeen(1, 1000, last_task=9), SlotSeen(2, 1000, last_task=7)]
    d = decide_save(slots, [], bytes_per_token=1.0, budget=2500)
    assert [s.slot for s in d.save] == [1, 2] and d.drop == ()


def test_busy_and_nearly_empty_slots_are_not_saved():
    slots = [SlotSeen(0, 1000, 1, busy=True), SlotSeen(1, 10, 2), SlotSeen(2, 0, -1), SlotSeen(3, 64, 3)]
    assert [s.slot for s in decide_save(slots, [], bytes_per_token=1.0, budget=10**9).save] == [3]


def test_older_files_give_way_oldest_first_and_only_as_far_as_needed():
    kept = [entry("new", size=400, saved_at=3), entry("old", size=400, saved_at=1), entry("mid", size=400, saved_at=2)]
    d = decide_save([SlotSeen(0, 500, 1)], kept, bytes_per_token=1.0, budget=1300)
    assert [e.file for e in d.drop] == ["old"]
    d = decide_save([SlotSeen(0, 500, 1)], kept, bytes_per_token=1.0, budget=1700)
    assert d.drop == ()


def test_a_slot_larger_than_the_budget_is_skipped_and_a_smaller_one_still_fits():
    slots = [SlotSeen(0, 5000, 9), SlotSeen(1, 800, 1)]
    d = decide_save(slots, [entry("x", size=900)], bytes_per_token=1.0, budget=1000)
    assert [s.slot for s in d.save] == [1] and [e.file for e in d.drop] == ["x"]
    assert decide_save(slots, [], bytes_per_token=1.0, budget=0).save == ()


seen = st.builds(SlotSeen, st.integers(0, 7), st.integers(0, 3000), st.integers(-1, 50), st.booleans())
kept_entries = st.lists(st.builds(entry, st.uuids().map(str), size=st.integers(1, 3000),
                                  saved_at=st.floats(0, 100, allow_nan=False)), max_size=8)  # fmt: skip


@settings(max_examples=300, deadline=None)
@given(st.lists(seen, max_size=8, unique_by=lambda s: s.slot), kept_entries, st.integers(0, 8000),
       st.sampled_from([0.5, 1.0, 3.0]))  # fmt: skip
def test_saving_never_plans_past_the_budget_and_drops_only_the_oldest(slots, kept, budget, per_token):
    d = decide_save(slots, kept, bytes_per_token=per_token, budget=budget)
    need = sum(int(s.tokens * per_token) for s in d.save)
    stays = [e for e in kept if e not in d.drop]
    if d.save:
        assert need + sum(e.size for e in stays) <= budget
    else:
        assert d.drop == ()  # files go only to make room for a save
    assert all(not s.busy and s.tokens >= 64 for s in d.save)
    if d.drop and stays:  # the oldest go first
        assert max((e.saved_at, e.last_task) for e in d.drop) <= min((e.saved_at, e.last_task) for e in stays)
    tasks = [s.last_task for s in d.save]
    assert tasks == sorted(tasks, reverse=True)
    for s in slots:  # an eligible slot left out did not fit beside the ones saved
        if s not in d.save and not s.busy and s.tokens >= 64:
            assert need + int(s.tokens * per_token) > budget


@settings(max_examples=300, deadline=None)
@given(kept_entries, st.integers(0, 10000))
def test_over_budget_removes_the_oldest_until_the_rest_fits(kept, budget):
    gone = over_budget(kept, budget)
    stays = [e for e in kept if e not in gone]
    assert sum(e.size for e in stays) <= budget
    if gone:  # no newer file went before an older one, and no more than needed
        assert max((e.saved_at, e.last_task) for e in gone) <= min(((e.saved_at, e.last_task) for e in stays), default=(1e9, 0))
        assert sum(e.size for e in stays) + gone[-1].size > budget


# ------------------------------------------------------------------ restoring and discarding


def test_a_new_lane_restores_its_own_files_first_then_the_most_recent_one_per_slot():
    kept = [entry("other-new", lane="b", saved_at=9), entry("own-old", lane="a", saved_at=1),
            entry("own-new", lane="a", saved_at=5), entry("other-old", lane="b", saved_at=2)]  # fmt: skip
    d = decide_restore(kept, lane_id="a", model="/m", origin=origin(), slots=3)
    assert [(slot, e.file) for slot, e in d.restore] == [(0, "own-new"), (1, "own-old"), (2, "other-new")]
    assert d.discard == () and d.refused == ()


def test_a_file_too_long_for_the_slot_window_is_kept_for_a_larger_lane():
    kept = [entry("long", tokens=5000), entry("short", tokens=100)]
    d = decide_restore(kept, lane_id="a", model="/m", origin=origin(), slots=2)
    assert [e.file for _, e in d.restore] == ["short"] and d.discard == ()
    assert [(e.file, why) for e, why in d.refused] == [("long", "holds 5000 tokens, more than this lane's slot context of 4096")]


def test_each_fact_of_a_files_origin_must_match_and_the_refusal_names_it():
    lane = origin()
    assert refusal(origin(), 4096, lane) is None
    assert refusal(origin(ctx=8192), 100, lane) is None  # a slot of another size that holds its tokens
    cases = {
        "saved from another model file (sha256 bbbbbbbbbbbb, this lane's aaaaaaaaaaaa)": origin(model_sha256="b" * 64),
        "saved by another llama-server build ('version: 11435 (def)', this lane runs 'version: 11434 (abc)')":
            origin(build="version: 11435 (def)"),
        "saved with cache types q8_0/q8_0, this lane runs f16/f16": origin(cache_types="q8_0/q8_0"),
        "saved with flash attention on, this lane runs auto": origin(flash_attn="on"),
        "saved with --kv-unified True, this lane runs False": origin(kv_unified=True),
        "saved with --swa-full True, this lane runs False": origin(swa_full=True),
    }
    assert {refusal(saved, 100, lane): said for said, saved in cases.items()} == {said: said for said in cases}
    assert refusal(None, 100, lane) == "saved without its origin (an older agent): which model made it is unknown"


def test_the_origin_of_a_lane_is_its_model_digest_build_and_cache_shape_not_its_port_or_threads():
    base = origin_of(spec(), SHA, "b")
    assert base == SlotOrigin(model_sha256=SHA, build="b", cache_types="f16/f16", flash_attn="auto", kv_unified=False,
                              swa_full=False, ctx=2048)  # fmt: skip
    assert origin_of(spec(threads=3, port=8081, cpus=(0, 1), model_path="/elsewhere/m.gguf"), SHA, "b") == base
    assert origin_of(spec(kv_unified=True), SHA, "b").ctx == 4096  # one pool: a slot may fill it


def test_refused_files_go_when_no_lane_can_take_them_and_stay_for_the_lane_that_can():
    kept = [entry("q8-own", made=origin(cache_types="q8_0/q8_0")),
            entry("q8-other-persona", lane="b", made=origin(cache_types="q8_0/q8_0")),
            entry("replaced-file", lane="b", made=origin(model_sha256="c" * 64)),
            entry("older-agent", lane="b", made=None), entry("match", lane="b")]  # fmt: skip
    d = decide_restore(kept, lane_id="a", model="/m", origin=origin(), slots=4)
    assert [e.file for _, e in d.restore] == ["match"]
    assert sorted(e.file for e in d.discard) == ["older-agent", "q8-own", "replaced-file"]
    assert sorted(e.file for e, _ in d.refused) == ["older-agent", "q8-other-persona", "q8-own", "replaced-file"]


def test_a_change_of_layout_discards_the_models_files_of_the_old_layout_only():
    kept = [entry("a", layout="OLD"), entry("b", layout="OLD", model="/other"), entry("c", layout="NEW")]
    assert [e.file for e in discarded_by_change(kept, "/m", "OLD", "NEW")] == ["a"]
    assert discarded_by_change(kept, "/m", "OLD", "OLD") == ()


ORIGINS = st.builds(origin, model_sha256=st.sampled_from([SHA, "b" * 64]), build=st.sampled_from(["x", "y"]),
                    cache_types=st.sampled_from(["f16/f16", "q8_0/q8_0"]), flash_attn=st.sampled_from(["auto", "on"]),
                    kv_unified=st.booleans(), swa_full=st.booleans(), ctx=st.sampled_from([2048, 4096]))  # fmt: skip


@settings(max_examples=300, deadline=None)
@given(st.lists(st.builds(entry, st.uuids().map(str), model=st.sampled_from(["/m", "/n"]), lane=st.sampled_from("ab"),
                          tokens=st.integers(1, 5000), saved_at=st.floats(0, 9), made=st.one_of(st.none(), ORIGINS)),
                max_size=10),
       st.integers(1, 4), st.sampled_from("ab"), ORIGINS)  # fmt: skip
def test_no_refused_file_is_ever_restored_and_each_slot_is_filled_at_most_once(kept, slots, lane, here):
    d = decide_restore(kept, lane_id=lane, model="/m", origin=here, slots=slots)
    ids = [slot for slot, _ in d.restore]
    assert ids == list(range(len(ids))) and len(ids) <= slots
    assert all(refusal(e.origin, e.tokens, here) is None for _, e in d.restore)
    assert all(why == refusal(e.origin, e.tokens, here) and why for e, why in d.refused)
    restored, refused = {e.file for _, e in d.restore}, {e.file for e, _ in d.refused}
    assert not restored & refused and {e.file for e in d.discard} <= refused
    candidates = [e for e in kept if e.lane_id == lane or e.model == "/m"]
    assert {e.file for e in candidates} >= restored | refused  # nothing of another lane's other model is touched
    fitting = [e for e in candidates if refusal(e.origin, e.tokens, here) is None]
    assert len(ids) == min(slots, len(fitting)) and len(fitting) + len(refused) == len(candidates)
    if any(e.lane_id == lane for e in fitting):  # its own first
        own = sum(1 for e in fitting if e.lane_id == lane)
        assert all(e.lane_id == lane for _, e in d.restore[: min(own, slots)])


def test_files_without_an_entry_and_entries_without_a_file_are_found():
    kept = [entry("a.slot"), entry("b.slot")]
    missing, stray = missing_or_stray(kept, ["a.slot", "c.slot"])
    assert [e.file for e in missing] == ["b.slot"] and stray == ("c.slot",)


def test_the_manifest_entry_round_trips():
    e = entry("x.slot", task=4)
    assert msgspec.json.decode(msgspec.json.encode([e]), type=list[Entry]) == [e]


# ------------------------------------------------------------------ the lane's side


def test_slots_answers_are_read_as_id_tokens_last_task_busy():
    answer = [{"id": 0, "is_processing": False, "n_prompt_tokens": 300, "id_task": 7},
              {"id": 1, "is_processing": True, "n_prompt_tokens": 20, "id_task": 9},
              {"id": 2, "is_processing": False}]  # fmt: skip
    assert endpoints.slot_contents(200, answer) == ((0, 300, 7, False), (1, 20, 9, True), (2, 0, -1, False))
    assert endpoints.slot_contents(501, {"error": "no slots"}) is None and endpoints.slot_contents(0, None) is None
    assert endpoints.slot_action(1, "save") == "/slots/1?action=save"


def test_lanes_run_with_the_slot_folder_where_the_binary_has_the_flag_and_it_means_nothing_to_the_plan():
    s = spec()
    args = lane_args(s, ServerCaps(), "/data/slots")
    assert args[args.index("--slot-save-path") + 1] == "/data/slots"
    assert "--slot-save-path" not in lane_args(s, ServerCaps(has_slot_save=False), "/data/slots")
    assert "--slot-save-path" not in lane_args(s, ServerCaps())
    planned = msgspec.structs.replace(s, args=lane_args(s, ServerCaps()))  # an older planner's args, no folder
    assert args_problem(planned, ServerCaps()) is None


def test_every_pair_of_slots_is_ranked_by_recency():
    for a, b in itertools.permutations([SlotSeen(0, 500, 1), SlotSeen(1, 500, 2), SlotSeen(2, 500, 3)], 2):
        d = decide_save([a, b], [], bytes_per_token=1.0, budget=500)
        assert d.save == (max(a, b, key=lambda s: s.last_task),)


def test_lanes_whose_cache_needs_checkpoints_save_nothing():
    assert not_reusable(spec(memory=MemoryBreakdown(kv_cells=4096))) is None
    assert "sliding-window" in not_reusable(spec(memory=MemoryBreakdown(kv_cells=4096, swa_cells=1024)))
    assert "recurrent" in not_reusable(spec(memory=MemoryBreakdown(recurrent_bytes=1 << 20)))


def test_a_restarted_agent_drops_stray_files_and_entries_whose_file_is_gone(tmp_path):
    from launcher_agent.lane import no_event
    from launcher_agent.slot_store import MANIFEST, SlotStore

    folder = tmp_path / "slots"
    folder.mkdir()
    (folder / "kept.slot").write_bytes(b"x" * 10)
    (folder / "stray.slot").write_bytes(b"y")  # a save the agent did not live to record
    kept, gone = entry("kept.slot", size=10), entry("gone.slot")
    (folder / MANIFEST).write_bytes(msgspec.json.encode([kept, gone]))
    store = SlotStore(folder, no_event)
    assert store.entries == [kept] and store.used == 10
    assert sorted(p.name for p in folder.iterdir()) == ["kept.slot", MANIFEST]
    assert msgspec.json.decode((folder / MANIFEST).read_bytes(), type=list[Entry]) == [kept]


def test_a_discard_says_what_changed_in_the_layout():
    assert layout_change(spec(), spec(cache_type_k="q8_0", cache_type_v="q8_0", flash_attn="on")) == \
        "cache types f16/f16 -> q8_0/q8_0, flash attention auto -> on"  # fmt: skip
    assert layout_change(spec(swa_full=True), spec()) == "--swa-full True -> False"
    assert layout_change(spec(), spec()) == "the model file changed"
