"""Saved slots sent to a lane's buddy on another host, and taken from others (docs/slot-cache.md, "Moves").

Sending: a lane about to stop or restart has saved its slots (launcher_agent/slot_store.py); if
its spec names a buddy, each file goes in 512 KiB pieces on this host's own subjects of stream
LANES_SLOTS (published with acknowledgement), then one SlotsOffer names them. Taking: an offer
for one of this host's lanes is read back by direct get (no consumer: an agent's NATS user may
make none), each file checked (its sha256 and size, and an origin matching the lane's:
slot_cache.refusal; a refused file is never handed to llama-server), restored into the lane's
empty idle slots (one holding a conversation keeps it), and said in a `slots_received` event
naming the lane it came from, by which gateways send those conversations here. Spreading: a
gateway's SlotsAsk says a lane is hot; up to that many of its idle conversations are sent the same
way to the cooler lane it names (the lane keeps serving), and the receiver names each restored
slot's tokens, by which gateways find just those conversations.
"""

from __future__ import annotations

import asyncio
import hashlib
import time
import uuid
from collections.abc import Callable, Sequence
from pathlib import Path

import structlog

from launcher_agent import lane_http, slot_cache
from launcher_agent.lane import Lane
from launcher_agent.slot_cache import Entry
from launcher_agent.slot_store import SAVE_TIMEOUT, SlotStore
from shared import subjects
from shared.bus import SLOT_CHUNK_BYTES
from shared.messages.slots import OfferedSlot, SlotsAsk, SlotsOffer
from shared.messages.status import LaneEvent
from shared.messages.wire import encode

log = structlog.get_logger("lanes.agent")
MAX_OFFERED = 64  # files in one offer (its slots: a lane has at most 256, but only the hot ones are saved)


def _pieces(path: Path) -> tuple[list[bytes], str]:
    data = path.read_bytes()
    return [data[i : i + SLOT_CHUNK_BYTES] for i in range(0, len(data), SLOT_CHUNK_BYTES)] or [b""], \
        hashlib.sha256(data).hexdigest()  # fmt: skip


async def send(nc, host_id: str, store: SlotStore, lane: Lane, saved: Sequence[Entry], leaving: bool = True,
               to: tuple[str, str] | None = None) -> SlotsOffer | None:  # fmt: skip
    """Offer the files just saved from `lane` to its buddy (or `to`, a hot lane's spread: the lane
    stays); None when there is nothing to send. `leaving`: the lane stops for good (else it
    restarts and restores its own copies)."""
    spec = lane.spec
    target = to or (spec.slot_buddy_host, spec.slot_buddy_lane)
    if target[0] is None or target[1] is None or not saved:
        return None
    js = nc.jetstream()
    move = uuid.uuid4().hex[:16]
    offered = []
    for i, entry in enumerate(saved[:MAX_OFFERED]):
        if entry.origin is None:
            continue
        pieces, sha = await asyncio.to_thread(_pieces, store.folder / entry.file)
        part = f"s{i}"
        for n, piece in enumerate(pieces):
            await js.publish(subjects.slot_chunk_subject(host_id, move, part, n), piece, stream=subjects.SLOTS_STREAM)
        offered.append(OfferedSlot(part=part, chunks=len(pieces), size=sum(map(len, pieces)), sha256=sha,
                                   tokens=entry.tokens, origin=entry.origin))  # fmt: skip
    if not offered:
        return None
    offer = SlotsOffer(from_host=host_id, from_lane=spec.lane_id, move=move, model=spec.model, to_host=target[0],
                       to_lane=target[1], slots=tuple(offered), leaving=leaving and to is None,
                       spread=to is not None)  # fmt: skip
    await nc.publish(subjects.slot_offer_subject(host_id), encode(offer))
    log.info("slots offered", lane=spec.lane_id, to=f"{offer.to_host}/{offer.to_lane}", slots=len(offered))
    return offer


SPREAD_EVERY = 10.0  # seconds between two spreads of one lane: gateways ask on every overflow


async def spread(nc, host_id: str, store: SlotStore, lanes: dict[str, Lane], ask: SlotsAsk,
                 last: dict[str, float]) -> SlotsOffer | None:  # fmt: skip
    """A gateway found `ask.lane` hot: send up to `ask.slots` of its idle conversations' slots to the
    cooler lane it named (another lane of the same model: the receiver checks each file's origin).
    At most one spread per lane every SPREAD_EVERY seconds (`last`: lane -> when)."""
    lane = lanes.get(ask.lane)
    now = time.monotonic()
    if ask.host != host_id or lane is None or (ask.to_host, ask.to_lane) == (host_id, ask.lane):
        return None
    if now - last.get(ask.lane, -SPREAD_EVERY) < SPREAD_EVERY:
        return None
    last[ask.lane] = now
    saved = await store.save_idle(lane, min(ask.slots, MAX_OFFERED))
    try:
        return await send(nc, host_id, store, lane, saved, leaving=False, to=(ask.to_host, ask.to_lane))
    finally:
        for entry in saved:
            (store.folder / entry.file).unlink(missing_ok=True)


async def take(nc, host_id: str, store: SlotStore, lanes: dict[str, Lane], offer: SlotsOffer,
               publish_event: Callable[[LaneEvent], object]) -> int:  # fmt: skip
    """Restore an offer's files into the named lane of this host; the number restored."""
    lane = lanes.get(offer.to_lane)
    if offer.to_host != host_id or lane is None or lane.state != "healthy" or lane.draining:
        return 0
    spec = lane.spec
    here = await store.origin(spec)
    if here is None:
        return 0
    contents = await lane_http.slot_contents(spec, lane.api_key) or []
    # Only empty slots take a moved one: a slot holding a conversation keeps it (what stays behind
    # goes cold, as it would have without the move). A slot restored and not used since shows no
    # tokens in /slots: what was restored into it counts.
    held = {slot: tokens or (lane.restored_tokens.get(slot, 0) if task < 0 else 0) for slot, tokens, task, _ in contents}
    idle = sorted((held[slot], task, slot) for slot, _, task, busy in contents
                  if not busy and held[slot] < slot_cache.MIN_TOKENS)  # fmt: skip
    js = nc.jetstream()
    began, restored, tokens, refused, moved = time.monotonic(), 0, 0, [], []
    for offered in sorted(offer.slots, key=lambda s: -s.tokens):  # the longest first: they save the most
        why = slot_cache.refusal(offered.origin, offered.tokens, here)
        if why is not None:
            refused.append(why)
            continue
        if not idle:
            break
        name = f"moved-{offer.move}-{offered.part}.slot"
        path = store.folder / name
        try:
            data = bytearray()
            for n in range(offered.chunks):
                subject = subjects.slot_chunk_subject(offer.from_host, offer.move, offered.part, n)
                data += (await js.get_msg(subjects.SLOTS_STREAM, subject=subject, direct=True)).data
        except Exception as exc:  # gone from the stream (its age or size limit), or NATS away
            refused.append(f"not read back: {exc or type(exc).__name__}")
            continue
        if len(data) != offered.size or hashlib.sha256(data).hexdigest() != offered.sha256:
            refused.append("its pieces do not make the file offered (size or sha256)")
            continue
        _, _, slot = idle.pop(0)
        try:
            await asyncio.to_thread(path.write_bytes, bytes(data))
            status, body = await lane_http.slot_file(spec, lane.api_key, slot, "restore", name, SAVE_TIMEOUT)
        finally:
            path.unlink(missing_ok=True)
        if status == 200 and isinstance(body, dict):
            restored += 1
            tokens += int(body.get("n_restored", offered.tokens))
            moved.append(offered.tokens)
            lane.restored_tokens[slot] = int(body.get("n_restored", offered.tokens))
        else:
            refused.append(f"llama-server answered {status}: {str(body)[:120]}")
    for why in refused:
        log.info("moved slot refused", lane=spec.lane_id, source=f"{offer.from_host}/{offer.from_lane}", reason=why)
    if restored:
        detail = (f"{restored} slot(s), {tokens} tokens from {offer.from_host}/{offer.from_lane} in "
                  f"{time.monotonic() - began:.2f} s" + (f"; {len(refused)} refused" if refused else ""))  # fmt: skip
        # The source named only when it leaves: gateways then send its conversations here. A lane
        # that restarts restores its own copies, and its conversations go back to it.
        # A spread names its source and each restored slot's tokens: gateways move just those conversations.
        source = (offer.from_host, offer.from_lane) if offer.leaving or offer.spread else (None, None)
        await publish_event(LaneEvent(host_id=host_id, lane_id=spec.lane_id, event="slots_received", detail=detail,
                                      from_host=source[0], from_lane=source[1],
                                      moved_tokens=tuple(moved) if offer.spread else ()))  # fmt: skip
    return restored
