"""This host's report: hardware, llama-server's capabilities and the models it holds.

Pure of NATS, so `lanes report` builds the same report an agent publishes.
"""

from __future__ import annotations

import msgspec
import structlog

from launcher_agent import cores as host_cores
from launcher_agent import hardware
from launcher_agent.config import AgentConfig
from shared.adapters import scan_adapters
from shared.gguf_facts import scan_models
from shared.messages.hosts import GpuInfo, HostReport, RpcWorkerOffer
from shared.version import VERSION

log = structlog.get_logger("lanes.agent")


def host_report(
    cfg: AgentConfig,
    lanes_rss: int = 0,
    facts_cache: dict | None = None,
    lane_pids: list[int] | None = None,
    lanes_gpu: dict[int, int] | None = None,
    workers_rss: int = 0,
    serving: tuple[str, ...] = (),
) -> HostReport:
    """`facts_cache` keeps each GGUF's facts between reports (a file is read once per change).

    `lanes_gpu` (GPU index -> bytes our lanes hold there, from their printed buffers) fills
    each GPU's lanes_vram where NVML has no per-process figure (RPC devices, no NVML).
    """
    cores, total, available = hardware.ram()
    if cfg.max_ram:
        total = min(total, cfg.max_ram)
        available = min(available, total)
    cpus = host_cores.host_cores()
    models, problems = scan_models(cfg.model_dirs, {} if facts_cache is None else facts_cache)
    adapters, adapter_problems = scan_adapters(cfg.model_dirs, models)
    for p in problems + adapter_problems:
        log.warning("skipped model file", problem=p)
    return HostReport(
        host_id=cfg.host_id,
        cpu_cores=cores,
        ram_total=total,
        ram_available=available,
        lanes_rss=lanes_rss,
        serving_lanes=serving,
        gpus=_gpus(cfg, lane_pids or [], lanes_gpu or {}),
        cpu_repack=hardware.cpu_repack(),
        server=cfg.caps,
        models=tuple(models),
        port_base=cfg.port_base,
        port_count=cfg.port_count,
        lane_bind=cfg.bind,
        agent_version=VERSION,
        renders_argv=True,
        report_interval=cfg.report_interval,
        cpu_physical=cpus.physical,
        cpu_performance=cpus.performance,
        cpu_ids=cpus.cpu_ids,
        rpc_worker=RpcWorkerOffer(address=cfg.advertise, port_base=cfg.rpc_worker_port_base,
                                  port_count=cfg.rpc_worker_port_count) if cfg.rpc_worker else None,  # fmt: skip
        workers_rss=workers_rss,
        adapters=tuple(adapters),
    )


def _gpus(cfg: AgentConfig, lane_pids: list[int], lanes_gpu: dict[int, int]) -> tuple[GpuInfo, ...]:
    gpus = list(hardware.nvidia_gpus(lane_pids) or hardware.apple_gpus())
    gpus += hardware.rpc_gpus(cfg.binary, cfg.rpc_servers, {i - len(gpus): b for i, b in lanes_gpu.items()}) if cfg.rpc_servers else []
    out = []
    for i, g in enumerate(gpus):
        if not g.lanes_vram and lanes_gpu.get(i):
            g = msgspec.structs.replace(g, lanes_vram=lanes_gpu[i])
        out.append(g)
    return tuple(out)
