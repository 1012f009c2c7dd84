"""This host's report: hardware, llama-server's capabilities and the models it holds.

Pure of NATS, so `lanes report` builds the same report an agent publishes.
"""

from __future__ import annotations

import structlog

from launcher_agent import hardware
from launcher_agent.config import AgentConfig
from shared.gguf_facts import scan_models
from shared.messages import HostReport

log = structlog.get_logger("lanes.agent")
VERSION = "0.1.0"


def host_report(cfg: AgentConfig, lanes_rss: int = 0, facts_cache: dict | None = None) -> HostReport:
    """`facts_cache` keeps each GGUF's facts between reports (a file is read once per change)."""
    cores, total, available = hardware.ram()
    if cfg.max_ram:
        total = min(total, cfg.max_ram)
        available = min(available, total)
    models, problems = scan_models(cfg.model_dirs, {} if facts_cache is None else facts_cache)
    for p in problems:
        log.warning("skipped model file", problem=p)
    return HostReport(
        host_id=cfg.host_id,
        cpu_cores=cores,
        ram_total=total,
        ram_available=available,
        lanes_rss=lanes_rss,
        gpus=hardware.nvidia_gpus(),
        server=cfg.caps,
        models=tuple(models),
        port_base=cfg.port_base,
        port_count=cfg.port_count,
        lane_bind=cfg.bind,
        agent_version=VERSION,
        report_interval=cfg.report_interval,
    )
