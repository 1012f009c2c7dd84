"""Which saved slots to write, restore and remove: pure, over the agent's manifest of slot files.

llama-server writes a slot's KV and its tokens to a file (`POST /slots/{id}?action=save`,
llama_state_seq_save_file) and reads one back into a slot (`action=restore`): the restored slot
holds those tokens again, so the next request whose prompt shares them is picked for that slot
by prompt similarity and prefills only what is new. A file reads back only into the same model
with the same K and V types (llama.cpp checks layer count, types and row sizes, but not which
weights: a same-shaped other model would restore garbage), so every file is kept under its
layout key (the model file, its size and mtime, the cache types) and restored only under the
same key. The host-RAM prompt cache (`--cache-ram`) has no save API: what a restart keeps is
what the slots held.

The agent saves before a planned restart or stop (drain, config change, scale-down, eviction),
within the plan's disk budget, and restores into the new lane of the same layout before it is
reported healthy. No I/O, no clock here: launcher_agent.slot_store does the files and the HTTP.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import msgspec

from shared.llama.flags import cache_pair
from shared.messages.plans import LaneSpec
from shared.messages.slots import SlotOrigin

# A slot holding fewer tokens is not worth a file: its prefill costs less than the round trip.
MIN_TOKENS = 64
# Disk the agent leaves free on its data folder whatever the budget says.
DISK_RESERVE = 1024 * 1024 * 1024


def origin_of(spec: LaneSpec, model_sha256: str, build: str) -> SlotOrigin:
    ctx = spec.ctx_total if spec.kv_unified else spec.ctx_per_slot
    return SlotOrigin(model_sha256=model_sha256, build=build, cache_types=cache_pair(spec.cache_type_k, spec.cache_type_v),
                      flash_attn=spec.flash_attn or "auto", kv_unified=spec.kv_unified, swa_full=spec.swa_full,
                      ctx=ctx)  # fmt: skip


def refusal(saved: SlotOrigin | None, tokens: int, lane: SlotOrigin) -> str | None:
    """Why a file saved under `saved` must not be handed to a lane of origin `lane`, or None.

    Every fact must match but the context, which need only hold the file's tokens (the binary
    reads a file into a larger or smaller slot alike; tests/test_slot_origin_real.py)."""
    if saved is None:
        return "saved without its origin (an older agent): which model made it is unknown"
    if saved.model_sha256 != lane.model_sha256:
        return f"saved from another model file (sha256 {saved.model_sha256[:12]}, this lane's {lane.model_sha256[:12]})"
    if saved.build != lane.build:
        return f"saved by another llama-server build ({saved.build!r}, this lane runs {lane.build!r})"
    for name, a, b in (("cache types", saved.cache_types, lane.cache_types),
                       ("flash attention", saved.flash_attn, lane.flash_attn),
                       ("--kv-unified", saved.kv_unified, lane.kv_unified), ("--swa-full", saved.swa_full, lane.swa_full)):
        if a != b:
            return f"saved with {name} {a}, this lane runs {b}"
    if tokens > lane.ctx:
        return f"holds {tokens} tokens, more than this lane's slot context of {lane.ctx}"
    return None


class Entry(msgspec.Struct, frozen=True, gc=False, kw_only=True):
    """One saved slot file, as the manifest keeps it."""

    file: str  # its name in the slot folder
    model: str  # the model path it was saved from
    layout: str  # layout_key of the lane that saved it
    lane_id: str
    slot: int
    tokens: int
    size: int  # bytes on disk
    saved_at: float  # wall clock, seconds
    last_task: int = -1  # the slot's last task id then: within one save, larger is more recent
    origin: SlotOrigin | None = None  # None: saved by an agent before origins were kept


@dataclass(frozen=True)
class SlotSeen:
    """One slot as the lane's /slots shows it just before it goes."""

    slot: int
    tokens: int  # what it holds (0: empty)
    last_task: int = -1  # id of its last task: larger is more recently used
    busy: bool = False


def layout_key(spec: LaneSpec, model_size: int, model_mtime_ns: int) -> str:
    """What a slot file needs to read back: the same model file, K/V types and cache shape (flash
    attention stores V untransposed; --kv-unified and --swa-full change the cells a slot has)."""
    shape = f"{spec.flash_attn or 'auto'}\0{spec.kv_unified}\0{spec.swa_full}"
    raw = f"{spec.model_path}\0{model_size}\0{model_mtime_ns}\0{cache_pair(spec.cache_type_k, spec.cache_type_v)}\0{shape}"
    return hashlib.sha256(raw.encode()).hexdigest()[:24]


def layout_change(old: LaneSpec, new: LaneSpec) -> str:
    """What changed between two layouts of one lane, as its `slots_discarded` event says it."""
    before, after = cache_pair(old.cache_type_k, old.cache_type_v), cache_pair(new.cache_type_k, new.cache_type_v)
    changes = [f"cache types {before} -> {after}"] if before != after else []
    for name, a, b in (("flash attention", old.flash_attn or "auto", new.flash_attn or "auto"),
                       ("--kv-unified", old.kv_unified, new.kv_unified), ("--swa-full", old.swa_full, new.swa_full)):
        if a != b:
            changes.append(f"{name} {a} -> {b}")
    return ", ".join(changes) or "the model file changed"


def file_name(layout: str, lane_id: str, slot: int, saved_at: float) -> str:
    """A name llama-server accepts (letters, digits, dashes) that no other save takes."""
    lane = hashlib.sha256(lane_id.encode()).hexdigest()[:8]
    return f"{layout[:12]}-{lane}-s{slot}-{int(saved_at * 1000)}.slot"


def not_reusable(spec: LaneSpec) -> str | None:
    """Why a restored slot of this lane would be prefilled again anyway, or None.

    A sliding-window (SWA, without --swa-full) or recurrent cache can only go back to a shorter
    prefix from a context checkpoint, and checkpoints live in the slot's memory, not in its
    file: llama-server then reprocesses the whole prompt (measured with Gemma 3: cached 0 of
    370 after a restore, 337 with --swa-full). Its slots are not saved."""
    if spec.memory.swa_cells and not spec.swa_full:
        return "its sliding-window KV cache (without --swa-full) keeps no context checkpoints in a slot file"
    if spec.memory.recurrent_bytes:
        return "its recurrent state keeps no context checkpoints in a slot file"
    return None


def budget_now(planned: int, used: int, disk_free: int, reserve: int = DISK_RESERVE) -> int:
    """The plan's budget, or less where the disk would keep under `reserve` free."""
    return max(0, min(planned, used + disk_free - reserve))


def _age(e: Entry) -> tuple[float, int]:
    return (e.saved_at, e.last_task)


@dataclass(frozen=True)
class SaveDecision:
    save: tuple[SlotSeen, ...]  # most recently used first
    drop: tuple[Entry, ...]  # older entries removed to make room


def decide_save(
    slots: Sequence[SlotSeen],
    kept: Sequence[Entry],
    *,
    bytes_per_token: float,
    budget: int,
    min_tokens: int = MIN_TOKENS,
) -> SaveDecision:
    """The slots of a lane about to go that are worth a file, and the older files that make room.

    Most recently used first; each is estimated at its tokens x bytes_per_token and taken while
    the budget holds it, older files (oldest first) giving way. A slot that would not fit even
    with every older file gone is skipped, and a smaller, less recent one may still fit. Busy or
    nearly empty slots are not saved."""
    candidates = sorted((s for s in slots if not s.busy and s.tokens >= min_tokens), key=lambda s: -s.last_task)
    old = sorted(kept, key=_age)  # dropped from the front
    held = sum(e.size for e in old)
    dropped = 0
    taken: list[SlotSeen] = []
    new = 0
    for s in candidates:
        need = int(s.tokens * bytes_per_token)
        if new + need > budget:
            continue
        while held + new + need > budget:
            held -= old[dropped].size
            dropped += 1
        taken.append(s)
        new += need
    return SaveDecision(tuple(taken), tuple(old[:dropped]))


def over_budget(kept: Iterable[Entry], budget: int) -> tuple[Entry, ...]:
    """The oldest files to remove so what stays fits the budget (estimates were estimates)."""
    old = sorted(kept, key=_age)
    total = sum(e.size for e in old)
    out = []
    for e in old:
        if total <= budget:
            break
        out.append(e)
        total -= e.size
    return tuple(out)


@dataclass(frozen=True)
class RestoreDecision:
    restore: tuple[tuple[int, Entry], ...]  # (slot id, file) pairs
    discard: tuple[Entry, ...]  # files that can never be restored here: removed
    refused: tuple[tuple[Entry, str], ...] = ()  # every candidate not restored for a reason, with it


def restore_candidates(kept: Sequence[Entry], *, lane_id: str, model: str) -> list[Entry]:
    """The files a new lane looks at: its own lane id's, and any saved from its model path."""
    return [e for e in kept if e.lane_id == lane_id or e.model == model]


def decide_restore(kept: Sequence[Entry], *, lane_id: str, model: str, origin: SlotOrigin, slots: int) -> RestoreDecision:
    """What a new lane restores before it serves: the files whose origin matches its own
    (slot_cache.refusal), the ones its own lane id saved first (the gateway's index still sends
    those conversations here), then the most recent, one per slot. No refused file is ever handed
    to llama-server. A refused file is removed when no lane can ever restore it: its own lane's
    (the lane now runs otherwise), one saved before origins were kept, or one of a model file
    since replaced. Another lane's (another persona of the model) stays for that lane, and so
    does a file refused only for its length (a lane with a longer window may take it)."""
    usable, refused, discard = [], [], []
    for e in restore_candidates(kept, lane_id=lane_id, model=model):
        why = refusal(e.origin, e.tokens, origin)
        if why is None:
            usable.append(e)
            continue
        refused.append((e, why))
        if e.origin is not None and refusal(e.origin, 0, origin) is None:
            continue  # only too long for this lane's slots
        replaced = e.origin is not None and e.model == model and e.origin.model_sha256 != origin.model_sha256
        if e.lane_id == lane_id or e.origin is None or replaced:
            discard.append(e)
    usable.sort(key=lambda e: (e.lane_id != lane_id, -e.saved_at, -e.last_task))
    return RestoreDecision(tuple(enumerate(usable[:slots])), tuple(discard), tuple(refused))


def discarded_by_change(kept: Sequence[Entry], model: str, old_layout: str, new_layout: str) -> tuple[Entry, ...]:
    """A lane restarts under another layout: its model's files of the old layout cannot be restored."""
    if old_layout == new_layout:
        return ()
    return tuple(e for e in kept if e.model == model and e.layout == old_layout)


def missing_or_stray(kept: Sequence[Entry], files: Iterable[str]) -> tuple[tuple[Entry, ...], tuple[str, ...]]:
    """Manifest entries whose file is gone, and files in the folder no entry names (a save the
    agent did not live to record): both removed when the agent starts."""
    present = set(files)
    named = {e.file for e in kept}
    return tuple(e for e in kept if e.file not in present), tuple(sorted(present - named))
