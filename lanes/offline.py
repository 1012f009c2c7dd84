"""The offline commands: models, estimate, plan. No server needed."""

from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path

import msgspec

from lanes.errors import UserError
from lanes.files import load_file
from lanes.tables import gib, mib, parse_size, table
from launcher_agent.probe import ProbeError, probe
from planner_svc.planner import plan
from shared.gguf_facts import ModelError, read_model_facts
from shared.llama.flags import cache_pair, lane_args, needs_flash_attn
from shared.llama.flash_attn import resolve_flash_attn
from shared.memory import BLOCK_BYTES, MemoryModelError
from shared.memory.shape import LaneShape
from shared.memory.speculative import (
    DRAFT_KINDS, N_MAX, draft_shape, on_devices, speculator_host_bytes, target_shape, with_speculation,
)
from shared.messages.config import Demand, FleetConfig
from shared.messages.hosts import HostReport, ServerCaps
from shared.messages.plans import NGpuLayers


def cmd_models(args: argparse.Namespace) -> int:
    rows, facts = [], []
    for path in args.paths:
        files = sorted(Path(path).rglob("*.gguf")) if Path(path).is_dir() else [Path(path)]
        for f in files:
            try:
                facts.append(read_model_facts(f))
            except ModelError as exc:
                raise UserError(str(exc)) from None
    if args.json:
        print(msgspec.json.encode(facts).decode())
        return 0
    for m in facts:
        kv = sorted(set(m.n_head_kv))
        rows.append(
            [
                m.name,
                m.architecture,
                m.n_layer,
                "/".join(map(str, kv)),
                f"{m.head_dim_k}/{m.head_dim_v}",
                m.n_ctx_train,
                f"{m.n_swa} ({sum(m.swa_layers)}/{m.n_layer})" if m.n_swa else "-",
                ", ".join(k for k in (
                    "mla" if m.is_mla else "", "recurrent" if any(m.recurrent_layers) else "",
                    f"moe {m.n_expert}x{m.n_ff_exp} ({m.n_expert_used} used)" if m.n_expert else "",
                ) if k) or "-",  # fmt: skip
                mib(m.weight_bytes),
            ]
        )
    print(table(["model", "arch", "layers", "kv heads", "head k/v", "trained ctx", "swa", "kind", "weights"], rows))
    return 0


def _n_gpu_layers(text: str) -> NGpuLayers:
    """-ngl as llama-server reads it: a count, or all layers ("all", "auto" and -1 mean that here)."""
    if text in ("all", "auto", "-1"):
        return "all"
    try:
        value = int(text)
    except ValueError:
        raise UserError(f"--n-gpu-layers {text}: use a count, all, auto or -1") from None
    if value < -1:
        raise UserError(f"--n-gpu-layers {value}: use a count, all, auto or -1")
    return value


def _with_speculation(args: argparse.Namespace, facts, shape: LaneShape, draft_devices: tuple[int, ...] | None,
                      gpus: list[int]):  # fmt: skip
    """The lane with llama-server's speculative flags: the target's outputs for every drafted token,
    the draft model's buffers on the devices -ngld puts it, and the speculator's host bytes
    (shared/memory/speculative.py)."""
    from launcher_agent.hardware import cpu_repack
    from shared.memory import lane_memory

    spec_type = args.spec_type if args.spec_type != "none" else "draft-simple"
    if spec_type not in N_MAX:
        raise UserError(f"--spec-type {spec_type}: not predicted yet (lanes predicts {', '.join(sorted(N_MAX))})")
    if args.spec_draft_n_max is not None and spec_type not in DRAFT_KINDS:
        raise UserError(f"--spec-draft-n-max sets a draft model's longest draft; {spec_type}'s is not predicted "
                        "with another length yet")  # fmt: skip
    if (spec_type in DRAFT_KINDS) != bool(args.spec_draft_model):
        raise UserError(f"--spec-type {spec_type}: " + ("a draft model (--spec-draft-model) is needed"
                        if spec_type in DRAFT_KINDS else "takes no draft model (--spec-draft-model)"))  # fmt: skip
    for name, value in (("--spec-draft-type-k", args.spec_draft_type_k),
                        ("--spec-draft-type-v", args.spec_draft_type_v)):  # fmt: skip
        if value not in BLOCK_BYTES:
            raise UserError(f"{name} {value}: unknown cache type; choose one of {', '.join(BLOCK_BYTES)}")
    target = lane_memory(facts, target_shape(shape, spec_type, args.spec_draft_n_max), cpu_repack())
    draft = None
    if args.spec_draft_model:
        try:
            draft_facts = read_model_facts(args.spec_draft_model)
        except (ModelError, OSError) as exc:
            raise UserError(str(exc)) from None
        placed = _draft_placement(args, draft_shape(shape, args.spec_draft_type_k, args.spec_draft_type_v),
                                  draft_devices, gpus)  # fmt: skip
        draft = lane_memory(draft_facts, placed, cpu_repack())
        if draft_devices:
            draft = on_devices(draft, draft_devices)
    host = speculator_host_bytes(spec_type, facts.n_vocab, shape.parallel, shape.n_ubatch, args.spec_draft_n_max)
    return with_speculation(target, draft, host)


def _sizes(text: str) -> list[int]:
    try:
        return [parse_size(part) for part in text.split(",")]
    except Exception:
        raise UserError(f"--gpus {text}: give each device's free memory, e.g. 24GiB,8GiB") from None


def _shares(text: str) -> tuple[float, ...]:
    try:
        values = tuple(float(v) for v in text.split(","))
    except ValueError:
        raise UserError(f"--tensor-split {text}: give one number per device, e.g. 3,1") from None
    if any(v < 0 for v in values) or not all(v == v and v != float("inf") for v in values):
        raise UserError(f"--tensor-split {text}: shares must be finite and not negative")
    if sum(values) <= 0:
        raise UserError(f"--tensor-split {text}: the shares must not sum to zero")
    return values


# llama-server's device names by backend (--list-devices): CUDA0, ROCm0, Vulkan0, MTL0, RPC0
_DEVICE_PREFIX = {"cuda": "CUDA", "rocm": "ROCm", "vulkan": "Vulkan", "metal": "MTL", "rpc": "RPC"}


def _device_index(flag: str, name: str, backend: str, n_gpus: int) -> int:
    """One device as llama-server names it (CUDA1, RPC0 ...) as an index among the --gpus, or a UserError."""
    prefix = _DEVICE_PREFIX.get(backend, backend.upper())
    index = name[len(prefix):] if name.lower().startswith(prefix.lower()) else ""
    if not index.isdigit() or int(index) >= n_gpus:
        names = ", ".join(f"{prefix}{i}" for i in range(n_gpus)) or "none (no --gpus)"
        raise UserError(f"{flag} {name}: not one of this estimate's devices ({names}) or none")
    return int(index)


def _mmproj_device(name: str | None, backend: str, n_gpus: int) -> int:
    """-mmdev's device as an index among the --gpus (0 where not given or none), or a UserError."""
    return 0 if name in (None, "none") else _device_index("--mmproj-device", name, backend, n_gpus)


def _draft_devices(text: str | None, backend: str, n_gpus: int) -> tuple[int, ...] | None:
    """-devd's list as indices among the --gpus, in its order (none: no device); None where not given."""
    if text is None:
        return None
    if text == "none":
        return ()
    indices = tuple(_device_index("--spec-draft-device", name.strip(), backend, n_gpus) for name in text.split(","))
    if len(set(indices)) != len(indices):
        raise UserError(f"--spec-draft-device {text}: a device is named twice")
    return indices


def _draft_placement(args: argparse.Namespace, shape: LaneShape, indices: tuple[int, ...] | None,
                     gpus: list[int]) -> LaneShape:  # fmt: skip
    """The draft's shape on its own devices (-devd) as common_base_params_to_speculative gives them: the
    target's -ts read by position over them (each device's free memory where that leaves none), one
    device always split by layer, -sm none keeping the -mg-th of them."""
    layers = _n_gpu_layers(args.spec_draft_ngl) if shape.devices else 0
    if indices is None:
        return dataclasses.replace(shape, n_gpu_layers=layers)
    shares = shape.tensor_split[: len(indices)] if args.tensor_split else ()
    if sum(shares) <= 0:
        shares = tuple(float(gpus[i]) for i in indices)
    split_mode = "layer" if len(indices) == 1 else shape.split_mode
    if split_mode == "none" and indices and shape.main_gpu >= len(indices):
        raise UserError(f"--spec-draft-device {args.spec_draft_device}: llama-server refuses the draft with "
                        f"--split-mode none and --main-gpu {shape.main_gpu}, past its {len(indices)} "
                        "device(s)")  # fmt: skip
    return dataclasses.replace(
        shape, n_gpu_layers=layers if indices else 0, devices=shape.devices[: len(indices)], tensor_split=shares,
        split_mode=split_mode,
    )  # fmt: skip


def _image_tokens(proj, smallest: int | None, largest: int | None) -> int:
    """--image-max-tokens as the memory model takes it (0: the projector's own), or a UserError where the
    estimate cannot say what the flags do to the projector's buffer."""
    from shared.memory.projector import DYNAMIC_MAX_TOKENS, image_tokens_cap

    if smallest is None and largest is None:
        return 0
    cap = image_tokens_cap(proj) if proj is not None else None
    if cap is None:
        what = f"a {proj.projector_type} projector" if proj is not None else "a lane without --mmproj"
        raise UserError(f"--image-{'max' if largest is not None else 'min'}-tokens: predicted for Pixtral and "
                        f"Qwen2-VL's family, not yet for {what}; leave it out")  # fmt: skip
    if proj.projector_type in DYNAMIC_MAX_TOKENS:  # planned at the largest image, whatever its size
        cap = largest or cap
    elif largest is not None and largest > cap:
        raise UserError(f"--image-max-tokens {largest}: {proj.projector_type} reserves for {cap} tokens and grows "
                        "its buffer past that at a larger image, which the estimate cannot predict yet")  # fmt: skip
    if smallest is not None and smallest > cap:
        raise UserError(f"--image-min-tokens {smallest}: more than the {cap} tokens the estimate holds for "
                        f"the largest image; give at most {cap}")  # fmt: skip
    return largest or 0


def cmd_estimate(args: argparse.Namespace) -> int:
    from launcher_agent.hardware import cpu_repack, gpu_backend_of
    from shared.gguf_weights import EXPERT_TENSOR
    from shared.memory import LaneShape, PlacementError, lane_memory
    from shared.memory.experts import parse_override

    try:
        facts = read_model_facts(args.model)
        if args.mmproj:
            from shared.gguf_projector import projector_facts

            facts = msgspec.structs.replace(facts, mmproj=projector_facts(args.mmproj))
    except (ModelError, ValueError, OSError) as exc:
        raise UserError(str(exc)) from None
    caps = ServerCaps()
    if args.llama_build and not args.llama_server:
        from shared.llama.builds import caps_for_build

        caps = caps_for_build(args.llama_build)
    if args.llama_server:
        try:
            caps = probe(args.llama_server)
        except ProbeError as exc:
            raise UserError(str(exc)) from None
    for name, value in (("--cache-type-k", args.cache_type_k), ("--cache-type-v", args.cache_type_v)):
        if value not in BLOCK_BYTES:
            raise UserError(f"{name} {value}: unknown cache type; choose one of {', '.join(BLOCK_BYTES)}")
        if value not in caps.cache_types:
            raise UserError(f"{name} {value}: {args.llama_server} does not support it ({', '.join(caps.cache_types)})")
    if needs_flash_attn(args.cache_type_v) and args.flash_attn == "off":
        raise UserError(
            f"--cache-type-v {args.cache_type_v} needs flash attention; llama-server refuses it with --flash-attn off"
        )
    ngl = _n_gpu_layers(args.n_gpu_layers)
    gpus = _sizes(args.gpus) if args.gpus else []
    shares = _shares(args.tensor_split) if args.tensor_split else tuple(float(g) for g in gpus)
    if args.tensor_split and len(shares) > len(gpus):
        raise UserError(
            f"--tensor-split {args.tensor_split}: {len(shares)} shares for {len(gpus)} device(s) given by --gpus"
        )
    shares = shares + (0.0,) * (len(gpus) - len(shares))
    if gpus and sum(shares) <= 0:
        raise UserError("--gpus: every device has zero free memory, so no layer can be split over them")
    if gpus and not 0 <= args.main_gpu < len(gpus):
        raise UserError(f"--main-gpu {args.main_gpu}: the host has {len(gpus)} device(s) in --gpus")
    backend = args.gpu_backend or gpu_backend_of(args.llama_server)
    # `auto` as llama-server resolves it on these devices (RPC devices run the CPU's kernels)
    on_devices = (backend,) if gpus and ngl != 0 else ()
    flash = resolve_flash_attn(args.flash_attn, caps, on_devices, facts, args.cache_type_k, args.cache_type_v)
    try:
        overrides = tuple(parse_override(o) for o in args.override_tensor)
        if args.cpu_moe:  # llama-server's --cpu-moe: llm_ffn_exps_cpu_override(), every block
            overrides += ((EXPERT_TENSOR.pattern, "CPU"),)
    except PlacementError as exc:
        raise UserError(str(exc)) from None
    if args.n_cpu_moe and not caps.has_n_cpu_moe:
        raise UserError(f"--n-cpu-moe: this llama-server build ({caps.build}) does not have it")
    draft_devices = _draft_devices(args.spec_draft_device, backend, len(gpus))
    if draft_devices is not None and not args.spec_draft_model:
        raise UserError("--spec-draft-device: places a draft model; give it with --spec-draft-model")
    image_max_tokens = _image_tokens(facts.mmproj, args.image_min_tokens, args.image_max_tokens)
    mmproj_device = _mmproj_device(args.mmproj_device, backend, len(gpus))
    mmproj_in_ram = args.no_mmproj_offload or args.mmproj_device == "none"
    adapters = _adapters(args.model, args.lora, args.lora_scaled)
    shape = LaneShape(
        ctx=args.ctx, parallel=args.parallel, kv_unified=args.kv_unified, swa_full=args.swa_full,
        type_k=args.cache_type_k,
        type_v=args.cache_type_v, flash_attn=flash.on, layout=caps.kv_layout, n_ubatch=args.ubatch,
        n_gpu_layers=ngl, tensor_split=shares, devices=(backend,) * len(gpus), split_mode=args.split_mode,
        main_gpu=args.main_gpu, no_kv_offload=args.no_kv_offload, ngl_rule=caps.ngl_rule,
        n_cpu_moe=args.n_cpu_moe, tensor_overrides=overrides,
        cache_ram=args.cache_ram * 2**20, llama_build=caps.build or 0,
        mmproj=bool(args.mmproj), mmproj_offload=bool(gpus) and not mmproj_in_ram, image_max_tokens=image_max_tokens,
        mmproj_device=mmproj_device,
        adapters=adapters,
    )  # fmt: skip
    try:
        speculates = args.spec_type != "none" or args.spec_draft_model
        mem = _with_speculation(args, facts, shape, draft_devices, gpus) if speculates \
            else lane_memory(facts, shape, cpu_repack())  # fmt: skip
    except (MemoryModelError, PlacementError) as exc:
        raise UserError(str(exc)) from None
    over = [
        f"GPU{i} needs {mib(d.total)} of {mib(gpus[i])}" for i, d in enumerate(mem.devices[1:]) if d.total > gpus[i]
    ]
    if args.json:
        out = msgspec.to_builtins(mem)
        out.update(flash_attn=flash.on, flash_attn_reason=flash.reason)
        print(msgspec.json.encode(out).decode())
        return 0
    rows = [
        ["weights", mib(mem.weights_bytes)],
        [f"kv K ({args.cache_type_k})", mib(mem.kv_k_bytes)],
        [f"kv V ({args.cache_type_v})", mib(mem.kv_v_bytes)],
        ["kv total", f"{mib(mem.kv_bytes)}  ({mem.kv_bytes} bytes, {mem.kv_cells} cells x {mem.kv_streams} streams"
         + (f", swa {mem.swa_cells} cells)" if mem.swa_cells else ")")],
        ["recurrent state", mib(mem.recurrent_bytes)],
        ["compute (estimate)", mib(mem.compute_bytes)],
        ["process overhead", mib(mem.overhead_bytes)],
        ["prompt cache (--cache-ram)", mib(mem.prompt_cache_bytes)],
        *([["projector (--mmproj)", mib(mem.projector_bytes)]] if args.mmproj else []),
        *([[f"LoRA adapters ({len(adapters)})", mib(mem.adapter_bytes)]] if adapters else []),
        *([["of which the draft model", mib(mem.draft_bytes)]] if mem.draft_bytes else []),
        *([[f"speculator ({args.spec_type}), unprinted", mib(mem.speculator_bytes)]] if mem.speculator_bytes else []),
        ["total", gib(mem.total_bytes)],
    ]  # fmt: skip
    print(f"{facts.name}: ctx {args.ctx}, {args.parallel} slot(s), kv layout '{caps.kv_layout}'; {flash.reason}")
    print(table(["part", "size"], rows))
    if gpus:
        per = [[d.device, d.layers, mib(d.model_bytes), mib(d.kv_bytes), mib(d.compute_bytes), mib(d.output_bytes),
                mib(d.total)] for d in mem.devices]  # fmt: skip
        print(table(["device", "layers", "model", "kv", "compute", "output", "total"], per))
    for line in over:
        print(f"does not fit: {line}")
    return 0


def _adapters(model: str, plain: list[str], scaled: list[str]) -> tuple:
    """The adapters of --lora and --lora-scaled (llama-server's comma lists), each checked as
    llama.cpp checks it against the model: an adapter it would refuse is refused here."""
    from shared.adapters import fits, is_adapter, read_adapter
    from shared.gguf_scan import GGUFFormatError, read_header

    paths = [p for arg in plain for p in arg.split(",") if p]
    for arg in scaled:
        for item in (i for i in arg.split(",") if i):
            path, sep, scale = item.rpartition(":")
            try:
                float(scale)
            except ValueError:
                sep = ""
            if not sep or not path:
                raise UserError(f"--lora-scaled {item}: give FNAME:SCALE, as llama-server takes it")
            paths.append(path)
    out = []
    for path in paths:
        try:
            header, base = read_header(path), read_header(model)
        except (GGUFFormatError, OSError) as exc:
            raise UserError(f"--lora {path}: {exc}") from None
        if not is_adapter(header):
            raise UserError(f"--lora {path}: not a LoRA adapter (general.type is not adapter)")
        if not fits(header, base):
            raise UserError(f"--lora {path}: does not fit {Path(model).name} (another architecture or shape); "
                            "llama-server refuses to load it")  # fmt: skip
        out.append(read_adapter(path, header))
    return tuple(out)


def cmd_plan(args: argparse.Namespace) -> int:
    data = Path(args.hosts)
    if not data.is_file():
        raise UserError(f"{args.hosts}: no such file")
    try:
        raw = msgspec.json.decode(data.read_bytes())
        reports = msgspec.convert(raw if isinstance(raw, list) else [raw], list[HostReport])
    except (msgspec.ValidationError, msgspec.DecodeError) as exc:
        raise UserError(f"{args.hosts}: {exc}") from None
    config = load_file(args.config, FleetConfig) if args.config else FleetConfig()
    demand = load_file(args.demand, Demand) if args.demand else None
    fleet = plan(reports, config, demand)
    if args.json:
        print(msgspec.json.encode(fleet).decode())
        return 0
    print(render_plan(fleet, reports))
    return 0


def render_plan(fleet, reports) -> str:
    """The plan as a table, each lane with its reasons and the argv its host's agent renders."""
    caps = {r.host_id: r.server for r in reports}
    out = []
    for host in fleet.hosts:
        out.append(f"host {host.host_id}  plan r{host.plan_revision}  budget ram {gib(host.budget_ram)}"
                   + (f" gpu {gib(host.budget_gpu)}" if host.budget_gpu else ""))  # fmt: skip
        rows = [
            [
                s.lane_id,
                s.port,
                f"{s.ctx_per_slot}x{s.parallel}",
                cache_pair(s.cache_type_k, s.cache_type_v),
                s.flash_attn or "-",
                s.memory.device,
                mib(s.memory.weights_bytes),
                mib(s.memory.kv_bytes),
                mib(s.memory.compute_bytes),
                "-" if s.cache_ram_mib is None else f"{s.cache_ram_mib} MiB",
                gib(s.memory.total_bytes),
            ]
            for s in host.lanes
        ]
        if rows:
            out.append(
                table(["lane", "port", "window", "kv k/v", "fa", "dev", "weights", "kv", "compute", "cache", "total"],
                      rows)
            )
        for s in host.lanes:
            out.append(f"  {s.lane_id}: " + "; ".join(s.reasons))
            for w in s.workers:  # a span lane: layers on other hosts' ggml-rpc-servers
                out.append(f"    worker {w.host_id} at {w.endpoint} ({w.device}): model {mib(w.model_bytes)}, kv"
                           f" {mib(w.kv_bytes)}, compute {mib(w.compute_bytes)}, reserved {gib(w.reserved_bytes)}")
            out.append("    llama-server " + " ".join(lane_args(s, caps[host.host_id])))
        for w in host.rpc_workers:
            out.append(f"  ggml-rpc-server on {w.bind}:{w.port} for {w.serving_host}'s {w.lane_id}:"
                       f" {gib(w.reserved_bytes)} reserved")
        for r in host.reasons:
            out.append(f"  note: {r}")
        for u in host.unplaced:
            out.append(f"  unplaced {u.model}: {u.reason}")
    for u in fleet.unplaced:
        out.append(f"unplaced {u.model}: {u.reason}")
    return "\n".join(out)


def cmd_report(args: argparse.Namespace) -> int:
    """What an agent on this host would report, without NATS: a hosts file for `lanes plan`."""
    from lanes.agent_setup import agent_config
    from launcher_agent.report import host_report

    print(msgspec.json.encode(host_report(agent_config(args, Path("unused")))).decode())
    return 0
