"""Each shared default (shared/defaults.py) is what the CLI's --help shows, what the messages
and service settings default to, and what the docs' tables say (docs/gateway.md, docs/operations.md
and the generated docs/reference/config.md)."""

from __future__ import annotations

import argparse
import re
from pathlib import Path

import msgspec
import pytest

from gateway.admission.queue import Admission
from gateway.settings import GatewaySettings
from gateway.admission.waking import Waker
from lanes.cli import DEFAULT_NATS, build_parser
from lanes.tables import parse_size
from launcher_agent.config import AgentConfig
from launcher_agent.health import Rules
from planner_svc.lease import DEFAULT_TTL
from shared import defaults as d
from shared.memory import DEFAULT_N_UBATCH
from shared.messages.activity import PlannerLease
from shared.messages.config import FleetConfig
from shared.messages.hosts import HostReport, RpcWorkerOffer
from shared.messages.plans import HostPlan, LaneSpec

DOCS = Path(__file__).resolve().parent.parent / "docs"
TABLE_PAGES = [DOCS / "gateway.md", DOCS / "operations.md", DOCS / "reference" / "config.md"]
RPC_PORTS = f"{d.RPC_WORKER_PORT_BASE}:{d.RPC_WORKER_PORT_COUNT}"

# (subcommands, option, the default)
CLI = [
    (("agent",), "--report-interval", d.REPORT_INTERVAL),
    (("agent",), "--probe-interval", d.PROBE_INTERVAL),
    (("agent",), "--probe-failures", d.PROBE_FAILURES),
    (("agent", "report", "up", "doctor"), "--port-base", d.LANE_PORT_BASE),
    (("agent", "report", "doctor"), "--port-count", d.LANE_PORT_COUNT),
    (("agent", "report"), "--rpc-worker-ports", RPC_PORTS),
    (("planner",), "--lease-ttl", d.LEASE_TTL),
    (("up",), "--nats-port", d.NATS_PORT),
    (("up",), "--gateway-port", d.GATEWAY_PORT),
    (("gateway",), "--port", d.GATEWAY_PORT),
    (("gateway",), "--queue-depth", d.QUEUE_DEPTH),
    (("gateway",), "--queue-wait", d.QUEUE_WAIT),
    (("estimate",), "--ubatch", d.N_UBATCH),
]

# (struct or dataclass, field, the default)
FIELDS = [
    (HostReport, "report_interval", d.REPORT_INTERVAL),
    (HostReport, "port_base", d.LANE_PORT_BASE),
    (HostReport, "port_count", d.LANE_PORT_COUNT),
    (RpcWorkerOffer, "port_base", d.RPC_WORKER_PORT_BASE),
    (RpcWorkerOffer, "port_count", d.RPC_WORKER_PORT_COUNT),
    (FleetConfig, "n_ubatch", d.N_UBATCH),
    (FleetConfig, "headroom_bytes", d.HEADROOM_BYTES),
    (FleetConfig, "drain_timeout", d.DRAIN_TIMEOUT),
    (FleetConfig, "slot_cache_bytes", d.SLOT_CACHE_BYTES),
    (HostPlan, "slot_cache_bytes", d.SLOT_CACHE_BYTES),
    (FleetConfig, "speculative", d.SPECULATIVE),
    (LaneSpec, "n_ubatch", d.N_UBATCH),
    (HostPlan, "drain_timeout", d.DRAIN_TIMEOUT),
    (PlannerLease, "ttl", d.LEASE_TTL),
    (AgentConfig, "report_interval", d.REPORT_INTERVAL),
    (AgentConfig, "probe_interval", d.PROBE_INTERVAL),
    (AgentConfig, "probe_failures", d.PROBE_FAILURES),
    (AgentConfig, "port_base", d.LANE_PORT_BASE),
    (AgentConfig, "port_count", d.LANE_PORT_COUNT),
    (AgentConfig, "rpc_worker_port_base", d.RPC_WORKER_PORT_BASE),
    (AgentConfig, "rpc_worker_port_count", d.RPC_WORKER_PORT_COUNT),
    (Rules, "probe_interval", d.PROBE_INTERVAL),
    (Rules, "probe_failures", d.PROBE_FAILURES),
    (GatewaySettings, "port", d.GATEWAY_PORT),
    (GatewaySettings, "queue_depth", d.QUEUE_DEPTH),
    (GatewaySettings, "queue_wait", d.QUEUE_WAIT),
    (Admission, "max_queue", d.QUEUE_DEPTH),
    (Admission, "max_wait", d.QUEUE_WAIT),
    (Waker, "max_held", d.QUEUE_DEPTH),
]

# docs table rows: (first-column name, the default)
DOC_ROWS = [
    ("--report-interval", d.REPORT_INTERVAL),
    ("--probe-interval", d.PROBE_INTERVAL),
    ("--probe-failures", d.PROBE_FAILURES),
    ("--port-base", d.LANE_PORT_BASE),
    ("--port-count", d.LANE_PORT_COUNT),
    ("--rpc-worker-ports", RPC_PORTS),
    ("--lease-ttl", d.LEASE_TTL),
    ("--nats-port", d.NATS_PORT),
    ("--gateway-port", d.GATEWAY_PORT),
    ("--port", d.GATEWAY_PORT),
    ("--queue-depth", d.QUEUE_DEPTH),
    ("--queue-wait", d.QUEUE_WAIT),
    ("--ubatch", d.N_UBATCH),
    ("n_ubatch", d.N_UBATCH),
    ("headroom_bytes", d.HEADROOM_BYTES),
    ("drain_timeout", d.DRAIN_TIMEOUT),
    ("slot_cache_bytes", d.SLOT_CACHE_BYTES),
    ("speculative", d.SPECULATIVE),
]


def _subparser(name: str) -> argparse.ArgumentParser:
    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    return sub.choices[name]


@pytest.mark.parametrize(("commands", "option", "value"), CLI, ids=[f"{c[0]} {o}" for c, o, _ in CLI])
def test_cli_defaults_and_help(commands, option, value):
    for command in commands:
        parser = _subparser(command)
        action = next(a for a in parser._actions if option in a.option_strings)
        assert action.default == value, f"lanes {command} {option}"
        help_text = " ".join(parser.format_help().split())  # argparse wraps lines
        assert f"(default {value})" in help_text, f"lanes {command} --help shows no default for {option}"


@pytest.mark.parametrize(("kind", "name", "value"), FIELDS, ids=[f"{k.__name__}.{n}" for k, n, _ in FIELDS])
def test_message_and_settings_defaults(kind, name, value):
    if issubclass(kind, msgspec.Struct):
        default = next(f.default for f in msgspec.structs.fields(kind) if f.name == name)
    else:
        default = kind.__dataclass_fields__[name].default
    assert default == value


def test_module_level_copies():
    assert DEFAULT_N_UBATCH == d.N_UBATCH
    assert DEFAULT_TTL == d.LEASE_TTL
    assert DEFAULT_NATS.endswith(f":{d.NATS_PORT}")


def _doc_defaults() -> dict[str, str]:
    """Every table row's names (backticked, first column) with their defaults (the column headed
    `default`, one per name where the row lists as many)."""
    found: dict[str, str] = {}
    lines = [line for page in TABLE_PAGES for line in page.read_text().splitlines()]
    column = 1
    for line in lines:
        if line.startswith("| ") and "| default |" in line:
            column = [c.strip() for c in line.strip("|").split("|")].index("default")
        if not line.startswith("|") or line.startswith("|---"):
            continue
        cells = [c.strip() for c in line.strip("|").split("|")]
        if len(cells) < 2:
            continue
        names = re.findall(r"`([^`]+)`", cells[0])
        values = [v.strip().strip("`") for v in cells[column].split(",")]
        if len(names) == len(values):
            for name, value in zip(names, values):
                found.setdefault(name, value)  # the first table wins: the fleet's keys come before a persona's
    return found


def _number(text: str) -> float | str:
    if re.fullmatch(r"\d+(\.\d+)? ?[KMG]iB", text):
        return parse_size(text.replace(" ", ""))
    try:
        return float(text)
    except ValueError:
        return text


@pytest.mark.parametrize(("name", "value"), DOC_ROWS, ids=[n for n, _ in DOC_ROWS])
def test_doc_tables(name, value):
    table = _doc_defaults()
    assert name in table, f"the docs have no table row for {name}"
    assert _number(table[name]) == (value if isinstance(value, str) else float(value))
