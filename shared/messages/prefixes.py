"""The shared prefix view: what gateways learn of the lanes' prompt caches (PrefixEvent)."""

from __future__ import annotations

from typing import Annotated

import msgspec

from shared.messages.wire import Count, Label, Message, Name

# A prompt chunk's chained hash (gateway/routing/affinity.py), its 64 bits read as a signed integer.
Hash64 = Annotated[int, msgspec.Meta(ge=-(2**63), le=2**63 - 1)]
PREFIX_EVENT_HASHES = 4096  # hashes per event: a longer removal goes in several
PrefixHashes = Annotated[tuple[Hash64, ...], msgspec.Meta(max_length=PREFIX_EVENT_HASHES)]


class PrefixEvent(Message, tag="prefix_event", kw_only=True):
    """Stream LANES_PREFIX, subject lanes.prefix.<host>.<lane>: what one gateway learnt of a lane's
    prompt cache. `stored`: a prompt's chunk hashes, in order, as sent to the lane; `removed`:
    hashes its answer showed it no longer holds (it reused less than the index said). Every
    gateway applies every event in the stream's order (docs/routing.md)."""

    gateway: Name
    model: Label
    host_id: Name
    lane_id: Name
    stored: PrefixHashes = ()
    removed: PrefixHashes = ()
    reused: Count = 0  # leading chunks of `stored` the lane's answer confirmed (0: not answered yet)
