"""An agent's configuration from the command line: binary found and probed, folders checked."""

from __future__ import annotations

import argparse
from pathlib import Path

from lanes.errors import UserError
from launcher_agent.config import AgentConfig, default_host_id
from launcher_agent.probe import ProbeError, find_llama_server, probe


def agent_config(args: argparse.Namespace, data_dir: Path) -> AgentConfig:
    binary = find_llama_server(args.llama_server)
    if binary is None:
        raise UserError(
            "no llama-server found: pass --llama-server, set LLAMA_SERVER_BIN, or run `lanes install-llama`"
        )
    try:
        caps = probe(binary)
    except ProbeError as exc:
        raise UserError(str(exc)) from None
    for folder in args.models:
        if not Path(folder).is_dir():
            raise UserError(f"--models {folder}: not a folder")
    return AgentConfig(
        host_id=args.host_id or default_host_id(),
        model_dirs=[str(Path(m).resolve()) for m in args.models],
        binary=binary,
        caps=caps,
        data_dir=data_dir,
        port_base=args.port_base,
        port_count=getattr(args, "port_count", 16),
        bind=getattr(args, "bind", "127.0.0.1"),
        report_interval=getattr(args, "report_interval", 30.0),
        tick=getattr(args, "tick", 0.5),
        max_ram=getattr(args, "max_ram", None),
        dry_run=getattr(args, "dry_run", False),
        probe_interval=getattr(args, "probe_interval", 5.0),
        probe_failures=getattr(args, "probe_failures", 3),
        rpc_servers=tuple(e for e in (getattr(args, "rpc", None) or "").split(",") if e),
        advertise=getattr(args, "advertise", None) or "",
        metrics_port=getattr(args, "metrics_port", None),
    )
