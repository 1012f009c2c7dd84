"""Models on demand: wakes, what each gateway sees of each model and tenant, the tokens tenants
used, the models' states as the planner sees them, and the active planner's lease."""

from __future__ import annotations

from typing import Annotated, Literal

import msgspec

from shared import defaults
from shared.messages.wire import FEW, MANY, Bytes, Count, Label, Message, Name, Seconds, Text

ModelLoad = Literal["loaded", "unloaded", "waking", "failed"]
MAX_ACTIVITY_INTERVAL = 60.0  # seconds: the longest a gateway may say its next activity report is away


class ModelWake(Message, tag="model_wake", kw_only=True):
    """A gateway holds requests for a model with no lane: place one (subject lanes.wake.<model>).

    Gateways repeat it while they hold requests; the planner keeps one wake per model, so
    any number of requests and gateways asking is one load."""

    name: Name  # the persona's name: its alias, or the model's name (what lanes' specs call alias)
    gateway: Label = ""  # who asks (logs only)


Tokens = Annotated[float, msgspec.Meta(ge=0.0, le=1e15)]  # weighted tokens (prompt + output x weight)


class TenantActivity(msgspec.Struct, frozen=True, gc=False, kw_only=True):
    """One tenant's requests for one model on one gateway: whose demand it is."""

    tenant: Name
    priority: Annotated[int, msgspec.Meta(ge=-1000, le=1000)] = 0
    in_flight: Count = 0
    queued: Count = 0


class TenantUsage(Message, tag="tenant_usage", kw_only=True):
    """KV bucket lanes-usage, key usage.<tenant>.<gateway>: the tokens one gateway counted for one
    tenant in the current calendar minute and day (UTC). Gateways add up every gateway's key to
    enforce one limit (gateway/tenants/quota.py); the key outlives a gateway restart."""

    tenant: Name
    gateway: Name
    minute: Annotated[int, msgspec.Meta(ge=0, le=2**40)] = 0  # unix time // 60
    day: Annotated[int, msgspec.Meta(ge=0, le=2**32)] = 0  # unix time // 86400
    minute_tokens: Tokens = 0.0
    day_tokens: Tokens = 0.0


class ModelActivity(msgspec.Struct, frozen=True, gc=False, kw_only=True):
    """One model's requests as one gateway sees them (probes and scrapes never count)."""

    name: Name  # the persona's name, as ModelWake
    in_flight: Count = 0
    queued: Count = 0  # waiting for a slot or held while it loads
    idle_s: Seconds | None = None  # seconds since its last request; None: none yet
    # The longest wait for a slot in the last interval (requests still queued at their age so
    # far); the planner adds lanes on it (planner_svc/scaling.py). 0 from older gateways.
    wait_s: Annotated[float, msgspec.Meta(ge=0.0, le=86400.0)] = 0.0
    # Who the requests are for (tenants of the keys file; "anonymous" without keys).
    tenants: Annotated[tuple[TenantActivity, ...], msgspec.Meta(max_length=10_000)] = ()


class GatewayActivity(Message, tag="gateway_activity", kw_only=True):
    """Subject lanes.activity.<gateway>, every few seconds: what each model is doing. Times are
    relative (idle_s), so no clocks are compared across machines."""

    gateway: Name  # must match the subject's gateway (the planner drops it otherwise)
    # Seconds until the next one; its activity counts for a few intervals, so the bound keeps one
    # report from holding a model busy for long.
    interval: Annotated[float, msgspec.Meta(gt=0, le=MAX_ACTIVITY_INTERVAL)] = 2.0
    models: Annotated[tuple[ModelActivity, ...], msgspec.Meta(max_length=10_000)] = ()


class ModelState(msgspec.Struct, frozen=True, gc=False, kw_only=True):
    """A model as the planner sees it: loaded (it has planned lanes), unloaded (it has none;
    a request wakes it), waking (woken, not placed yet: `reason` says why), failed (a wake
    that cannot succeed: `reason` carries llama-server's or the planner's reason)."""

    name: Name  # what clients ask for: the persona's alias, or the model's name
    model: Name  # the model's name (file stem)
    state: ModelLoad = "unloaded"
    hosts: Annotated[tuple[Label, ...], MANY] = ()  # where its lanes are planned
    holders: Annotated[tuple[Label, ...], MANY] = ()  # hosts that hold its file
    # In the `models` key the lists above name at most NAMED_HOSTS hosts each; these count them all
    # (0: not cut, the lists are whole).
    host_count: Annotated[int, msgspec.Meta(ge=0, le=2**31 - 1)] = 0
    holder_count: Annotated[int, msgspec.Meta(ge=0, le=2**31 - 1)] = 0
    reason: Text = ""
    file_bytes: Bytes = 0
    # Loaded on request only (it was unloaded once, or no persona names the file): a planner
    # taking over reads it, so a failover does not bring back what was evicted.
    on_demand: bool = False
    # Cold start: predicted from the file's size and the read rate its best holder has shown
    # (planner_svc/coldstart.py), and the last measured load of one of its lanes.
    predicted_load_s: Seconds | None = None
    measured_load_s: Seconds | None = None
    # Its lanes serve /v1/embeddings only (the persona asks, or the file declares a pooling type).
    embeddings: bool = False
    adapters: Annotated[tuple[Name, ...], FEW] = ()  # the persona's LoRA adapters: "name:adapter" asks for one
    reranking: bool = False  # its lanes serve /v1/rerank
    # Its lanes load a multimodal projector that reads images (--mmproj): image requests go to them.
    vision: bool = False


class ModelStates(Message, tag="model_states", kw_only=True):
    """KV key `models`, put by the active planner when it changes."""

    models: Annotated[tuple[ModelState, ...], MANY] = ()
    # reason -> lanes this planner evicted (idle, wake)
    evictions: Annotated[dict[Label, Annotated[int, msgspec.Meta(ge=0, le=2**53)]], FEW] = {}


class PlannerLease(Message, tag="planner_lease", kw_only=True):
    """The active planner's claim on the fleet (KV key `planner.lease`), renewed by compare-and-set.

    A stand-by takes over once the entry has not changed for `ttl` seconds on its own clock.
    """

    holder: Label
    ttl: Annotated[float, msgspec.Meta(gt=0, le=3600.0)] = defaults.LEASE_TTL
