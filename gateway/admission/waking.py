"""Holding requests for a model that has no ready lane, and waking it over the bus.

A request for a model the fleet can serve but does not run now is held in that model's
queue; the gateway asks the planner to load it (`lanes.wake.<model>`, repeated while it holds
requests: one wake however many requests or gateways ask, the planner keeps one per model)
and lets the requests go once a lane is healthy. The wait is bounded (`--load-timeout`):
past it, 503 with Retry-After. A load that fails answers every held request with the reason.
A name the fleet does not know at all is a 404 at once, as before.

`classify`, `catalogue` and `activity` are pure (over the FleetView and the admission's
counts; the time is a value); `Waker` holds the futures and is driven by view changes.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from typing import Literal

from gateway.admission.counts import LaneCounts
from gateway.fleet import FleetView, LaneRoute
from shared import defaults, subjects
from shared.messages.activity import ModelActivity

Load = Literal["ready", "loading", "unloaded", "failed", "unknown"]


@dataclass(frozen=True)
class ModelView:
    name: str  # the persona's name (lanes call it alias); the requested name when unknown
    state: Load
    reason: str = ""
    lanes: tuple[LaneRoute, ...] = ()


def _lane_error(view: FleetView, lane: LaneRoute) -> str:
    status = view.statuses.get(subjects.host_token(lane.host_id))
    found = next((s for s in status.lanes if s.lane_id == lane.lane_id), None) if status else None
    return found.last_error if found else ""


def classify(view: FleetView, name: str) -> ModelView:
    """Where a requested name stands: ready (a lane routes), loading (lanes planned, none
    ready yet), unloaded (known, no lane: a wake loads it), failed (its load failed), unknown."""
    lanes = tuple(view.lanes_for(name))
    entry = view.model_entry(name)
    persona = lanes[0].alias if lanes else (entry.name if entry else name)
    if any(lane.routable for lane in lanes):
        return ModelView(persona, "ready", lanes=lanes)
    if lanes:
        if all(lane.state == "failed" for lane in lanes):
            return ModelView(persona, "failed", _lane_error(view, lanes[0]) or "its lane failed", lanes)
        return ModelView(persona, "loading", lanes=lanes)
    if entry is None:
        return ModelView(name, "unknown")
    if entry.state == "failed":
        return ModelView(persona, "failed", entry.reason or "the load failed")
    return ModelView(persona, "unloaded", entry.reason)


WHERE_NAMED = 16  # lanes and holders a model's entry names (it counts them all)


def catalogue(view: FleetView) -> list[dict]:
    """`GET /v1/models`: every servable model (OpenAI's list entries) with its state and where it runs."""
    entries = {m.name: m for m in (view.catalogue.models if view.catalogue else ())}
    by_alias: dict[str, list[LaneRoute]] = {}
    for lane in view.lanes():
        by_alias.setdefault(lane.alias, []).append(lane)
        for adapter in lane.adapters:  # each LoRA adapter is a model of its own: "alias:adapter"
            by_alias.setdefault(f"{lane.alias}:{adapter}", []).append(lane)
    for m in list(entries.values()):
        for adapter in m.adapters:
            entries.setdefault(f"{m.name}:{adapter}", m)
    out = []
    for name in sorted(set(entries) | set(by_alias)):
        lanes = by_alias.get(name, [])
        entry = entries.get(name)
        model = entry.model if entry else lanes[0].model
        reason = entry.reason if entry is not None else ""
        if any(lane.routable for lane in lanes):
            state = "ready"
        elif lanes and all(lane.state == "failed" for lane in lanes):
            state, reason = "failed", _lane_error(view, lanes[0]) or "its lane failed"
        elif entry is not None and entry.state == "failed":
            state = "failed"
        elif lanes or (entry is not None and entry.state == "waking"):
            state = "loading"
        else:
            state = "unloaded"
        item = {
            "id": name, "object": "model", "created": 0, "owned_by": "lanes", "state": state,
            "lanes": {"model": model, "total": len(lanes), "ready": sum(lane.routable for lane in lanes)},
            # Named up to WHERE_NAMED (ready lanes first), counted whole: at 10,000 hosts the list
            # made /v1/models 2.3 MB (bench/dashboard_scale.py).
            "where": [{"host": lane.host_id, "lane": lane.lane_id, "state": lane.state if not lane.routable
                       else "ready"} for lane in sorted(lanes, key=lambda x: not x.routable)[:WHERE_NAMED]],
            "holders": list(entry.holders) if entry else sorted({lane.host_id for lane in lanes})[:WHERE_NAMED],
            "holder_count": (entry.holder_count or len(entry.holders)) if entry else len({x.host_id for x in lanes}),
            "embeddings": any(lane.embeddings for lane in lanes) or bool(entry and entry.embeddings),
            "reranking": any(lane.reranking for lane in lanes) or bool(entry and entry.reranking),
        }  # fmt: skip
        base, _, adapter = name.partition(":")
        if adapter:
            item["adapter"] = {"base": base, "name": adapter}
        else:
            item["adapters"] = sorted({a for lane in lanes for a in lane.adapters} | set(entry.adapters if entry else ()))
        vision = any(lane.vision for lane in lanes) or bool(entry and entry.vision)
        # as llama-server's own /v1/models says it (capabilities, architecture.input_modalities)
        item["capabilities"] = ["completion", "multimodal"] if vision else ["completion"]
        item["input_modalities"] = ["text", "image"] if vision else ["text"]
        if reason and state != "ready":
            item["reason"] = reason
        if entry is not None:
            item["predicted_load_s"] = entry.predicted_load_s
            item["measured_load_s"] = entry.measured_load_s
        out.append(item)
    return out


def only_model(catalogue: list[dict]) -> tuple[str | None, str]:
    """The model a request that names none goes to: the fleet's one servable model, else None
    and why not (a fleet of several cannot guess)."""
    names = [m["id"] for m in catalogue if "adapter" not in m]  # an adapter is asked for by name
    if len(names) == 1:
        return names[0], ""
    if not names:
        return None, "this fleet serves no model"
    shown = ", ".join(names[:5]) + (", ..." if len(names) > 5 else "")
    return None, f"this fleet serves {len(names)} models ({shown}): name one"


DEFAULT_LOAD_TIMEOUT = 120.0  # seconds, where the planner predicts nothing
LOAD_MARGIN = 30.0  # seconds added to half again the predicted load time


def load_bound(view: FleetView, name: str, configured: float | None) -> tuple[float, float | None]:
    """How long a request may be held for `name` (the configured --load-timeout, else the predicted
    load time x 1.5 + LOAD_MARGIN), and the predicted load time itself (None: none)."""
    entry = view.model_entry(name)
    predicted = entry.predicted_load_s if entry else None
    if configured is not None:
        return configured, predicted
    if predicted is None:
        return DEFAULT_LOAD_TIMEOUT, None
    return round(predicted * 1.5 + LOAD_MARGIN, 1), predicted


def persona_of(view: FleetView, name: str) -> str | None:
    """The persona name a requested name counts under, or None for a name nobody serves."""
    lanes = view.lanes_for(name)
    if lanes:
        return lanes[0].alias
    entry = view.model_entry(name)
    return entry.name if entry else None


def activity(
    view: FleetView, counts: LaneCounts, held: Mapping[str, int], last_request: Mapping[str, float], now: float,
    waits: Mapping[str, float] | None = None,
) -> tuple[ModelActivity, ...]:
    """Per persona: requests in flight, queued or held, seconds since its last request, and the
    longest wait for a slot of the last interval (`waits`, by requested name)."""
    in_flight: dict[str, int] = {}
    for key, n in counts.in_flight.items():  # the lanes this gateway has requests on, not the fleet
        lane = view.lane(key)
        if n and lane is not None:
            in_flight[lane.alias] = in_flight.get(lane.alias, 0) + n
    queued: dict[str, int] = dict(held)
    for name, depth in counts.queued.items():
        persona = persona_of(view, name)
        if persona is not None:
            queued[persona] = queued.get(persona, 0) + depth
    wait: dict[str, float] = {}
    for name, seconds in (waits or {}).items():
        persona = persona_of(view, name)
        if persona is not None:
            wait[persona] = max(wait.get(persona, 0.0), seconds)
    names = sorted(set(in_flight) | {n for n, q in queued.items() if q} | set(last_request) | set(wait))
    return tuple(
        ModelActivity(name=n, in_flight=in_flight.get(n, 0), queued=queued.get(n, 0),
                      idle_s=max(0.0, now - last_request[n]) if n in last_request else None,
                      wait_s=round(max(0.0, wait.get(n, 0.0)), 3))
        for n in names
    )  # fmt: skip


# ------------------------------------------------------------------ the edge: held requests


class LoadFailed(Exception):
    status = 502
    code = "model_load_failed"


class LoadTimeout(Exception):
    status = 503
    code = "model_loading"

    def __init__(self, message: str, retry_after: int) -> None:
        super().__init__(message)
        self.retry_after = retry_after


class HeldFull(Exception):
    status = 503
    code = "queue_full"


@dataclass
class Waker:
    view: FleetView
    max_held: int = defaults.QUEUE_DEPTH  # held requests per model (the gateway passes its --queue-depth)
    publish: Callable[[str], Awaitable[None]] | None = None  # sends one wake (set by the bus side)
    on_cold_start: Callable[[str, float], None] | None = None  # (model, seconds from first hold to ready)
    clock: Callable[[], float] = time.monotonic
    held: dict[str, list[asyncio.Future]] = field(default_factory=dict)
    cold_since: dict[str, float] = field(default_factory=dict)  # model -> when its first request was held unloaded
    last_cold: dict[str, float] = field(default_factory=dict)  # model -> seconds its last cold start took
    last_request: dict[str, float] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.view.listeners.append(self.changed)

    def touch(self, name: str) -> None:
        """A request came for `name` (health probes and scrapes never call this)."""
        persona = persona_of(self.view, name)
        if persona is not None:
            self.last_request[persona] = self.clock()

    def counts(self) -> dict[str, int]:
        return {n: sum(not f.done() for f in fs) for n, fs in self.held.items() if fs}

    def wanted(self) -> list[str]:
        """Models with held requests and no planned lane: wakes to (re)send."""
        return sorted(n for n, fs in self.held.items() if fs and classify(self.view, n).state == "unloaded")

    async def wait_ready(self, model: ModelView, configured: float | None = None) -> None:
        """Hold until `model` has a ready lane; LoadFailed or LoadTimeout otherwise. The bound is
        `configured` (--load-timeout) or the predicted load time plus a margin."""
        name = model.name
        timeout, predicted = load_bound(self.view, name, configured)
        futures = self.held.setdefault(name, [])
        if len(futures) >= self.max_held:
            raise HeldFull(f"{len(futures)} requests already wait for {name!r} to load")
        future = asyncio.get_running_loop().create_future()
        futures.append(future)
        try:  # from here on a client that leaves (cancelled) is no longer held: the finally below
            if model.state == "unloaded":
                self.cold_since.setdefault(name, self.clock())
                if len(futures) == 1:
                    await self.wake(name)
            self.changed()
            async with asyncio.timeout(timeout):
                await future
        except TimeoutError:
            expected = predicted or self.last_cold.get(name)
            retry = max(1, round(expected)) if expected else max(1, round(timeout / 4))
            raise LoadTimeout(f"model {name!r} is loading and did not become ready within {timeout:g} s; "
                              f"retry in about {retry} s", retry) from None  # fmt: skip
        finally:
            if future in futures:
                futures.remove(future)
            if not futures:
                self.held.pop(name, None)

    async def wake(self, name: str) -> None:
        if self.publish is not None:
            try:
                await self.publish(name)
            except Exception:
                pass  # repeated by the wake loop

    def changed(self, host: str | None = None) -> None:
        """The fleet changed: let held requests go where their model is ready, fail them where it failed."""
        for name, futures in list(self.held.items()):
            model = classify(self.view, name)
            if model.state == "ready":
                started = self.cold_since.pop(name, None)
                if started is not None:
                    took = self.clock() - started
                    self.last_cold[name] = took
                    if self.on_cold_start is not None:
                        self.on_cold_start(name, took)
                for f in futures:
                    if not f.done():
                        f.set_result(None)
            elif model.state == "failed":
                self.cold_since.pop(name, None)
                for f in futures:
                    if not f.done():
                        f.set_exception(LoadFailed(f"model {name!r} failed to load: {model.reason}"))
