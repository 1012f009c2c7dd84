"""Every NATS subject, KV bucket and KV key lanes uses, built in one place.

Operators follow the fleet with:
  nats kv watch lanes             # config, demand, plans, reports, status
  nats sub 'lanes.>'              # events and telemetry
  nats micro ls                   # the planner and every agent
"""

from __future__ import annotations

import re

PREFIX = "lanes"
BUCKET = "lanes"

PLANNER_SERVICE = "lanes-planner"
AGENT_SERVICE = "lanes-agent"

_TOKEN_BAD = re.compile(r"[^A-Za-z0-9_-]")


def host_token(host_id: str) -> str:
    """A host id as one subject token: dots and spaces would add tokens and break wildcards."""
    token = _TOKEN_BAD.sub("_", host_id.strip())
    if not token:
        raise ValueError(f"host id {host_id!r} has no usable characters")
    return token


# ------------------------------------------------------------- KV keys (bucket BUCKET)

CONFIG_KEY = "config"
DEMAND_KEY = "demand"
LEASE_KEY = "planner.lease"  # which planner plans (the others stand by)
HOSTS_KEY = "hosts"  # every host's liveness (live or lost), put by the active planner
MODELS_KEY = "models"  # every servable model and its load state, put by the active planner


def plan_key(host_id: str) -> str:
    return f"plan.{host_token(host_id)}"


def report_key(host_id: str) -> str:
    return f"report.{host_token(host_id)}"


def status_key(host_id: str) -> str:
    return f"status.{host_token(host_id)}"


PLAN_KEYS = "plan.*"
STATUS_KEYS = "status.*"


USAGE_BUCKET = "lanes-usage"  # tenants' token usage, one key per tenant and gateway (gateways write it)
USAGE_KEYS = "usage.>"


def gateway_tokens(gateway: str) -> str:
    """A gateway's id as subject tokens. "user.instance" is two: the NATS user it shares with
    its replicas, then the instance (docker/nats/auth.conf grants `<user>.*`), so gateways
    that share a user never write each other's usage or activity."""
    return ".".join(host_token(part) for part in gateway.split(".", 1))


def gateway_user(gateway: str) -> str:
    """The NATS user part of a gateway's id (its inbox prefix is that user's)."""
    return gateway.split(".", 1)[0]


def usage_key(tenant: str, gateway: str) -> str:
    return f"usage.{host_token(tenant)}.{gateway_tokens(gateway)}"


# Each lane's API key (llama-server --api-key-file, new at every start): put by its agent, read by
# gateways alone. Its own bucket, so NATS permissions can keep it from every other user
# (docker/nats/auth.conf); made by the planner, in memory (an agent puts its keys again).
SECRETS_BUCKET = "lanes-secrets"
SECRETS_STREAM = f"KV_{SECRETS_BUCKET}"
ALL_SECRETS = ">"


SESSION_SECRET_KEY = "dashboard"  # the dashboard cookies' signing secret, made by the first gateway


def lane_secret_key(host_id: str, lane_id: str) -> str:
    return f"lane.{host_token(host_id)}.{host_token(lane_id)}"


def host_secrets(host_id: str) -> str:
    """Every lane secret of one host (an agent's keys to sweep)."""
    return f"lane.{host_token(host_id)}.*"


def kv_subject(key: str) -> str:
    """The JetStream subject behind a KV key (what NATS permissions are written against)."""
    return f"$KV.{BUCKET}.{key}"


# ------------------------------------------------------------- plain subjects


def event_subject(host_id: str, lane_id: str, event: str) -> str:
    return f"{PREFIX}.event.{host_token(host_id)}.{host_token(lane_id)}.{event}"


def telemetry_subject(host_id: str) -> str:
    return f"{PREFIX}.telemetry.{host_token(host_id)}"


def load_subject(host_id: str) -> str:
    """Each serving lane's load as its agent read it from /slots (HostLoad), for every gateway."""
    return f"{PREFIX}.load.{host_token(host_id)}"


# A gateway that starts or reconnects asks every agent to say its lanes' load at the next read.
LOAD_ASK = f"{PREFIX}.loadask"


def rejected_subject(host_id: str) -> str:
    return f"{PREFIX}.rejected.{host_token(host_id)}"


def wake_subject(model: str) -> str:
    """A gateway asks the planner to load a model it holds requests for."""
    return f"{PREFIX}.wake.{host_token(model)}"


def activity_subject(gateway: str) -> str:
    """A gateway's per-model requests in flight, queued and idle time. The subject names the
    gateway: the planner drops a report whose `gateway` differs, and where NATS auth is on,
    a gateway's user may publish on its own subjects only (docker/nats/auth.conf)."""
    return f"{PREFIX}.activity.{gateway_tokens(gateway)}"


def prefix_subject(host_id: str, lane_id: str) -> str:
    """What gateways learnt of one lane's prompt cache (PrefixEvent), in stream PREFIX_STREAM."""
    return f"{PREFIX}.prefix.{host_token(host_id)}.{host_token(lane_id)}"


def kv_events_subject(host_id: str, lane_id: str) -> str:
    """The same events in vLLM's KVEventBatch form (msgpack), for Dynamo- or llm-d-style indexers."""
    return f"{PREFIX}.kvevents.{host_token(host_id)}.{host_token(lane_id)}"


def slot_offer_subject(host_id: str) -> str:
    """A host's offers of saved slots to another lane (SlotsOffer, shared/messages/slots.py)."""
    return f"{PREFIX}.slots.{host_token(host_id)}.offer"


def slot_ask_subject(host_id: str) -> str:
    """A gateway's ask that a hot lane of this host spread idle conversations (SlotsAsk)."""
    return f"{PREFIX}.slots.{host_token(host_id)}.ask"


def slot_chunk_subject(host_id: str, move: str, part: str, n: int) -> str:
    """One 512 KiB piece of an offered slot file, in stream SLOTS_STREAM."""
    return f"{PREFIX}.slots.{host_token(host_id)}.{host_token(move)}.{host_token(part)}.{n}"


SLOTS_STREAM = "LANES_SLOTS"  # the offered slot files' pieces (made by the planner, bounded, short-lived)
SLOT_CHUNKS = f"{PREFIX}.slots.*.*.*.*"
ALL_SLOT_OFFERS = f"{PREFIX}.slots.*.offer"
PREFIX_STREAM = "LANES_PREFIX"  # JetStream stream of every lane's prefix subject
ALL_PREFIX = f"{PREFIX}.prefix.>"
ALL_WAKES = f"{PREFIX}.wake.*"
ALL_ACTIVITY = f"{PREFIX}.activity.>"
ALL_EVENTS = f"{PREFIX}.event.>"
ALL_REJECTED = f"{PREFIX}.rejected.*"
ALL_LOAD = f"{PREFIX}.load.*"


# ------------------------------------------------------------- request/reply (micro endpoints)

PLANNER_GROUP = f"{PREFIX}.planner"
CONFIG_GET = f"{PLANNER_GROUP}.config.get"
CONFIG_SET = f"{PLANNER_GROUP}.config.set"
DEMAND_SET = f"{PLANNER_GROUP}.demand.set"
PLAN_GET = f"{PLANNER_GROUP}.plan.get"
PLAN_EXPLAIN = f"{PLANNER_GROUP}.plan.explain"
FLEET_STATUS = f"{PLANNER_GROUP}.fleet.status"
PLANNER_STATUS = f"{PLANNER_GROUP}.status"  # the same answer as FLEET_STATUS
PLANNER_INFO = f"{PLANNER_GROUP}.info"


def agent_group(host_id: str) -> str:
    return f"{PREFIX}.agent.{host_token(host_id)}"


def agent_status(host_id: str) -> str:
    return f"{agent_group(host_id)}.status"


def agent_info(host_id: str) -> str:
    return f"{agent_group(host_id)}.info"


def agent_inbox(host_id: str) -> str:
    """The inbox prefix of an agent's connection: its replies, and no one else's."""
    return f"_INBOX_{host_token(host_id)}"


def gateway_inbox(gateway: str) -> str:
    """The inbox prefix of a gateway's connection: its NATS user's (the part of its id before a dot)."""
    return agent_inbox(gateway_user(gateway))


def endpoint_tail(subject: str, group: str) -> str:
    """An endpoint's subject inside its micro-service group (the group adds the prefix)."""
    if not subject.startswith(group + "."):
        raise ValueError(f"{subject!r} is not in group {group!r}")
    return subject[len(group) + 1 :]
