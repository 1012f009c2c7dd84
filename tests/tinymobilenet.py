"""Generated Gemma 3n vision projectors (mmproj GGUF, `gemma3nv`) the real llama-server loads.

Gemma 3n's vision tower is timm's MobileNetV5-300M encoder (timm/models/mobilenetv5.py,
mobilenetv5_300m_enc): a 3x3 stride-2 stem, four stages of blocks (edge residuals, universal
inverted residuals, mobile multi-query attention), a multi-scale fusion adapter (MSFA) over the
outputs of stages 2 and 3, then Gemma 3n's embedder (soft embedding norm, input projection).
This module writes it with the tensor names, block structure and types llama.cpp's converter
writes (conversion/gemma.py, Gemma3nVisionAudioModel; clip-impl.h TN_MNV5_*; clip.cpp loads blocks
stage by stage until a name is missing): every stage and block of the real model, its kernels,
strides and expansion ratios, with every channel width scaled by `width_scale` (1.0: the real
widths, ~300M parameters, 600 MB in f16) and random weights. Types as the converter writes them:
convolutions and the projection f16, the stem's convolution f32 (forced), norms, the stem bias and
layer scales f32. The file is vision only (the real one also holds the audio tower, which clip.cpp
skips for this type).

The MSFA's output width is the vision embedding width (clip.vision.embedding_length, asserted by
the graph) and mm.input_projection maps it to the text model's n_embd; mtmd refuses a projector
whose clip_n_mmproj_embd (the projection's ne[0], the vision width) differs from the text model's,
so the two widths are the same: `text_embd` (2048 in Gemma 3n E2B).
"""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np

# timm mobilenetv5_300m_enc (the `else` branch of _gen_mobilenet_v5): er = EdgeResidual, uir =
# UniversalInvertedResidual (a: dw_start kernel, k: dw_mid kernel, 0 = none), mqa = MobileAttention
# (h heads of key dim d, v: the key/value down-sampling stride, none = 1).
MNV5_300M = (
    ("er_r1_k3_s2_e4_c128", "er_r1_k3_s1_e4_c128", "er_r1_k3_s1_e4_c128"),
    ("uir_r1_a3_k5_s2_e6_c256", "uir_r1_a5_k0_s1_e4_c256", "uir_r1_a3_k0_s1_e4_c256", "uir_r1_a5_k0_s1_e4_c256",
     "uir_r1_a3_k0_s1_e4_c256"),
    ("uir_r1_a5_k5_s2_e6_c640",) + ("uir_r1_a5_k0_s1_e4_c640",) * 7 + ("uir_r1_a0_k0_s1_e1_c640",)
    + ("mqa_r1_k3_h12_v2_s1_d64_c640", "uir_r1_a0_k0_s1_e2_c640") * 13,
    ("uir_r1_a5_k5_s2_e6_c1280",) + ("mqa_r1_k3_h16_s1_d96_c1280", "uir_r1_a0_k0_s1_e2_c1280") * 19,
)  # fmt: skip
STEM = 64  # stem_size
MSFA_EXPANSION = 2  # MobileNetV5MultiScaleFusionAdapter's FFN
REAL_EMBD = 2048  # MobileNetV5Encoder.num_features (the MSFA's output), Gemma 3n E2B's text width


def parse_block(spec: str) -> dict:
    """`uir_r1_a3_k5_s2_e6_c256` -> {"kind": "uir", "a": 3, "k": 5, "s": 2, "e": 6, "c": 256}."""
    kind, *opts = spec.split("_")
    out: dict = {"kind": kind}
    for o in opts:
        out[o[0]] = int(o[1:])
    return out


def scaled(c: int, width_scale: float, multiple: int = 8) -> int:
    """A channel width scaled, rounded to `multiple` (at least one multiple)."""
    return max(multiple, int(round(c * width_scale / multiple)) * multiple)


# what a tensor holds: "conv" (random, scaled by its fan-in), "ones" (norms), "gamma" (layer scales, 1e-5), "zeros"
Spec = tuple[str, tuple[int, ...], type, str]  # name, torch shape (ggml's ne reversed), numpy dtype, fill


def gemma3n_tensors(text_embd: int = 256, width_scale: float = 0.125,
                    arch: tuple[tuple[str, ...], ...] = MNV5_300M) -> list[Spec]:  # fmt: skip
    """The projector's tensors, as the converter names, shapes and types them, without their data."""
    f16, f32 = np.float16, np.float32

    def conv(name: str, out_c: int, in_c: int, k: int, dtype=f16) -> Spec:  # torch [out, in, kh, kw]
        return (name, (out_c, in_c, k, k), dtype, "conv")

    def norm(name: str, n: int) -> Spec:
        return (name, (n,), f32, "ones")

    def gamma(name: str, n: int) -> Spec:  # layer_scale.gamma, unsqueezed to [1, C, 1, 1] by the converter (f32)
        return (name, (1, n, 1, 1), f32, "gamma")

    stem = scaled(STEM, width_scale)
    out = [conv("v.conv_stem.conv.weight", stem, 3, 3, f32),  # forced f32 ("stem")
           ("v.conv_stem.conv.bias", (1, stem, 1, 1), f32, "zeros"), norm("v.conv_stem.bn.weight", stem)]  # fmt: skip
    c_in = stem
    stage_outs = []
    for stage, blocks in enumerate(arch):
        for i, spec in enumerate(blocks):
            b = parse_block(spec)
            p = f"v.blk.{stage}.{i}"
            c_out = scaled(b["c"], width_scale)
            if b["kind"] == "er":
                mid = c_in * b["e"]
                out += [conv(f"{p}.conv_exp.weight", mid, c_in, b["k"]), norm(f"{p}.bn1.weight", mid),
                        conv(f"{p}.conv_pwl.weight", c_out, mid, 1), norm(f"{p}.bn2.weight", c_out)]  # fmt: skip
            elif b["kind"] == "uir":
                mid = c_in * b["e"]
                if b["a"]:
                    out += [conv(f"{p}.dw_start.conv.weight", c_in, 1, b["a"]), norm(f"{p}.dw_start.bn.weight", c_in)]
                out += [conv(f"{p}.pw_exp.conv.weight", mid, c_in, 1), norm(f"{p}.pw_exp.bn.weight", mid)]
                if b["k"]:
                    out += [conv(f"{p}.dw_mid.conv.weight", mid, 1, b["k"]), norm(f"{p}.dw_mid.bn.weight", mid)]
                out += [conv(f"{p}.pw_proj.conv.weight", c_out, mid, 1), norm(f"{p}.pw_proj.bn.weight", c_out),
                        gamma(f"{p}.layer_scale.gamma", c_out)]  # fmt: skip
            elif b["kind"] == "mqa":
                d = scaled(b["d"], width_scale, 4)
                out += [norm(f"{p}.norm.weight", c_in), conv(f"{p}.attn.query.proj.weight", b["h"] * d, c_in, 1)]
                for kv in ("key", "value"):
                    if b.get("v", 1) > 1:
                        out += [conv(f"{p}.attn.{kv}.down_conv.weight", c_in, 1, b["k"]),
                                norm(f"{p}.attn.{kv}.norm.weight", c_in)]  # fmt: skip
                    out.append(conv(f"{p}.attn.{kv}.proj.weight", d, c_in, 1))
                out += [conv(f"{p}.attn.output.proj.weight", c_out, b["h"] * d, 1),
                        gamma(f"{p}.layer_scale.gamma", c_out)]  # fmt: skip
            else:
                raise ValueError(f"block {spec!r}")
            c_in = c_out
        stage_outs.append(c_in)

    msfa_in = sum(stage_outs[-2:])  # msfa_indices (-2, -1): the last two stages
    msfa_mid = msfa_in * MSFA_EXPANSION
    out += [conv("v.msfa.ffn.pw_exp.conv.weight", msfa_mid, msfa_in, 1), norm("v.msfa.ffn.pw_exp.bn.weight", msfa_mid),
            conv("v.msfa.ffn.pw_proj.conv.weight", text_embd, msfa_mid, 1),
            norm("v.msfa.ffn.pw_proj.bn.weight", text_embd),
            norm("v.msfa.norm.weight", text_embd), norm("mm.soft_emb_norm.weight", text_embd),
            # embedding_projection: nn.Linear(vision width, text width): torch [text, vision], ggml [vision, text]
            ("mm.input_projection.weight", (text_embd, text_embd), f16, "conv")]  # fmt: skip
    return out


def write_gemma3n_projector(
    path: str | Path,
    text_embd: int = 256,
    width_scale: float = 0.125,
    *,
    image_size: int = 768,
    arch: tuple[tuple[str, ...], ...] = MNV5_300M,
    seed: int = 0,
) -> Path:
    """A `gemma3nv` projector: the MobileNetV5-300M layout at `width_scale` of its channel widths
    (heads kept, key dims scaled), feeding a text model of n_embd `text_embd`. image_size must
    give a stage-2 map that is a multiple of 16 (the MSFA pools to 16 x 16): 768 (real) or 512."""
    path = Path(path)
    rng = np.random.default_rng(seed)
    if (image_size // 16) % 16:
        raise ValueError(f"image_size {image_size}: image_size / 16 must be a multiple of 16")

    w = gguf.GGUFWriter(str(path), "clip")
    w.add_name(path.stem)
    w.add_type("mmproj")
    w.add_file_type(gguf.LlamaFileType.MOSTLY_F16)
    w.add_bool("clip.has_vision_encoder", True)
    w.add_string("clip.vision.projector_type", "gemma3nv")
    w.add_uint32("clip.vision.projection_dim", text_embd)
    w.add_uint32("clip.vision.image_size", image_size)
    w.add_uint32("clip.vision.patch_size", image_size // 256)  # image_size // image_seq_length (256 tokens)
    w.add_uint32("clip.vision.embedding_length", text_embd)
    w.add_uint32("clip.vision.feed_forward_length", text_embd * 4)  # intermediate_size * 4 (unused)
    w.add_uint32("clip.vision.block_count", 128)  # the converter's fake value (unused)
    w.add_uint32("clip.vision.attention.head_count", 8)
    w.add_array("clip.vision.image_mean", [0.0, 0.0, 0.0])
    w.add_array("clip.vision.image_std", [1.0, 1.0, 1.0])
    w.add_float32("clip.vision.attention.layer_norm_epsilon", 1e-6)
    for name, shape, dtype, fill in gemma3n_tensors(text_embd, width_scale, arch):
        if fill == "conv":
            data = rng.standard_normal(shape) / np.sqrt(np.prod(shape[1:]))
        else:
            data = np.full(shape, {"ones": 1.0, "gamma": 1e-5, "zeros": 0.0}[fill])
        w.add_tensor(name, data.astype(dtype))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


# --- recording the real binary's figures (tests/gemma3n_figures.json) ---
# .venv/bin/python tests/tinymobilenet.py [--all]: for each shape not recorded yet (every shape with --all),
# writes the projector and a llama text model of its width, then runs the real llama-server on the CPU
# (flash attention on and off) for the lines clip prints, and once with the projector on an RPC device
# whose server logs every buffer it allocates in bytes (GGML_RPC_DEBUG), sending one image larger than
# the warm-up's (and of another aspect) to see whether the compute buffer grows.

FIGURES = Path(__file__).with_name("gemma3n_figures.json")
# (width_scale, text_embd = the vision width, image_size); 1.0 / 2048 / 768: Gemma 3n E2B's projector
SHAPES = [
    (0.125, 256, 768),
    (0.0625, 128, 768),
    (0.1875, 384, 768),
    (0.25, 512, 768),
    (0.5, 1024, 768),
    (0.125, 256, 512),
    (0.0625, 512, 768),
    (1.0, 2048, 768),
    (0.0625, 4096, 768),  # a wide head over narrow blocks: the MSFA's end makes the peak
    (0.375, 768, 768),
    (0.03125, 2048, 512),
]
IMAGE_PX = (1000, 700)  # the image sent through /v1/chat/completions


def shape_key(width_scale: float, text_embd: int, image_size: int) -> str:
    return f"gemma3nv|width_scale={width_scale}|text_embd={text_embd}|image={image_size}"


def _record_one(binary: str, bin_dir: Path, model: Path, mmproj: Path) -> dict:
    import re

    from record_llama_figures import run_until_loaded
    from record_projector_figures import _COMPUTE, _FA, _WEIGHTS, _free_port, measure_largest

    fig: dict = {"compute_mib": {}, "clip_flash_attn": {}}
    for fa in ("on", "off"):
        argv = [binary, "-m", str(model), "--mmproj", str(mmproj), "--no-mmproj-offload",
                "--host", "127.0.0.1", "--port", str(_free_port()), "-c", "512", "-ngl", "0", "--flash-attn", fa,
                "-fit", "off", "--verbosity", "4"]  # fmt: skip
        text = "\n".join(run_until_loaded(argv, 600))
        computes = {m.group(1): float(m.group(2)) for m in _COMPUTE.finditer(text)}
        if "CPU" not in computes:
            return {"error": text.splitlines()[-3:]}
        fig["compute_mib"][fa] = computes["CPU"]
        fig["clip_flash_attn"][fa] = m.group(1) if (m := _FA.search(text)) else ""
        fig["weights_mib"] = float(_WEIGHTS.search(text).group(1))
        fig["nodes"] = int(re.search(r"reserve_compute_meta: graph splits = \d+, nodes = (\d+)", text).group(1))
    got = measure_largest(bin_dir, model, mmproj, "on", None, IMAGE_PX, timeout=600, threads=2)
    if "error" in got:
        fig["rpc_error"] = got["error"]
        return fig
    fig["rpc_compute_mib"] = got["warmup_compute_mib"]  # the device's buffer and the host's (the image's copy)
    fig["rpc_compute_bytes"] = got["warmup_bytes"]  # the device's compute buffer, its server's last allocation
    fig["rpc_after_image_bytes"] = got["largest_bytes"]
    fig["grew"] = got["grew"]
    fig["image_px"] = list(IMAGE_PX)
    return fig


def record(again: bool = False) -> int:
    import json
    import sys
    import tempfile

    from lanes.install_rpc import rpc_bin_dir
    from launcher_agent.probe import find_llama_server
    from tinymodels import write_llama

    binary, rpc = find_llama_server(), rpc_bin_dir()
    if binary is None or rpc is None:
        print("no llama-server or no RPC build: `lanes install-llama` and `lanes install-llama --rpc`", file=sys.stderr)
        return 2
    table = json.loads(FIGURES.read_text()) if FIGURES.exists() else {}
    with tempfile.TemporaryDirectory() as tmp:
        for shape in SHAPES:
            key = shape_key(*shape)
            if key in table and not again:
                continue
            scale, text_embd, image = shape
            model = write_llama(Path(tmp) / f"text-{text_embd}.gguf", n_embd=text_embd)
            mmproj = write_gemma3n_projector(Path(tmp) / f"mmproj-{scale}-{text_embd}-{image}.gguf", text_embd, scale,
                                             image_size=image)  # fmt: skip
            table[key] = fig = _record_one(binary, rpc, model, mmproj)
            mmproj.unlink()
            print(key, fig, flush=True)
            FIGURES.write_text(json.dumps(table, indent=1, sort_keys=True) + "\n")
    return 0


if __name__ == "__main__":
    import sys

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    sys.exit(record("--all" in sys.argv[1:]))
