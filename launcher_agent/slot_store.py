"""Saved slots on disk and over HTTP: the thin edge around launcher_agent.slot_cache's decisions.

Every lane runs with `--slot-save-path <data dir>/slots`; the agent keeps a manifest of the
files there (slots.json beside them), asks a lane about to go for its slots' contents, saves
those slot_cache.decide_save picks, and restores slot_cache.decide_restore's into a new lane
before it is reported healthy. Files are removed as the decisions say; events say what happened.
"""

from __future__ import annotations

import os
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path

import msgspec
import structlog

from launcher_agent import lane_http, slot_cache
from launcher_agent.lane import Emit, Lane
from launcher_agent.model_digest import ModelDigests
from launcher_agent.slot_cache import Entry, SlotSeen
from shared.messages.slots import SlotOrigin
from shared.messages.plans import LaneSpec

log = structlog.get_logger("lanes.agent")
MANIFEST = "slots.json"
DIGESTS = "model-digests.json"
SAVE_TIMEOUT = 30.0  # per slot: a save waits for the slot to be idle (the drain has ended by then)
MIB = 1024 * 1024


def model_layout(spec: LaneSpec) -> str | None:
    """The lane's layout key, from its model file as it is now (None: the file is gone)."""
    try:
        st = os.stat(spec.model_path)
    except OSError:
        return None
    return slot_cache.layout_key(spec, st.st_size, st.st_mtime_ns)


@dataclass
class SlotStore:
    folder: Path
    emit: Emit
    budget: int = 0  # the plan's slot_cache_bytes
    build: str = ""  # the lanes' llama-server version line: part of every file's origin
    entries: list[Entry] = field(default_factory=list)
    digests: ModelDigests = field(init=False)

    def __post_init__(self) -> None:
        self.folder.mkdir(parents=True, exist_ok=True)
        self.digests = ModelDigests(self.folder / DIGESTS)
        try:
            self.entries = list(msgspec.json.decode((self.folder / MANIFEST).read_bytes(), type=list[Entry]))
        except (OSError, msgspec.DecodeError, msgspec.ValidationError):
            self.entries = []
        files = [p.name for p in self.folder.iterdir() if p.name.endswith(".slot")]
        missing, stray = slot_cache.missing_or_stray(self.entries, files)
        self._remove(missing)
        for name in stray:
            (self.folder / name).unlink(missing_ok=True)

    @property
    def used(self) -> int:
        return sum(e.size for e in self.entries)

    def _write(self) -> None:
        tmp = self.folder / (MANIFEST + ".tmp")
        tmp.write_bytes(msgspec.json.encode(self.entries))
        tmp.replace(self.folder / MANIFEST)

    def _remove(self, gone) -> None:
        names = {e.file for e in gone}
        if not names:
            return
        for name in names:
            (self.folder / name).unlink(missing_ok=True)
        self.entries = [e for e in self.entries if e.file not in names]
        self._write()

    def _budget(self) -> int:
        return slot_cache.budget_now(self.budget, self.used, shutil.disk_usage(self.folder).free)

    async def discard_for_change(self, lane: Lane, new: LaneSpec) -> None:
        """A restart under another layout (cache types, the model file): the lane's slots are not
        saved, and its model's files of the old layout go. Said in the lane's events when
        something was lost: slots worth saving, or files."""
        old_layout, new_layout = model_layout(lane.spec), model_layout(new)
        if old_layout is None or old_layout == new_layout:
            return
        gone = slot_cache.discarded_by_change(self.entries, lane.spec.model_path, old_layout, new_layout or "")
        self._remove(gone)
        contents = await lane_http.slot_contents(lane.spec, lane.api_key) if lane.state == "healthy" else None
        held = [tokens for _, tokens, _, _ in contents or () if tokens >= slot_cache.MIN_TOKENS]
        if not gone and not held:
            return
        what = slot_cache.layout_change(lane.spec, new)
        await self.emit(lane, "slots_discarded", f"KV layout changed ({what}): {len(held)} slot(s) holding "
                                                 f"{sum(held)} tokens not saved, {len(gone)} saved file(s) removed; "
                                                 "they cannot be restored")  # fmt: skip

    async def save(self, lane: Lane) -> list[Entry]:
        """Before a planned restart or stop of a serving lane: save the slots worth keeping (those saved)."""
        spec = lane.spec
        layout = model_layout(spec)
        if layout is None or self.budget <= 0 or lane.state != "healthy":
            return []
        if (why := slot_cache.not_reusable(spec)) is not None:
            log.info("slots not saved", lane=spec.lane_id, reason=why)
            return []
        contents = await lane_http.slot_contents(spec, lane.api_key)
        if not contents:
            return []
        origin = await self.origin(spec)
        if origin is None:
            return []
        restored = lane.restored_tokens
        seen = [SlotSeen(i, tokens or (restored.get(i, 0) if task < 0 else 0), task, busy)
                for i, tokens, task, busy in contents]  # fmt: skip
        per_token = spec.memory.kv_bytes / max(1, spec.ctx_total)
        decision = slot_cache.decide_save(seen, self.entries, bytes_per_token=per_token, budget=self._budget())
        self._remove(decision.drop)
        started, saved = time.monotonic(), []
        for s in decision.save:
            entry = await self._save_one(lane, layout, origin, s)
            if entry is not None:
                saved.append(entry)
        tokens = sum(e.tokens for e in saved)
        self.entries += saved
        self._write()
        self._remove(slot_cache.over_budget(self.entries, self._budget()))
        if saved:
            took = time.monotonic() - started
            await self.emit(lane, "slots_saved", f"{len(saved)} slot(s), {tokens} tokens, "
                                                 f"{sum(e.size for e in saved) / MIB:.1f} MiB in {took:.2f} s")  # fmt: skip
        return saved

    async def save_idle(self, lane: Lane, most: int) -> list[Entry]:
        """Up to `most` of a serving lane's idle conversations (the longest), saved to files for a
        move: not kept in the manifest (the caller sends and removes them), nothing else dropped."""
        spec = lane.spec
        layout = model_layout(spec)
        if layout is None or lane.state != "healthy" or lane.draining or slot_cache.not_reusable(spec) is not None:
            return []
        origin = await self.origin(spec)
        contents = await lane_http.slot_contents(spec, lane.api_key) if origin is not None else None
        idle = sorted(((tokens, slot, task) for slot, tokens, task, busy in contents or ()
                       if not busy and tokens >= slot_cache.MIN_TOKENS), reverse=True)  # fmt: skip
        saved = []
        for tokens, slot, task in idle[:most]:
            entry = await self._save_one(lane, layout, origin, SlotSeen(slot, tokens, task, False), "spread-")
            if entry is not None and (self.folder / entry.file).exists():  # sent from the file: it must be here
                saved.append(entry)
        return saved

    async def _save_one(self, lane: Lane, layout: str, origin: SlotOrigin, seen: SlotSeen,
                        prefix: str = "") -> Entry | None:  # fmt: skip
        """One slot saved to a file of the slot folder: its entry, or None (a failed save leaves no file)."""
        spec, now = lane.spec, time.time()
        name = prefix + slot_cache.file_name(layout, spec.lane_id, seen.slot, now)
        status, body = await lane_http.slot_file(spec, lane.api_key, seen.slot, "save", name, SAVE_TIMEOUT)
        path = self.folder / name
        if status != 200 or not isinstance(body, dict):
            log.info("slot not saved", lane=spec.lane_id, slot=seen.slot, status=status, answer=str(body)[:200])
            path.unlink(missing_ok=True)
            return None
        size = path.stat().st_size if path.exists() else int(body.get("n_written", 0))
        return Entry(file=name, model=spec.model_path, layout=layout, lane_id=spec.lane_id, slot=seen.slot,
                     tokens=int(body.get("n_saved", seen.tokens)), size=size, saved_at=now, last_task=seen.last_task,
                     origin=origin)  # fmt: skip

    async def origin(self, spec: LaneSpec) -> SlotOrigin | None:
        """This lane's origin for its slot files (None: its model file is gone)."""
        sha = await self.digests.of(spec.model_path)
        return None if sha is None else slot_cache.origin_of(spec, sha, self.build)

    async def restore(self, lane: Lane) -> None:
        """A new lane, loaded and not yet reported healthy: restore the saved slots whose origin
        matches its own (slot_cache.decide_restore); say why each other one was refused."""
        spec = lane.spec
        if not slot_cache.restore_candidates(self.entries, lane_id=spec.lane_id, model=spec.model_path):
            return  # nothing to look at: the model file is not even hashed
        origin = await self.origin(spec)
        if origin is None:
            return
        decision = slot_cache.decide_restore(self.entries, lane_id=spec.lane_id, model=spec.model_path, origin=origin,
                                             slots=spec.parallel)  # fmt: skip
        for entry, why in decision.refused:
            log.info("saved slot refused", lane=spec.lane_id, file=entry.file, reason=why)
        if decision.discard:
            self._remove(decision.discard)
            gone = {e.file for e in decision.discard}
            reasons = sorted({why for e, why in decision.refused if e.file in gone})
            await self.emit(lane, "slots_discarded", f"{len(gone)} saved slot file(s) refused and removed: "
                                                     + "; ".join(reasons))  # fmt: skip
        started, done, tokens, failed = time.monotonic(), [], 0, []
        for slot, entry in decision.restore:
            status, body = await lane_http.slot_file(spec, lane.api_key, slot, "restore", entry.file, SAVE_TIMEOUT)
            if status == 200 and isinstance(body, dict):
                done.append(entry)
                tokens += int(body.get("n_restored", entry.tokens))
                lane.restored_tokens[slot] = int(body.get("n_restored", entry.tokens))
            else:
                failed.append(entry)
                log.info("slot not restored", lane=spec.lane_id, slot=slot, status=status, answer=str(body)[:200])
        self._remove(done + failed)  # restored: the slot holds it now; failed: it never will
        if done:
            took = time.monotonic() - started
            await self.emit(lane, "slots_restored", f"{len(done)} slot(s), {tokens} tokens in {took:.2f} s")
        if failed:
            await self.emit(lane, "slots_discarded", f"{len(failed)} saved slot file(s) did not restore; removed")
