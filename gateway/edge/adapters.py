"""A request for a LoRA adapter: `model: "base:adapter"`, or `model: "base"` with `lora` naming it.

llama-server loads a lane's adapters at launch (lanes start them at scale 0) and applies, per
request, the scales of its `lora` field: a list of {id, scale}, ids indexing the lane's --lora
list, every adapter not listed at 0. Lanes of one persona may list different adapters (a host
without the file), so the gateway writes the id of the lane it picked into the body. Pure.
"""

from __future__ import annotations

import msgspec

from gateway.fleet import LaneRoute


def requested(name: str, payload: object) -> str:
    """The name to route by: "base:adapter" when the request names an adapter by its `lora` field
    (a string, or a list of {"name", "scale"}); llama-server's own form (ids) is passed through."""
    if ":" in name or not isinstance(payload, dict):
        return name
    lora = payload.get("lora")
    if isinstance(lora, str) and lora:
        return f"{name}:{lora}"
    if isinstance(lora, list) and len(lora) == 1 and isinstance(lora[0], dict) and isinstance(lora[0].get("name"), str):
        return f"{name}:{lora[0]['name']}"
    return name


def applied_by_id(payload: object) -> bool:
    """A `lora` list applying an adapter by its id, llama-server's own form. Ids index each lane's
    --lora list and differ between lanes, and no key's allowed models can name one, so through the
    gateway an adapter is applied by name only (a key allowed "chat" must not reach "chat:style")."""
    lora = payload.get("lora") if isinstance(payload, dict) else None
    return isinstance(lora, list) and any(
        isinstance(x, dict) and "id" in x and x.get("scale", 1.0) != 0 for x in lora)  # fmt: skip


def _scale(payload: dict) -> float:
    lora = payload.get("lora")
    if isinstance(lora, list) and lora and isinstance(lora[0], dict):
        scale = lora[0].get("scale", 1.0)
        if isinstance(scale, (int, float)) and not isinstance(scale, bool):
            return float(scale)
    return 1.0


def body_for(body: bytes, name: str, lane: LaneRoute) -> bytes:
    """The body as this lane must read it: its id for the adapter the request names, only that
    adapter applied. A request for no adapter goes as it came."""
    adapter = name.partition(":")[2]
    if not adapter:
        return body
    payload = msgspec.json.decode(body)
    adapter_id = lane.adapter_id(adapter)
    if not isinstance(payload, dict) or adapter_id is None:
        return body
    payload["lora"] = [{"id": adapter_id, "scale": _scale(payload)}]
    payload["model"] = name
    return msgspec.json.encode(payload)
