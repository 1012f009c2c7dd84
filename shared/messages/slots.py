"""Saved slots that follow their conversations to another lane (docs/slot-cache.md, "Moves").

The planner names, in each lane's spec, where its slots go when it stops or restarts (its
buddy: another lane of the same model, which serves meanwhile). Its agent saves them, sends
each file on its own subjects of stream LANES_SLOTS (lanes.slots.<host>.<move>.<n>, 512 KiB
messages) and offers them (SlotsOffer on lanes.slots.<host>.offer); the receiving host's agent
reads them back by direct get, checks each file (its sha256, and an origin that matches its
lane's: launcher_agent/slot_cache.refusal) and restores them into its lane's idle slots.
"""

from __future__ import annotations

from typing import Annotated

import msgspec

from shared.messages.wire import FEW, Bytes, Count, Label, Message, Name


class SlotOrigin(msgspec.Struct, frozen=True, gc=False, kw_only=True):
    """What made a slot file, each fact one llama-server does not check (or checks too late)."""

    model_sha256: Label  # the weights: another quantization or fine-tune of one shape reads back "fine"
    build: Label  # llama-server's version line: the file format and the graph that filled the cells
    cache_types: Label  # "k/v" as shared.llama.flags.cache_pair spells them
    flash_attn: Label  # on/off/auto: V is stored transposed without it
    kv_unified: bool
    swa_full: bool
    ctx: Count  # the slot's context then: a file reads back into a slot that holds its tokens


class OfferedSlot(msgspec.Struct, frozen=True, gc=False, kw_only=True):
    """One saved slot on the stream: its messages lanes.slots.<host>.<move>.<part>.0 .. chunks-1."""

    part: Name  # this file's token in its subjects
    chunks: Annotated[int, msgspec.Meta(ge=1, le=1_000_000)]
    size: Bytes
    sha256: Label  # of the whole file, checked before it is restored
    tokens: Count
    origin: SlotOrigin


class SlotsOffer(Message, tag="slots_offer", kw_only=True):
    """Subject lanes.slots.<host>.offer: a stopped or restarted lane's slots, for `to_lane`."""

    from_host: Name
    from_lane: Name
    move: Name  # the files' subject token: lanes.slots.<from_host>.<move>.>
    model: Name
    to_host: Name
    to_lane: Name
    slots: Annotated[tuple[OfferedSlot, ...], FEW] = ()
    # The source lane stops for good (a scale-down, an eviction, a move); False: it restarts and
    # restores its own copies, so gateways keep routing its conversations to it.
    leaving: bool = True
    # A hot lane spreading some of its idle conversations (a SlotsAsk): the source keeps serving,
    # and gateways send just the conversations whose slots moved (by their tokens) to `to_lane`.
    spread: bool = False


class SlotsAsk(Message, tag="slots_ask", kw_only=True):
    """Subject lanes.slots.<host>.ask, from a gateway: `lane` of that host is hot (a conversation
    it holds was just sent cold to `to_lane`); move up to `slots` of its idle conversations, with
    their caches, to that cooler lane of the same model."""

    host: Name
    lane: Name
    to_host: Name
    to_lane: Name
    slots: Annotated[int, msgspec.Meta(ge=1, le=64)] = 2
