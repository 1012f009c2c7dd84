"""An agent's configuration from the command line: binary found and probed, folders checked."""

from __future__ import annotations

import argparse
from pathlib import Path

from lanes.errors import UserError
from launcher_agent.config import AgentConfig, default_host_id
from launcher_agent.probe import ProbeError, find_llama_server, probe
from shared import defaults


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
    if not args.models and not getattr(args, "rpc_worker", False):
        raise UserError("--models: give at least one model folder (only a --rpc-worker may hold none)")
    worker = _rpc_worker_settings(args, binary)
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
        port_count=getattr(args, "port_count", defaults.LANE_PORT_COUNT),
        bind=getattr(args, "bind", "127.0.0.1"),
        report_interval=getattr(args, "report_interval", defaults.REPORT_INTERVAL),
        tick=getattr(args, "tick", 0.5),
        max_ram=getattr(args, "max_ram", None),
        dry_run=getattr(args, "dry_run", False),
        probe_interval=getattr(args, "probe_interval", defaults.PROBE_INTERVAL),
        probe_failures=getattr(args, "probe_failures", defaults.PROBE_FAILURES),
        stall_seconds=getattr(args, "stall_seconds", defaults.STALL_SECONDS),
        rpc_servers=tuple(e for e in (getattr(args, "rpc", None) or "").split(",") if e),
        advertise=getattr(args, "advertise", None) or "",
        metrics_port=getattr(args, "metrics_port", None),
        metrics_host=getattr(args, "metrics_bind", defaults.METRICS_BIND),
        lane_env=tuple(getattr(args, "lane_env", None) or ()),
        lane_user=_lane_user(getattr(args, "lane_user", None), data_dir, args.models),
        **worker,
    )


def _lane_user(name: str | None, data_dir: Path, models: list[str]):
    """The lane user, once it can reach what a lane opens: its key file under --data, the models."""
    from launcher_agent.lane_user import lane_user

    try:
        user = lane_user(name)
    except ValueError as exc:
        raise UserError(f"--lane-user: {exc}") from None
    # (below --data the agent opens the way itself; a models folder must be passable too)
    wanted = [("--data", data_dir, data_dir)] + [("--models", Path(m), Path(m) / "model.gguf") for m in models]
    for what, folder, probe_path in wanted:
        if user is not None and (blocked := user.blocked_at(probe_path)) is not None:
            raise UserError(f"--lane-user {user.name} cannot pass through {blocked} to reach {what} {folder}: "
                            f"choose a folder it can reach (e.g. under /var/lib/lanes) or open {blocked} to it (o+x)")
    return user


def _rpc_worker_settings(args: argparse.Namespace, llama_server: str) -> dict:
    """--rpc-worker's fields of the AgentConfig; the operator names the address it binds."""
    if not getattr(args, "rpc_worker", False):
        return {}
    if not getattr(args, "advertise", None):
        raise UserError("--rpc-worker needs --advertise ADDRESS: ggml-rpc-server binds only the address you name")
    if args.advertise in ("0.0.0.0", "::"):
        raise UserError("--advertise for --rpc-worker must be one address, not a wildcard")
    try:
        base_text, _, count_text = args.rpc_worker_ports.partition(":")
        base, count = int(base_text), int(count_text or "1")
    except ValueError:
        raise UserError(f"--rpc-worker-ports {args.rpc_worker_ports}: use PORT:COUNT, e.g. 50052:4") from None
    if not (1 <= base <= 65535 and 1 <= count <= 1000 and base + count - 1 <= 65535):
        raise UserError(f"--rpc-worker-ports {args.rpc_worker_ports}: ports must lie in 1..65535, 1 to 1000 of them")
    binary = args.rpc_server or _beside(llama_server)
    if binary is None:
        from lanes.install_rpc import rpc_bin_dir

        found = rpc_bin_dir()
        binary = str(found / "ggml-rpc-server") if found else None
    if binary is None or not Path(binary).is_file():
        raise UserError("--rpc-worker: no ggml-rpc-server found: pass --rpc-server or run `lanes install-llama --rpc`")
    return {"rpc_worker": True, "rpc_worker_port_base": base, "rpc_worker_port_count": count,
            "rpc_server_binary": binary}  # fmt: skip


def _beside(llama_server: str) -> str | None:
    candidate = Path(llama_server).resolve().parent / "ggml-rpc-server"
    return str(candidate) if candidate.is_file() else None
