"""What one agent is told at start: its host, folders, binary, ports and timings."""

from __future__ import annotations

import socket
from dataclasses import dataclass
from pathlib import Path

from launcher_agent.lane_user import LaneUser
from shared import defaults, subjects
from shared.messages.hosts import ServerCaps


@dataclass
class AgentConfig:
    host_id: str
    model_dirs: list[str]
    binary: str
    caps: ServerCaps
    data_dir: Path
    port_base: int = defaults.LANE_PORT_BASE
    port_count: int = defaults.LANE_PORT_COUNT
    bind: str = "127.0.0.1"
    report_interval: float = defaults.REPORT_INTERVAL
    tick: float = 0.5
    max_ram: int | None = None  # an operator's cap on what lanes may plan for here
    backoff_base: float = 1.0
    dry_run: bool = False  # log the argv of each lane instead of launching it
    # Serving lanes are probed (GET /health, which never wakes a sleeping model) this often;
    # after probe_failures missed probes in a row the lane is unresponsive, then restarted.
    probe_interval: float = defaults.PROBE_INTERVAL
    probe_failures: int = defaults.PROBE_FAILURES
    probe_timeout: float = 2.0
    # Each serving lane's /slots is read this often and its load published for the gateways
    # (launcher_agent/load_feed.py); whole every load_refresh seconds even when nothing changed.
    load_interval: float = defaults.LOAD_INTERVAL
    load_refresh: float = defaults.LOAD_REFRESH
    stall_seconds: float = defaults.STALL_SECONDS  # no progress of a lane's inference loop this long: stalled, restarted
    feedback_ttl: float = 6 * 3600.0  # seconds an out-of-memory cap or a busy port is remembered
    # ggml-rpc-server endpoints this host's lanes may use as GPU-type devices (--rpc), in order.
    rpc_servers: tuple[str, ...] = ()
    # Where gateways reach this host's lanes; empty: the bind address (or, for 0.0.0.0, the host id).
    advertise: str = ""
    metrics_port: int | None = None  # serve /metrics on this port (0: any free); None: off
    metrics_host: str = defaults.METRICS_BIND  # --metrics-bind: another address only when told
    # --rpc-worker: this host may run ggml-rpc-server for span lanes of other hosts, bound to
    # `advertise` on a port of rpc_worker_port_base.. (rpc_worker_port_count ports).
    rpc_worker: bool = False
    rpc_worker_port_base: int = defaults.RPC_WORKER_PORT_BASE
    rpc_worker_port_count: int = defaults.RPC_WORKER_PORT_COUNT
    rpc_server_binary: str = ""
    # Variables of the agent's environment its lanes and ggml-rpc-servers also get (--lane-env),
    # beyond the allow-list of launcher_agent/child_env.py.
    lane_env: tuple[str, ...] = ()
    # The user lanes run as (--lane-user; launcher_agent/lane_user.py); None: the agent's own.
    lane_user: LaneUser | None = None


def default_host_id() -> str:
    return subjects.host_token(socket.gethostname().split(".")[0])
