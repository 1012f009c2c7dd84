"""parse_caps on llama-server --help / --version text, and the argv it leads to."""

from __future__ import annotations

import pytest

from shared.llama.flags import lane_args, parse_caps
from shared.messages.hosts import ServerCaps
from shared.messages.plans import LaneSpec

NEW_HELP = """\
----- common params -----

-h,    --help, --usage                  print usage and exit
--version                               show version and build info
-t,    --threads N                      number of CPU threads to use during generation (default: -1)
                                        (env: LLAMA_ARG_THREADS)
-tb,   --threads-batch N                number of threads to use during batch and prompt processing (default:
                                        same as --threads)
-C,    --cpu-mask M                     CPU affinity mask: arbitrarily long hex. Complements cpu-range
                                        (default: "")
-Cr,   --cpu-range lo-hi                range of CPUs for affinity. Complements --cpu-mask
--cpu-strict <0|1>                      use strict CPU placement (default: 0)
--poll <0...100>                        use polling level to wait for work (0 - no polling, default: 50)
-Cb,   --cpu-mask-batch M               CPU affinity mask: arbitrarily long hex. Complements cpu-range-batch
                                        (default: same as --cpu-mask)
-Crb,  --cpu-range-batch lo-hi          ranges of CPUs for affinity. Complements --cpu-mask-batch
--cpu-strict-batch <0|1>                use strict CPU placement (default: same as --cpu-strict)
--poll-batch <0|1>                      use polling to wait for work (default: same as --poll)
-c,    --ctx-size N                     size of the prompt context (default: 4096, 0 = loaded from model)
                                        (env: LLAMA_ARG_CTX_SIZE)
-ub,   --ubatch-size N                  physical maximum batch size (default: 512)
                                        (env: LLAMA_ARG_UBATCH)
-fa,   --flash-attn [on|off|auto]       set Flash Attention use ('on', 'off', or 'auto', default: 'auto')
                                        (env: LLAMA_ARG_FLASH_ATTN)
--swa-full                              use full-size SWA cache (default: false)
                                        [(more info)](https://github.com/ggml-org/llama.cpp/pull/13194#issuecomment-2868343055)
                                        (env: LLAMA_ARG_SWA_FULL)
-ctk,  --cache-type-k TYPE              KV cache data type for K
                                        allowed values: f32, f16, bf16, q8_0, q4_0, q4_1, iq4_nl, q5_0, q5_1
                                        (default: f16)
                                        (env: LLAMA_ARG_CACHE_TYPE_K)
-ctv,  --cache-type-v TYPE              KV cache data type for V
                                        allowed values: f32, f16, bf16, q8_0, q4_0, q4_1, iq4_nl, q5_0, q5_1
                                        (default: f16)
                                        (env: LLAMA_ARG_CACHE_TYPE_V)
-np,   --parallel N                     number of server slots (default: -1, -1 = auto)
                                        (env: LLAMA_ARG_N_PARALLEL)
-kvu,  --kv-unified                     use single unified KV buffer shared across all sequences (default:
                                        enabled if number of slots is auto)
                                        (env: LLAMA_ARG_KV_UNIFIED)
-no-kvu, --no-kv-unified                use separate KV buffers per sequence
-ngl,  --gpu-layers, --n-gpu-layers N   max. number of layers to store in VRAM, either an exact number,
                                        'auto', or 'all' (default: auto)
                                        (env: LLAMA_ARG_N_GPU_LAYERS)
-fit,  --fit [on|off]                   whether to adjust unset arguments to fit in device memory ('on' or
                                        'off', default: 'on')
                                        (env: LLAMA_ARG_FIT)
-fitt, --fit-target MiB0,MiB1,...       target margin per device for --fit, default: 1024
-lm,   --load-mode MODE                 how to load the model: auto, none, mmap, mlock, mmap+mlock, dio
"""

OLD_HELP = """\
----- common params -----

-h,    --help, --usage                  print usage and exit
--version                               show version and build info
-c,    --ctx-size N                     size of the prompt context (default: 4096, 0 = loaded from model)
                                        (env: LLAMA_ARG_CTX_SIZE)
-fa,   --flash-attn                     enable Flash Attention (default: disabled)
                                        (env: LLAMA_ARG_FLASH_ATTN)
--no-mmap                               do not memory-map model (slower load but may reduce pageouts if not
                                        using mlock)
                                        (env: LLAMA_ARG_NO_MMAP)
-ctk,  --cache-type-k TYPE              KV cache data type for K
                                        allowed values: f32, f16, q8_0, q4_0, q4_1, iq4_nl, q5_0, q5_1
                                        (default: f16)
                                        (env: LLAMA_ARG_CACHE_TYPE_K)
-ctv,  --cache-type-v TYPE              KV cache data type for V
                                        allowed values: f32, f16, q8_0, q4_0, q4_1, iq4_nl, q5_0, q5_1
                                        (default: f16)
                                        (env: LLAMA_ARG_CACHE_TYPE_V)
-np,   --parallel N                     number of parallel sequences to decode (default: 1)
                                        (env: LLAMA_ARG_N_PARALLEL)
-ngl,  --gpu-layers, --n-gpu-layers N   number of layers to store in VRAM
                                        (env: LLAMA_ARG_N_GPU_LAYERS)
"""

ALL_TYPES = ("f32", "f16", "bf16", "q8_0", "q4_0", "q4_1", "iq4_nl", "q5_0", "q5_1")


def test_new_build():
    caps = parse_caps(NEW_HELP, "version: 6325 (abc123)\nbuilt with cc for x86_64-linux-gnu\n")
    assert caps.flash_attn_form == "value"
    assert caps.kv_layout == "streams"
    assert caps.has_fit is True
    assert caps.has_kv_unified is True
    assert caps.has_swa_full is True
    assert caps.cache_types == ALL_TYPES
    assert caps.build == 6325
    assert caps.version == "version: 6325 (abc123)"
    assert caps.has_cpu_range is True and caps.has_poll is True


def test_old_build():
    caps = parse_caps(OLD_HELP, "version: 4880 (2c9f833d)\n")
    assert caps.flash_attn_form == "switch"
    assert caps.kv_layout == "shared"
    assert caps.has_fit is False
    assert caps.has_kv_unified is False
    assert caps.has_swa_full is False
    assert "bf16" not in caps.cache_types
    assert caps.cache_types == ("f32", "f16", "q8_0", "q4_0", "q4_1", "iq4_nl", "q5_0", "q5_1")
    assert caps.build == 4880
    assert caps.has_cpu_range is False and caps.has_poll is False  # this excerpt lists no threadpool flags


def test_old_build_one_line_flash_attn():
    # The brief form: description on the same line as the flag.
    help_text = (
        "-fa,   --flash-attn  enable Flash Attention (default: disabled)\n"
        "-ctk,  --cache-type-k TYPE   KV cache data type for K (default: f16)\n"
        "                             allowed values: f32, f16, q8_0, q4_0, q4_1, iq4_nl, q5_0, q5_1\n"
    )
    caps = parse_caps(help_text)
    assert caps.flash_attn_form == "switch"
    assert caps.kv_layout == "shared"
    assert caps.has_fit is False
    assert "bf16" not in caps.cache_types and "q8_0" in caps.cache_types


def test_allowed_values_wrapped_over_lines():
    help_text = (
        "-fa,   --flash-attn [on|off|auto]   set Flash Attention use\n"
        "-ctk,  --cache-type-k TYPE          KV cache data type for K\n"
        "                                    allowed values: f32, f16, bf16, q8_0, q4_0, q4_1, iq4_nl, q5_0,\n"
        "                                    q5_1\n"
        "                                    (default: f16)\n"
    )
    assert parse_caps(help_text).cache_types == ALL_TYPES


def test_allowed_values_missing_falls_back():
    caps = parse_caps("-fa,   --flash-attn [on|off|auto]   set Flash Attention use\n")
    assert "f16" in caps.cache_types and "q8_0" in caps.cache_types


@pytest.mark.parametrize(
    "line",
    [
        "-fa,   --flash-attn [on|off|auto]       set Flash Attention use",
        "-fa,   --flash-attn FA                  set Flash Attention use ('on', 'off', or 'auto')",
        "-fa,   --flash-attn {on,off,auto}       set Flash Attention use",
    ],
)
def test_value_forms(line):
    assert parse_caps(line + "\n").flash_attn_form == "value"


def test_not_llama_server_help():
    with pytest.raises(ValueError):
        parse_caps("usage: something-else [options]\n  --port N\n")


@pytest.mark.parametrize(
    ("text", "build", "version"),
    [
        ("version: 6325 (abc123)", 6325, "version: 6325 (abc123)"),
        ("version: 1.2.3 (build 11434, commit abc)", 11434, "version: 1.2.3 (build 11434, commit abc)"),
        ("version: 4880 (2c9f833d)\nbuilt with cc (GCC) 13.2.0 for x86_64\n", 4880, "version: 4880 (2c9f833d)"),
        ("", None, ""),
        ("something unexpected", None, "something unexpected"),
    ],
)
def test_version_parsing(text, build, version):
    caps = parse_caps(NEW_HELP, text)
    assert caps.build == build
    assert caps.version == version


def test_version_does_not_decide_flag_form():
    # A new build number with an old-style --help is still a switch: the help text decides.
    assert parse_caps(OLD_HELP, "version: 9999 (x)").flash_attn_form == "switch"
    assert parse_caps(NEW_HELP, "version: 1 (x)").flash_attn_form == "value"


# ------------------------------------------------------------------ argv


def _spec(**kw) -> LaneSpec:
    base = dict(
        lane_id="m-0",
        model="m",
        model_path="/models/m.gguf",
        alias="m",
        port=8080,
        ctx_total=8192,
        ctx_per_slot=4096,
        parallel=2,
    )
    base.update(kw)
    return LaneSpec(**base)


def _flash(args: tuple[str, ...]) -> list[str]:
    out = []
    for i, a in enumerate(args):
        if a in ("--flash-attn", "-fa"):
            out.append(a)
            if i + 1 < len(args) and not args[i + 1].startswith("-"):
                out.append(args[i + 1])
    return out


VALUE = ServerCaps(flash_attn_form="value")
SWITCH = ServerCaps(flash_attn_form="switch", kv_layout="shared", has_fit=False, has_kv_unified=False)


@pytest.mark.parametrize("fa", ["on", "off", "auto"])
def test_lane_args_value_form(fa):
    args = lane_args(_spec(flash_attn=fa), VALUE)
    assert _flash(args) == ["--flash-attn", fa]


def test_lane_args_switch_form_on_is_bare():
    args = lane_args(_spec(flash_attn="on"), SWITCH)
    assert _flash(args) == ["--flash-attn"]
    i = args.index("--flash-attn")
    assert i == len(args) - 1 or args[i + 1].startswith("-")


@pytest.mark.parametrize("fa", ["off", "auto"])
def test_lane_args_switch_form_off_auto_pass_nothing(fa):
    assert _flash(lane_args(_spec(flash_attn=fa), SWITCH)) == []


@pytest.mark.parametrize("caps", [VALUE, SWITCH])
def test_lane_args_no_flash_attn(caps):
    args = lane_args(_spec(), caps)
    assert "--flash-attn" not in args and "-fa" not in args
    assert not any(a.startswith("--cache-type") for a in args)


def test_lane_args_full():
    spec = _spec(
        cache_type_k="q8_0", cache_type_v="q8_0", flash_attn="on", kv_unified=True, fit_off=True, n_gpu_layers=33
    )
    args = lane_args(spec, VALUE)
    assert args == (
        "--model", "/models/m.gguf",
        "--alias", "m",
        "--host", "127.0.0.1",
        "--port", "8080",
        "--ctx-size", "8192",
        "--parallel", "2",
        "--n-gpu-layers", "33",
        "--metrics",
        "--kv-unified",
        "--cache-type-k", "q8_0",
        "--cache-type-v", "q8_0",
        "--flash-attn", "on",
        "-fit", "off",
        "--verbosity", "4",
    )  # fmt: skip


def test_version_string_skips_backend_loading_lines():
    text = (
        "load_backend: loaded RPC backend from /app/libggml-rpc.so\n"
        "load_backend: loaded CPU backend from /app/libggml-cpu-haswell.so\n"
        "version: 6325 (abc123)\n"
        "built with cc (GCC) 13.2.0 for x86_64-linux-gnu\n"
    )
    caps = parse_caps(NEW_HELP, text)
    assert caps.build == 6325
    assert caps.version == "version: 6325 (abc123)"


# ------------------------------------------------------------------ the rules the flags obey


def test_default_cache_type_is_what_llama_server_runs_without_a_flag():
    from shared.llama.flags import cache_pair, effective_cache_type

    assert effective_cache_type(None) == "f16" and effective_cache_type("q8_0") == "q8_0"
    assert cache_pair(None, "q4_0") == "f16/q4_0" and cache_pair(None, None) == "f16/f16"


@pytest.mark.parametrize("type_v, needs", [(None, False), ("f16", False), ("bf16", False), ("f32", False),
                                           ("q8_0", True), ("q4_0", True), ("iq4_nl", True), ("q5_1", True)])  # fmt: skip
def test_a_quantized_v_cache_needs_flash_attention(type_v, needs):
    from shared.llama.flags import needs_flash_attn

    assert needs_flash_attn(type_v) is needs
