"""Multimodal projectors (mmproj GGUF files) read and paired with their models.

Pairing follows llama.cpp's router mode reading --models-dir (common/preset.cpp,
load_from_models_dir): in a folder, a *.gguf whose name contains "mmproj" is the
projector of the model file beside it. A folder holding several models pairs a projector
with the model whose base name it carries (mmproj-NAME-f16.gguf or NAME-mmproj-f16.gguf
beside NAME-Q4_K_M.gguf): the name without "mmproj" and its type suffix.
"""

from __future__ import annotations

import math
import os
import re
from collections.abc import Iterable
from pathlib import Path

from shared.gguf_scan import GGUFFormatError, GGUFHeader, read_header
from shared.gguf_weights import cuda_bytes
from shared.messages.hosts import ProjectorFacts

PROJECTOR_ARCH = "clip"
# A weight type or quantization at the end of a file's stem: -f16, .Q4_K_M, _bf16, -IQ3_XXS, -model-f16.
_DEEPSTACK = re.compile(r"v\.deepstack\.\d+\.")  # Qwen3-VL's deepstack mergers, by block
BF16 = 30  # ggml's type id
_TYPE_SUFFIX = re.compile(r"([-_.](model|f16|f32|bf16|fp16|fp32|q\d[a-z0-9_]*|iq\d[a-z0-9_]*|mxfp4))+$")


def is_projector_name(path: str | os.PathLike[str]) -> bool:
    """llama.cpp's test: a .gguf whose name contains "mmproj"."""
    name = Path(path).name
    return name.endswith(".gguf") and "mmproj" in name


def base_name(path: str | os.PathLike[str]) -> str:
    """A file's model name for pairing: lowercased, without "mmproj" and the type suffix."""
    stem = Path(path).name.lower().removesuffix(".gguf")
    stem = re.sub(r"[-_.]*mmproj[-_.]*", "-", stem).strip("-_.")
    stem = _TYPE_SUFFIX.sub("", stem)
    return re.sub(r"[-_.]+", "-", stem)


def is_projector(header: GGUFHeader) -> bool:
    return header.fields.get("general.architecture") == PROJECTOR_ARCH


def projector_facts(path: str | os.PathLike[str], header: GGUFHeader | None = None) -> ProjectorFacts:
    """What the planner needs of a projector file (raises GGUFFormatError for another file)."""
    path = Path(path)
    header = header or read_header(path)
    if not is_projector(header):
        raise GGUFFormatError(f"{path}: not a projector (general.architecture is not {PROJECTOR_ARCH})")
    f = header.fields

    def u32(key: str) -> int:
        value = f.get(key, 0)
        return int(value) if isinstance(value, (int, float)) else 0

    vision = bool(f.get("clip.has_vision_encoder", False))
    audio = bool(f.get("clip.has_audio_encoder", False))
    enc = "clip.vision" if vision or not audio else "clip.audio"  # an audio-only file's encoder
    proj_type = f.get("clip.projector_type") or f.get(f"{enc}.projector_type") or ""
    st = path.stat()
    # gemma3 and gemma3nv; idefics3 and llama4; mlp (LLaVA), pixtral and Qwen's; internvl; qwen2a (audio);
    # MiniCPM-V's resampler
    heads = ("mm.input_projection.weight", "mm.model.fc.weight", "mm.2.weight", "mm.model.mlp.3.weight",
             "mm.a.fc.weight", "resampler.proj.weight")  # fmt: skip
    proj = next((t for t in header.tensors if t.name in heads), None)
    mmproj_embd = 0
    if proj is not None:  # clip_n_mmproj_embd for the types generated files and tests read
        first = proj.name in ("mm.input_projection.weight", "resampler.proj.weight")
        mmproj_embd = proj.shape[0] if first else proj.shape[1]
    tensors = header.tensors
    graph_compute = 0
    if proj_type == "gemma3nv":  # clip.cpp loads its vision tower only: the file's audio tower stays on disk
        from shared.memory.mobilenet import MobileNetFacts, mobilenet_compute_bytes

        tensors = tuple(t for t in tensors if t.name.startswith(("v.", "mm.")) and not t.name.startswith("mm.a."))
        graph_compute = mobilenet_compute_bytes(MobileNetFacts(
            image_size=u32("clip.vision.image_size"), shapes={t.name: t.shape for t in tensors},
            types={t.name: t.type for t in tensors}))  # fmt: skip
    return ProjectorFacts(
        path=os.path.abspath(path),
        projector_type=str(proj_type),
        vision=vision,
        audio=audio,
        weight_bytes=sum(-(-t.n_bytes // 32) * 32 for t in tensors),
        weight_cuda_bytes=sum(cuda_bytes(t) for t in tensors),
        file_weight_bytes=sum(t.n_bytes for t in tensors),
        n_embd=u32(f"{enc}.embedding_length"),
        n_ff=u32(f"{enc}.feed_forward_length"),
        n_head=u32(f"{enc}.attention.head_count"),
        n_layer=u32(f"{enc}.block_count"),
        n_mel_bins=u32("clip.audio.num_mel_bins"),
        image_size=u32("clip.vision.image_size"),
        patch_size=u32("clip.vision.patch_size"),
        n_merge=u32("clip.vision.projector.scale_factor") or u32("clip.vision.spatial_merge_size"),
        n_mmproj_embd=int(mmproj_embd) or u32(f"{enc}.projection_dim"),
        n_queries=_resampler_queries(f) if proj_type == "resampler" else 0,
        stack_factor=u32("clip.audio.projector.stack_factor"),
        proj_hidden=_audio_hidden(tensors, proj_type),
        n_wa_pattern=u32("clip.vision.n_wa_pattern"),
        deepstack=tuple(sorted({int(t.name.split(".")[2]) for t in tensors if _DEEPSTACK.match(t.name)})),
        pos_side=_table_side(tensors) if proj_type == "qwen3vl_merger" else 0,
        kernel_bf16=any(t.name == "v.patch_embd.weight" and t.type == BF16 for t in tensors),
        pre_ln=any(t.name == "v.pre_ln.weight" for t in tensors),
        post_ln=any(t.name == "v.post_ln.weight" for t in tensors),
        graph_compute_bytes=graph_compute,
        file_bytes=st.st_size,
        file_mtime_ns=st.st_mtime_ns,
    )


def _table_side(tensors) -> int:
    """Qwen3-VL's learned position table's side: the root of v.position_embd's rows."""
    table = next((t for t in tensors if t.name == "v.position_embd.weight" and len(t.shape) > 1), None)
    return math.isqrt(int(table.shape[1])) if table is not None else 0


def _audio_hidden(tensors, proj_type: str) -> int:
    """An audio head's MLP width: the rows (ne[1]) of its first matrix, mm.a.mlp.1 (MERaLiON's mm.a.mlp.0)."""
    name = "mm.a.mlp.0.weight" if proj_type == "meralion" else "mm.a.mlp.1.weight"
    first = next((t for t in tensors if t.name == name), None)
    return int(first.shape[1]) if first is not None and len(first.shape) > 1 else 0


def _resampler_queries(fields: dict) -> int:
    """clip.cpp load_hparams: clip.minicpmv_query_num, else 64 from version 3 (MiniCPM-V 2.6) on, 96 before
    (version 2 when unset)."""
    queries = fields.get("clip.minicpmv_query_num", 0)
    if isinstance(queries, int) and queries > 0:
        return queries
    version = fields.get("clip.minicpmv_version", 2)
    return 64 if isinstance(version, int) and version >= 3 else 96


def pair(models: Iterable[str], projectors: Iterable[str]) -> dict[str, str]:
    """{model path: projector path}. Pure over paths: a projector pairs with a model in its own
    folder, by base name; failing that, with the folder's only model (the router's convention of
    one model per folder). Of several candidates the first by name is taken."""
    by_folder: dict[str, tuple[list[str], list[str]]] = {}
    for m in models:
        by_folder.setdefault(str(Path(m).parent), ([], []))[0].append(m)
    for p in projectors:
        by_folder.setdefault(str(Path(p).parent), ([], []))[1].append(p)
    out: dict[str, str] = {}
    for folder_models, folder_projectors in by_folder.values():
        if not folder_models or not folder_projectors:
            continue
        folder_projectors = sorted(folder_projectors)
        for m in sorted(folder_models):
            named = [p for p in folder_projectors if base_name(p) == base_name(m)]
            if named:
                out[m] = named[0]
            elif len(folder_models) == 1:
                out[m] = folder_projectors[0]
    return out
