"""`lanes doctor`: can this host serve lanes? One line per check, each failure with its fix, so an
operator reads one screen instead of an agent's logs. It takes the agent's own options and
changes nothing (it writes only a probe file in the data folder, and removes it)."""

from __future__ import annotations

import argparse
import asyncio
import shutil
import socket
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

GIB = 1024**3
CONNECT_WITHIN = 8.0  # seconds for the first NATS connection (a refused one is retried inside nats-py)
MIN_FREE_DISK = 2 * GIB  # lane logs, JetStream of `lanes up`, the model-facts cache
MIN_FREE_RAM = GIB  # the planner's default headroom (512 MiB and 5%) and a small lane


@dataclass(frozen=True)
class Check:
    what: str
    level: str  # "ok", "warn" (serves, with a limit) or "FAIL" (cannot serve)
    detail: str
    fix: str = ""

    def line(self) -> str:
        return f"{self.level:<4}  {self.what}: {self.detail}" + (f"  -> {self.fix}" if self.fix else "")


def check_binary(explicit: str | None) -> tuple[Check, str | None]:
    from launcher_agent.probe import ProbeError, find_llama_server, probe

    binary = find_llama_server(explicit)
    if binary is None:
        return Check("llama-server", "FAIL", "not found (--llama-server, $LLAMA_SERVER_BIN, PATH, lanes install-llama)",
                     "run `lanes install-llama`, or pass --llama-server PATH"), None  # fmt: skip
    try:
        caps = probe(binary)
    except ProbeError as exc:
        return Check("llama-server", "FAIL", str(exc), f"check that `{binary} --version` runs on this host"), None
    fa = "-fa on|off|auto" if caps.flash_attn_form == "value" else "-fa (a bare switch: old build)"
    detail = (f"{binary} (build {caps.build or 'unknown'}): {fa}, cache types {' '.join(caps.cache_types)}, "
              f"RPC {'yes' if caps.has_rpc else 'no'}, KV layout {caps.kv_layout}")  # fmt: skip
    return Check("llama-server", "ok", detail), binary


def check_gpus(binary: str | None) -> Check:
    from launcher_agent.hardware import apple_gpus, gpu_backend_of, nvidia_gpus

    gpus = list(nvidia_gpus()) + (list(apple_gpus()) if sys.platform == "darwin" else [])
    if not gpus:
        if shutil.which("nvidia-smi"):
            from importlib.util import find_spec

            if find_spec("pynvml") is None:
                return Check("gpus", "warn", "nvidia-smi is here but NVML is not importable: lanes plan for the CPU",
                             "pip install 'lanes[nvidia]' (nvidia-ml-py)")  # fmt: skip
            return Check("gpus", "warn", "nvidia-smi is here but NVML lists no GPU: lanes plan for the CPU",
                         "check the driver: `nvidia-smi` must list the GPUs")  # fmt: skip
        return Check("gpus", "ok", "none seen (NVML, Metal): lanes run on the CPU")
    names = ", ".join(f"{g.device} {g.name} {g.vram_total / GIB:.0f} GiB" for g in gpus)
    if binary is None:
        return Check("gpus", "warn", f"{names}; no llama-server to check for their backend")
    backend = gpu_backend_of(binary)
    wanted = {g.backend for g in gpus}
    if backend not in wanted:
        return Check("gpus", "warn", f"{names}, but {binary} lists no {'/'.join(sorted(wanted))} device: lanes run on the CPU",
                     "use a llama-server built with that backend (e.g. -DGGML_CUDA=ON) via --llama-server")  # fmt: skip
    return Check("gpus", "ok", f"{names}; the binary's backend: {backend}")


def check_ports(bind: str, base: int, count: int) -> Check:
    busy = []
    for port in range(base, base + count):
        with socket.socket(socket.AF_INET6 if ":" in bind else socket.AF_INET) as s:
            try:
                s.bind((bind, port))
            except OSError:
                busy.append(port)
    span = f"{base}-{base + count - 1} on {bind}"
    if len(busy) == count:
        return Check("ports", "FAIL", f"every port of {span} is taken",
                     "pick a free range with --port-base/--port-count")  # fmt: skip
    if busy:
        return Check("ports", "warn", f"{count - len(busy)} of {count} free in {span}; taken: "
                     f"{', '.join(map(str, busy[:8]))}{' ...' if len(busy) > 8 else ''}",
                     "lanes skip taken ports; free them or move the range for more lanes")  # fmt: skip
    return Check("ports", "ok", f"all {count} of {span} free")


def check_memory(max_ram: int | None) -> Check:
    """What the agent will report: the machine's RAM, or the memory cgroup's where it runs under a
    limit (a container's), which the kernel enforces whatever the machine has free."""
    import psutil

    from launcher_agent.cgroup_memory import this_group
    from launcher_agent.hardware import ram

    machine = psutil.virtual_memory().total
    _, total, available = ram()
    group = this_group()
    where = (f"; the memory cgroup it runs in (a container's limit) allows {group.limit / GIB:.1f} of the machine's "
             f"{machine / GIB:.1f} GiB" if group is not None and group.limit < machine else "")  # fmt: skip
    if max_ram:
        where += f"; --max-ram caps the lanes at {min(max_ram, total) / GIB:.1f} GiB"
        total, available = min(total, max_ram), min(available, max_ram)
    detail = f"{available / GIB:.1f} GiB free of {total / GIB:.1f} GiB{where}"
    if available < MIN_FREE_RAM:
        return Check("memory", "warn", detail + ": too little for a lane beside the planner's headroom",
                     "free memory, or raise the container's memory limit")  # fmt: skip
    return Check("memory", "ok", detail)


def check_data(data: Path) -> Check:
    try:
        data.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=data, prefix=".doctor-"):
            pass
    except OSError as exc:
        return Check("data", "FAIL", f"{data} is not writable: {exc.strerror or exc}",
                     "pass --data a folder this user may write, or fix its owner")  # fmt: skip
    free = shutil.disk_usage(data).free
    if free < MIN_FREE_DISK:
        return Check("data", "warn", f"{data} writable, only {free / GIB:.1f} GiB free",
                     f"free at least {MIN_FREE_DISK // GIB} GiB for lane logs and state")  # fmt: skip
    return Check("data", "ok", f"{data} writable, {free / GIB:.0f} GiB free")


def check_models(folders: list[str], rpc_worker: bool) -> list[Check]:
    from shared.gguf_scan import read_header

    if not folders:
        level = "ok" if rpc_worker else "FAIL"
        return [Check("models", level, "no --models folder" + (": a worker needs none" if rpc_worker else ""),
                      "" if rpc_worker else "pass --models FOLDER holding .gguf files")]  # fmt: skip
    good, bad = [], []
    for folder in map(Path, folders):
        if not folder.is_dir():
            bad.append(f"{folder} (not a folder)")
            continue
        for path in sorted(folder.rglob("*.gguf")):
            try:
                read_header(path)
                good.append(path.name)
            except OSError as exc:
                bad.append(f"{path.name} ({exc.strerror or exc})")
            except ValueError as exc:
                bad.append(f"{path.name} (not a GGUF file: {exc})")
    checks = []
    if good:
        shown = ", ".join(good[:6]) + (f" and {len(good) - 6} more" if len(good) > 6 else "")
        checks.append(Check("models", "ok", f"{len(good)} readable: {shown}"))
    elif not rpc_worker:
        checks.append(Check("models", "FAIL", f"no readable .gguf file in {', '.join(folders)}",
                            "put GGUF models there, readable by this user"))  # fmt: skip
    if bad:
        checks.append(Check("models", "warn", f"{len(bad)} not usable: {'; '.join(bad[:6])}",
                            "fix their permissions or replace the broken files"))  # fmt: skip
    return checks


async def check_nats(servers: str, auth, host_id: str) -> list[Check]:
    """Connect as the agent would, then try what an agent needs: follow its plan key (subscribe) and
    read it directly (a JetStream API request). Nothing is written."""
    import nats

    from shared import subjects

    errors: list[str] = []
    urls = [u.strip() for u in servers.split(",") if u.strip()]
    reached = [u for u in urls if _reachable(u)]
    if not reached:
        return [Check("nats", "FAIL", f"nothing answers at {servers}: {'; '.join(errors) or 'refused'}",
                      "start NATS there, or pass --nats URL (or LANES_NATS_URL)")]  # fmt: skip

    async def error_cb(exc: Exception) -> None:
        errors.append(str(exc) or type(exc).__name__)

    try:
        # nats-py keeps retrying a refused first connect on its own: bound it
        nc = await asyncio.wait_for(nats.connect(
            servers=reached, name="lanes-doctor", connect_timeout=3,
            max_reconnect_attempts=0, allow_reconnect=False, error_cb=error_cb,
            inbox_prefix=f"_INBOX_{host_id}".encode(), **auth.connect_options()), CONNECT_WITHIN)  # fmt: skip
    except (Exception, asyncio.TimeoutError) as exc:
        why = "; ".join(dict.fromkeys(errors + [str(exc) or type(exc).__name__]))
        fix = ("check --user/--password, --token, --creds or --nkey against the server's auth config"
               if "author" in why.lower() or "authen" in why.lower() else "start NATS, or pass --nats URL")
        return [Check("nats", "FAIL", f"cannot connect to {servers}: {why}", fix)]
    checks = [Check("nats", "ok", f"connected to {nc.connected_url.netloc if nc.connected_url else servers}")]
    try:
        plan_key = f"$KV.{subjects.BUCKET}.{subjects.plan_key(host_id)}"
        await nc.subscribe(plan_key)
        await nc.flush(timeout=3)
        denied = [e for e in errors if "permission" in e.lower()]
        try:
            await nc.request(f"$JS.API.DIRECT.GET.KV_{subjects.BUCKET}.{plan_key}", b"", timeout=2)
        except nats.errors.NoRespondersError:
            checks.append(Check("nats", "warn", f"no KV bucket {subjects.BUCKET!r} yet", "start `lanes planner`"))
        except Exception as exc:
            denied += [e for e in errors if "permission" in e.lower() and e not in denied] or [f"direct get: {exc}"]
        if denied:
            checks.append(Check("nats", "FAIL", f"as this user the agent may not follow its plan: {'; '.join(denied)}",
                                f"allow subscribe {plan_key} and publish $JS.API.DIRECT.GET.KV_{subjects.BUCKET}.> "
                                "(docker/nats/auth.conf's agent block)"))  # fmt: skip
        else:
            checks.append(Check("nats", "ok", f"may follow and read its plan ({plan_key}); publish rights show at "
                                "its first report"))  # fmt: skip
    finally:
        await nc.close()
    return checks


def _reachable(url: str) -> bool:
    from urllib.parse import urlsplit

    parts = urlsplit(url if "://" in url else f"nats://{url}")
    try:
        socket.create_connection((parts.hostname or "127.0.0.1", parts.port or 4222), timeout=3).close()
        return True
    except OSError:
        return False


def run_checks(args: argparse.Namespace) -> list[Check]:
    from launcher_agent.config import default_host_id
    from shared.nats_auth import auth_from_args

    host_id = args.host_id or default_host_id()
    binary_check, binary = check_binary(args.llama_server)
    checks = [binary_check, check_gpus(binary)]
    checks += asyncio.run(check_nats(args.nats, auth_from_args(args), host_id))
    checks.append(check_memory(args.max_ram))
    checks.append(check_ports(args.bind, args.port_base, args.port_count))
    checks.append(check_data(Path(args.data) if args.data else Path.home() / ".lanes" / "agent"))
    checks += check_models(args.models, args.rpc_worker)
    return checks


def cmd_doctor(args: argparse.Namespace) -> int:
    checks = run_checks(args)
    for check in checks:
        print(check.line())
    failed = [c for c in checks if c.level == "FAIL"]
    print(f"this host {'cannot serve: ' + str(len(failed)) + ' to fix' if failed else 'can serve lanes'}")
    return 1 if failed else 0
