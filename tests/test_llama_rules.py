"""llama-server's rules lanes plans by, as pure functions: flash attention `auto` per backend,
a build's capabilities from its number, and the built-in chat template for a file without one."""

from __future__ import annotations

import msgspec
import pytest

from shared.llama.builds import caps_for_build
from shared.llama.chat_templates import builtin_template
from shared.llama.flags import lane_args
from shared.llama.flash_attn import resolve_flash_attn
from shared.messages.hosts import ModelFacts, ServerCaps
from shared.messages.plans import LaneSpec

NEW = ServerCaps()
OLD = ServerCaps(flash_attn_form="switch")


def facts(head_k=128, head_v=None, n_head=32, n_head_kv=8, arch="llama", n_vocab=128256, template=False):
    return ModelFacts(
        path="/m.gguf", name="m", architecture=arch, n_layer=4, n_embd=4096, n_head=n_head, n_head_kv=(n_head_kv,) * 4,
        head_dim_k=head_k, head_dim_v=head_k if head_v is None else head_v, n_ctx_train=8192, n_vocab=n_vocab,
        has_chat_template=template,
    )  # fmt: skip


@pytest.mark.parametrize(
    ("backends", "model", "k", "v", "on", "why"),
    [
        ((), facts(), "f16", "f16", True, "cpu"),
        (("rpc",), facts(head_k=100), "f16", "f16", True, "rpc"),  # the CPU's kernels take any head size
        (("cuda",), facts(), "f16", "f16", True, "cuda"),
        (("cuda",), facts(), "q8_0", "q8_0", True, "forced on"),
        (("cuda",), facts(head_k=100), "f16", "f16", False, "head size 100"),
        (("cuda",), facts(head_k=128, head_v=64), "f16", "f16", False, "differ"),
        (("cuda",), facts(head_k=576, head_v=512, n_head=16, n_head_kv=1), "f16", "f16", True, "cuda"),  # MLA
        (("cuda",), facts(head_k=576, head_v=512, n_head=1, n_head_kv=1), "f16", "f16", False, "heads per KV"),
        (("cuda",), facts(), "q8_0", "f16", False, "K q8_0 with V f16"),
        (("rocm",), facts(), "q4_1", "f16", False, "K q4_1"),
        (("metal",), facts(head_k=192, head_v=128), "f16", "f16", True, "metal"),
        (("metal",), facts(head_k=100), "f16", "f16", False, "head size 100"),
        (("metal",), facts(), "q8_0", "f16", False, "K q8_0 with V f16"),
        (("vulkan",), facts(), "f16", "f16", False, "not modelled"),
        (("cuda", "metal"), facts(head_k=192, head_v=128), "f16", "f16", False, "on cuda"),
    ],
)
def test_flash_attn_auto_resolves_per_backend(backends, model, k, v, on, why):
    for flag in (None, "auto"):
        got = resolve_flash_attn(flag, NEW, backends, model, k, v)
        assert got.on is on and why in got.reason, got


def test_flash_attn_explicit_flags_and_old_builds():
    assert resolve_flash_attn("on", NEW, ("vulkan",), facts(head_k=100), "f16", "f16").on
    assert not resolve_flash_attn("off", NEW, (), facts(), "f16", "f16").on
    assert not resolve_flash_attn(None, OLD, (), facts(), "f16", "f16").on
    # auto: on with the CPU's kernels, off on a device of unknown backend, on for CUDA with these facts
    assert resolve_flash_attn("auto", NEW, ("cpu",), None, "f16", "f16").on
    assert not resolve_flash_attn("auto", NEW, ("unknown",), None, "f16", "f16").on
    assert resolve_flash_attn("auto", NEW, ("cuda",), facts(), "f16", "f16").on


def test_caps_for_build_follow_the_releases():
    assert caps_for_build(11434) == msgspec.structs.replace(
        ServerCaps(), build=11434, version="version: 11434 (planned from the build number)"
    )
    old = caps_for_build(4800)
    assert (old.flash_attn_form, old.kv_layout, old.ngl_rule, old.has_n_cpu_moe) == (
        "switch", "shared", "blocks_first", False
    )  # fmt: skip
    mid = caps_for_build(6325)
    assert (mid.flash_attn_form, mid.kv_layout, mid.ngl_rule, mid.has_n_cpu_moe, mid.has_fit) == (
        "value", "streams", "blocks_first", True, False
    )  # fmt: skip
    assert not caps_for_build(6099).has_n_cpu_moe and caps_for_build(6100).has_n_cpu_moe
    with pytest.raises(ValueError):
        caps_for_build(0)


@pytest.mark.parametrize(
    ("arch", "n_vocab", "name"),
    [("gemma3", 262144, "gemma"), ("gemma2", 256000, "gemma"), ("llama", 128256, "llama3"),
     ("llama", 32000, "llama2"), ("llama", 259, None), ("phi3", 100352, "phi4"), ("qwen3", 151936, None),
     ("gpt-oss", 201088, "gpt-oss"), ("deepseek2", 129280, "deepseek3")],
)  # fmt: skip
def test_builtin_template_by_architecture(arch, n_vocab, name):
    assert builtin_template(facts(arch=arch, n_vocab=n_vocab)) == name
    assert builtin_template(facts(arch=arch, n_vocab=n_vocab, template=True)) is None  # the file's own wins


def test_chat_template_and_n_cpu_moe_argv():
    spec = LaneSpec(lane_id="g-0", model="g", model_path="/g.gguf", alias="g", port=8080, ctx_total=4096,
                    ctx_per_slot=4096, parallel=1, chat_template="gemma", n_cpu_moe=3)  # fmt: skip
    args = lane_args(spec, NEW)
    at = args.index("--chat-template")
    assert args[at + 1] == "gemma" and args[at - 1] == "--no-jinja"  # jinja would read the name as text
    assert args[args.index("--n-cpu-moe") + 1] == "3"
    older = lane_args(spec, ServerCaps(has_no_jinja=False))  # jinja off by default there
    assert "--no-jinja" not in older and "--chat-template" in older
