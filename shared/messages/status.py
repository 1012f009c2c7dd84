"""What runs: each host's lanes as its agent sees them (HostStatus), their load (HostLoad), their
events, the plans it refuses, and what went wrong with a lane for the planner to correct."""

from __future__ import annotations

from typing import Annotated, Literal

import msgspec

from shared.messages.plans import DeviceMemory, LaneSpec
from shared.messages.wire import (
    FEW,
    LINES,
    Bytes,
    CacheType,
    Count,
    Int32,
    Label,
    Message,
    Name,
    Pid,
    Port,
    PortOrNone,
    Revision,
    Seconds,
    Text,
)

# "unresponsive": a serving lane stopped answering /health; routers take it out at once.
LaneState = Literal["starting", "loading", "healthy", "unresponsive", "mismatch", "crashed", "failed", "stopped"]
FailureKind = Literal["oom", "unsupported", "over_plan", "crash_loop", "port_busy", "unresponsive", "other"]


class LaneStatus(msgspec.Struct, frozen=True, gc=False, kw_only=True):
    lane_id: Name
    state: LaneState
    port: PortOrNone = 0
    pid: Pid | None = None
    plan_revision: Revision = 0
    ctx_total: Int32 = 0
    planned_bytes: Bytes = 0
    planned_kv_bytes: Bytes = 0
    kv_bytes: Bytes | None = None
    rss_bytes: Bytes | None = None
    restarts: Count = 0
    last_error: Text = ""
    stderr_tail: Annotated[tuple[Text, ...], LINES] = ()
    argv: Annotated[tuple[Text, ...], LINES] = ()
    # shared.lane_key of the spec it runs: a dashboard tells a lane still on its previous spec
    # from argv the agent merely spells differently ("": an agent too old to say).
    lane_key: Annotated[str, msgspec.Meta(max_length=64)] = ""
    failure: FailureKind | None = None
    # Per device, the buffers llama-server printed (-lv 4 lines); the plan's spec.memory.devices
    # holds the predicted ones. Empty until the lane has loaded.
    devices: Annotated[tuple[DeviceMemory, ...], FEW] = ()
    # Set while the agent waits for in-flight requests before a restart or stop:
    # gateways send a draining lane nothing new.
    draining: bool = False
    # Seconds from its process's start to its first healthy answer (None: not loaded yet, or adopted).
    load_seconds: Seconds | None = None
    # The fingerprint of the key it answers (shared/lane_secrets.py; the key is in bucket
    # lanes-secrets): a gateway routes to it only once it holds that key. "": no key (an agent
    # from before lane keys, or a lane started then).
    key_id: Annotated[str, msgspec.Meta(max_length=16, pattern="^[0-9a-f]*$")] = ""


class RpcWorkerStatus(msgspec.Struct, frozen=True, gc=False, kw_only=True):
    """One ggml-rpc-server a worker host runs for another host's span lane."""

    lane_id: Name
    serving_host: Name
    port: Port
    pid: Pid | None = None
    running: bool = False
    restarts: Count = 0


class LaneFeedback(msgspec.Struct, frozen=True, gc=False, kw_only=True):
    """What went wrong with a lane as the agent saw it; the planner corrects for it."""

    lane_id: Name
    model: Name
    kind: FailureKind
    cache_type_k: CacheType | None = None
    cache_type_v: CacheType | None = None
    ctx_total: Int32 = 0
    planned_bytes: Bytes = 0
    actual_bytes: Bytes = 0
    detail: Text = ""
    port: PortOrNone = 0  # port_busy: the port another program holds
    # Unix time the agent noted it; it expires after the agent's feedback TTL
    noted_at: Annotated[float, msgspec.Meta(ge=0.0, le=1e11)] = 0.0
    # The spec this lane last ran healthy with, when the failing one was a change to it:
    # the planner reverts to it rather than guessing a correction.
    last_good: LaneSpec | None = None


class HostStatus(Message, tag="host_status", kw_only=True):
    host_id: Name
    plan_revision: Revision = 0
    lanes: Annotated[tuple[LaneStatus, ...], msgspec.Meta(max_length=1000)] = ()
    feedback: Annotated[tuple[LaneFeedback, ...], msgspec.Meta(max_length=10_000)] = ()
    nats_connected: bool = True
    # Set when a change broke a lane: the agent rolls no further lanes to this config revision.
    rollout_halted: Text = ""
    # Changes each time the agent starts: tells a fresh status from one a dead agent left.
    agent_session: Label = ""
    # Where gateways reach this host's lanes (the bind address, or the agent's --advertise).
    address: Label = ""
    # The ggml-rpc-servers this host runs for span lanes of other hosts (an agent with --rpc-worker).
    rpc_workers: Annotated[tuple[RpcWorkerStatus, ...], msgspec.Meta(max_length=1000)] = ()


class LaneEvent(Message, tag="lane_event", kw_only=True):
    host_id: Name
    lane_id: Name
    event: Literal[
        "started", "healthy", "unresponsive", "crashed", "stopped", "failed", "mismatch", "rejected", "rolled_back",
        "draining", "slots_saved", "slots_restored", "slots_discarded", "slots_received",
    ]
    detail: Text = ""
    pid: Pid | None = None
    # slots_received: the lane, leaving for good, whose conversations' slots this one took (gateways
    # route them here); unset when that lane restarts and keeps its own copies
    from_host: Name | None = None
    from_lane: Name | None = None
    # slots_received from a hot lane spreading its conversations (SlotsOffer.spread): each restored
    # slot's tokens, by which gateways find those conversations among the source's last answers
    moved_tokens: Annotated[tuple[Count, ...], FEW] = ()


class LaneLoad(msgspec.Struct, frozen=True, gc=False, kw_only=True):
    """One serving lane's inference loop, as its agent's last /slots read saw it."""

    lane_id: Name
    pid: Pid | None = None  # the process read
    # Slots processing a request; None: it answered but cannot say (--no-slots, an error status),
    # or did not answer (then `answered` is false).
    busy: Count | None = None
    answered: bool = True  # /slots answered within the agent's probe timeout
    unanswered_for: Seconds = 0.0  # seconds since its /slots last answered (0 while it answers)
    progressing: bool = False  # idle, or its busy slots' counters moved since the read before
    age: Seconds = 0.0  # seconds from the read's start to this message's sending


class HostLoad(Message, tag="host_load", kw_only=True):
    """Each serving lane's load, read once by its agent and published on lanes.load.<host>, so
    what a lane spends answering /slots does not grow with the number of gateways
    (launcher_agent/load_feed.py). Sent when something a router uses changed, and whole every
    `refresh` seconds."""

    host_id: Name
    refresh: Seconds = 10.0
    lanes: Annotated[tuple[LaneLoad, ...], msgspec.Meta(max_length=1000)] = ()


class PlanRejected(Message, tag="plan_rejected", kw_only=True):
    host_id: Name
    plan_revision: Revision = 0
    reason: Text
    applied_revision: Revision = 0  # the plan revision the agent runs: a replacement must be newer


# A lane's API key: URL-safe base64 of 32 random bytes, behind a prefix (launcher_agent/lane_secret.py).
LaneApiKey = Annotated[str, msgspec.Meta(min_length=16, max_length=128, pattern=r"^[A-Za-z0-9_-]+$")]


class LaneSecret(Message, tag="lane_secret", kw_only=True):
    """The key a lane answers to (llama-server --api-key-file), new at each start of the lane.
    Its agent puts it in bucket lanes-secrets, which only gateways may read; a gateway sends it
    with every request to the lane, so a client that reaches the lane's port without a gateway
    is refused (401)."""

    host_id: Name
    lane_id: Name
    port: Port
    key: LaneApiKey


class SessionSecret(Message, tag="session_secret", kw_only=True):
    """What the dashboard's session cookies are signed with (URL-safe base64 of 32 or more random
    bytes): made by the first gateway, under key `dashboard` of bucket lanes-secrets, so a cookie
    any gateway gave opens them all; nothing in it comes from the API keys."""

    secret: Annotated[str, msgspec.Meta(min_length=43, max_length=128, pattern=r"^[A-Za-z0-9_-]+$")]
