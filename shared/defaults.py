"""Every default two parts of lanes share, once, by concern: timing, ports, sizes.

The CLI (lanes/cli.py), the services (agent, planner, gateway), the messages' field defaults
(shared/messages/) and the docs' tables (docs/gateway.md, docs/operations.md and the generated
docs/reference/config.md) all read these; tests/test_defaults.py checks that the CLI, the messages
and the docs agree with them. Imports nothing of lanes.
"""

from __future__ import annotations

MIB = 1024 * 1024

# ------------------------------------------------------------------ timing (seconds)

REPORT_INTERVAL = 30.0  # an agent's host report; a host is lost after 3 silent intervals
PROBE_INTERVAL = 5.0  # an agent's /health probe of each serving lane
LOAD_INTERVAL = 0.5  # an agent's /slots read of each serving lane: the load it publishes for the gateways
LOAD_REFRESH = 10.0  # ... published whole this often even when nothing changed (a gateway drops it after 3)
PROBE_FAILURES = 3  # missed probes in a row that make a lane unresponsive
STALL_SECONDS = 120.0  # a lane's inference loop without progress this long is unresponsive
LEASE_TTL = 5.0  # a stand-by planner takes over after the lease stood still this long
KEY_REREAD = 30.0  # a followed KV key (an agent's plan) is read again this often, written or not
DRAIN_TIMEOUT = 30.0  # a draining lane's requests in flight may finish within this
QUEUE_WAIT = 30.0  # a gateway request waits this long for a slot (then 503)
CRITICAL_QUEUE_WAIT = 120.0  # ... a request of priority class critical (keys file)
FAIR_HALF_LIFE = 60.0  # a tenant's consumed tokens count half after this long (token-fair queueing)
OUTPUT_WEIGHT = 2.0  # an output token costs this many prompt tokens (fairness and token limits)
USAGE_SYNC_INTERVAL = 1.0  # seconds between a gateway's writes of its tenants' usage to NATS
KEYS_REREAD = 1.0  # seconds between checks of the keys file for a change
FLEET_SYNC_WAIT = 10.0  # a request to a gateway that has not read the fleet yet waits this long for it (then 503)
PREFIX_MAX_AGE = 3600.0  # the shared prefix view's events are kept this long (stream LANES_PREFIX)

# ------------------------------------------------------------------ ports

LANE_PORT_BASE = 8080  # an agent's lanes listen on LANE_PORT_BASE .. + LANE_PORT_COUNT - 1
LANE_PORT_COUNT = 16
RPC_WORKER_PORT_BASE = 50052  # ggml-rpc-server's own default port
RPC_WORKER_PORT_COUNT = 4
NATS_PORT = 4222  # `lanes up`'s embedded nats-server
GATEWAY_PORT = 8000
METRICS_BIND = "127.0.0.1"  # the planner's and agents' /metrics listen here unless told otherwise

# ------------------------------------------------------------------ sizes

N_UBATCH = 512  # llama-server's --ubatch-size default: the SWA cache and compute buffers follow it
QUEUE_DEPTH = 64  # requests a gateway holds waiting per model (then 503)
STANDARD_CEILING = 0.9  # share of QUEUE_DEPTH a standard request may find waiting and still join (then 429)
SHEDDABLE_CEILING = 0.5  # ... a sheddable one
PREFIX_HISTORY = 2048  # prefix events kept per lane (one a request): what a late gateway replays
HEADROOM_BYTES = 512 * MIB  # memory the planner leaves free on every host, beyond headroom_fraction
SLOT_CACHE_BYTES = 4096 * MIB  # disk per host for saved slots (a lane's hot prompts across restarts); 0: none

# ------------------------------------------------------------------ speculative decoding

# A persona's speculative decoding unless it says otherwise. Off: bench/spec_bench.py measured n-gram
# speculators up to 2.6x faster on copy-heavy work (ngram-simple), but each costs n_vocab x 4 bytes x 48-64 drafted
# outputs per slot (48-64 MiB per slot for Gemma's 262k vocabulary) whatever the work, and the planner
# cannot know a lane's work; `auto` (per persona or fleet) turns on what the figures favour.
SPECULATIVE = "off"
