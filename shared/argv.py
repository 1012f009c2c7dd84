"""The argv tail of a lane, rendered from its typed spec for one binary's flag forms.

The planner calls this once to put `args` into the plan; the agent calls it again
only to check that a plan's args are exactly what its spec says (a plan whose args
disagree, e.g. carry an extra flag, is rejected).
"""

from __future__ import annotations

from shared.messages import LaneSpec, ServerCaps


def lane_args(spec: LaneSpec, caps: ServerCaps) -> tuple[str, ...]:
    args = [
        "--model", spec.model_path,
        "--alias", spec.alias,
        "--host", spec.bind,
        "--port", str(spec.port),
        "--ctx-size", str(spec.ctx_total),
        "--parallel", str(spec.parallel),
        "--n-gpu-layers", str(spec.n_gpu_layers),
    ]  # fmt: skip
    if spec.rpc_servers:
        args += ["--rpc", ",".join(spec.rpc_servers)]
    if spec.device_names:
        # Pinned: llama-server sees only these devices, so a lane never spreads over every GPU.
        args += ["--device", ",".join(spec.device_names)]
    if spec.split_mode is not None:
        args += ["--split-mode", spec.split_mode]
    if spec.main_gpu is not None:
        args += ["--main-gpu", str(spec.main_gpu)]
    if spec.tensor_split:
        args += ["--tensor-split", ",".join(map(str, spec.tensor_split))]
    if spec.kv_unified:
        args.append("--kv-unified")
    if spec.cache_type_k is not None:
        args += ["--cache-type-k", spec.cache_type_k]
    if spec.cache_type_v is not None:
        args += ["--cache-type-v", spec.cache_type_v]
    if spec.flash_attn is not None:
        if caps.flash_attn_form == "value":
            args += ["--flash-attn", spec.flash_attn]
        elif spec.flash_attn == "on":
            args.append("--flash-attn")
    if spec.fit_off:
        args += ["-fit", "off"]
    # Verbosity 4 makes llama-server print its KV size, which the agent checks against the plan.
    args += ["--verbosity", "4"]
    return tuple(args)
