"""Small random-weight multimodal projector files (mmproj GGUF) the real llama-server loads.

A SigLIP-style vision encoder (tools/mtmd/clip.cpp: v.* tensors) with one of the projector
heads llama.cpp's clip reads: `gemma3` (average pool, then mm.input_projection), `idefics3`
(SmolVLM: pixel shuffle, then mm.model.fc), and `mlp` (LLaVA 1.5/1.6: a CLIP encoder with a class
token and a pre-norm, run to its second-to-last block, then mm.0, GELU, mm.2; its hidden width is
the text model's, as LLaVA's converters write it); Qwen2-VL's `qwen2vl_merger` (two patch
convolutions, M-RoPE, a 2 x 2 merge then mm.0, GELU, mm.2), Qwen2.5-VL's `qwen2.5vl_merger` (RMS
norms, a gated FFN, window attention every 4th block) and Qwen3-VL's `qwen3vl_merger` (fused QKV, a
patch bias, learned positions on a 48 x 48 grid, deepstack mergers at blocks 1 to 3 but the last
two); Pixtral's `pixtral` (RMS norms, 2D RoPE, a gated SiLU FFN, no post-norm, then mm.1, GELU, mm.2
and an [IMG_BREAK] embedding after each row; with scale_factor > 1 Mistral Small 3.1's patch merger
before the head). The projector's output width must be the text model's n_embd (mtmd refuses a
mismatch), so `text_embd` is the paired model's.
"""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np

PROJECTOR_TYPES = ("gemma3", "idefics3", "mlp", "qwen2vl_merger", "qwen2.5vl_merger", "qwen3vl_merger", "pixtral",
                   "internvl", "llama4", "qwen2a", "resampler")  # fmt: skip


def _clip_writer(path: Path, proj_type: str, text_embd: int, n_embd: int, n_ff: int, n_head: int, n_layer: int,
                 image_size: int, patch_size: int, ffn: str = "gelu") -> gguf.GGUFWriter:  # fmt: skip
    """A projector file's keys that every type reads (clip.cpp's load_hparams)."""
    w = gguf.GGUFWriter(str(path), "clip")
    w.add_name(path.stem)
    w.add_bool("clip.has_vision_encoder", True)
    w.add_string("clip.projector_type", proj_type)
    w.add_uint32("clip.vision.embedding_length", n_embd)
    w.add_uint32("clip.vision.feed_forward_length", n_ff)
    w.add_uint32("clip.vision.block_count", n_layer)
    w.add_uint32("clip.vision.projection_dim", text_embd)
    w.add_uint32("clip.vision.attention.head_count", n_head)
    w.add_float32("clip.vision.attention.layer_norm_epsilon", 1e-6)
    w.add_uint32("clip.vision.image_size", image_size)
    w.add_uint32("clip.vision.patch_size", patch_size)
    w.add_array("clip.vision.image_mean", [0.5, 0.5, 0.5])
    w.add_array("clip.vision.image_std", [0.5, 0.5, 0.5])
    w.add_bool(f"clip.use_{ffn}", True)
    return w


def _finish(w: gguf.GGUFWriter, path: Path) -> Path:
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def _matrices(rng: np.random.Generator):
    def mat(rows: int, cols: int) -> np.ndarray:  # ggml shape [cols, rows], f16 like real projectors
        return (rng.standard_normal((rows, cols)) * 0.02).astype(np.float16)

    return mat


def _vec(n: int, value: float = 0.0) -> np.ndarray:
    return np.full(n, value, dtype=np.float32)


def _attention(w: gguf.GGUFWriter, block: str, mat, n_embd: int) -> None:
    for t in ("attn_q", "attn_k", "attn_v", "attn_out"):
        w.add_tensor(f"{block}.{t}.weight", mat(n_embd, n_embd))
        w.add_tensor(f"{block}.{t}.bias", _vec(n_embd))


def _attention_and_norms(w: gguf.GGUFWriter, block: str, mat, n_embd: int) -> None:
    _attention(w, block, mat, n_embd)
    for t in ("ln1", "ln2"):
        w.add_tensor(f"{block}.{t}.weight", _vec(n_embd, 1.0))
        w.add_tensor(f"{block}.{t}.bias", _vec(n_embd))


def _siglip_blocks(w: gguf.GGUFWriter, mat, n_embd: int, n_ff: int, n_layer: int) -> None:
    """Pre-norm blocks with biased attention and a biased GELU FFN (v.blk.N.*)."""
    for il in range(n_layer):
        p = f"v.blk.{il}"
        _attention_and_norms(w, p, mat, n_embd)
        w.add_tensor(f"{p}.ffn_up.weight", mat(n_ff, n_embd))
        w.add_tensor(f"{p}.ffn_up.bias", _vec(n_ff))
        w.add_tensor(f"{p}.ffn_down.weight", mat(n_embd, n_ff))
        w.add_tensor(f"{p}.ffn_down.bias", _vec(n_embd))


def write_projector(
    path: str | Path,
    *,
    proj_type: str = "gemma3",
    text_embd: int = 256,
    n_embd: int = 128,
    n_ff: int = 256,
    n_head: int = 4,
    n_layer: int = 2,
    image_size: int = 224,
    patch_size: int = 14,
    scale_factor: int = 2,
    seed: int = 0,
) -> Path:
    if proj_type not in PROJECTOR_TYPES:
        raise ValueError(f"projector type {proj_type!r}: one of {PROJECTOR_TYPES}")
    if proj_type == "qwen2a":  # image_size: the mel bins (Qwen2-Audio's Whisper encoder takes 128)
        from tinyaudio import write_audio_projector

        return write_audio_projector(path, proj_type="qwen2a", text_embd=text_embd, n_embd=n_embd, n_ff=n_ff,
                                     n_head=n_head, n_layer=n_layer, n_mel=image_size, seed=seed)  # fmt: skip
    if proj_type.startswith("qwen"):
        return _write_qwen(Path(path), proj_type, text_embd, n_embd, n_ff, n_head, n_layer, image_size, patch_size,
                           window=4 if proj_type == "qwen2.5vl_merger" else 0, seed=seed)  # fmt: skip
    if proj_type in ("internvl", "llama4"):
        return _write_shuffled(Path(path), proj_type, text_embd, n_embd, n_ff, n_head, n_layer, image_size, patch_size,
                               merge=scale_factor, seed=seed)  # fmt: skip
    if proj_type == "resampler":  # scale_factor: the resampler's queries (MiniCPM-V 2.6's 64)
        return _write_resampler(Path(path), text_embd, n_embd, n_ff, n_head, n_layer, image_size, patch_size,
                                queries=scale_factor, seed=seed)  # fmt: skip
    if proj_type == "pixtral":
        return _write_pixtral(Path(path), text_embd, n_embd, n_ff, n_head, n_layer, image_size, patch_size,
                              merge=scale_factor, seed=seed)  # fmt: skip
    path = Path(path)
    rng = np.random.default_rng(seed)
    n_pos = (image_size // patch_size) ** 2

    mat = _matrices(rng)

    w = _clip_writer(path, proj_type, text_embd, n_embd, n_ff, n_head, n_layer, image_size, patch_size)
    w.add_uint32("clip.vision.projector.scale_factor", scale_factor)
    w.add_file_type(gguf.LlamaFileType.MOSTLY_F16)

    w.add_tensor("v.patch_embd.weight", (rng.standard_normal((n_embd, 3, patch_size, patch_size)) * 0.02).astype(np.float16))
    w.add_tensor("v.patch_embd.bias", _vec(n_embd))
    llava = proj_type == "mlp"
    if llava:  # CLIP: a class token before the patches, and a norm before the first block
        w.add_tensor("v.class_embd", (rng.standard_normal(n_embd) * 0.02).astype(np.float32))
        w.add_tensor("v.pre_ln.weight", _vec(n_embd, 1.0))
        w.add_tensor("v.pre_ln.bias", _vec(n_embd))
    w.add_tensor("v.position_embd.weight", (rng.standard_normal((n_pos + llava, n_embd)) * 0.02).astype(np.float32))
    _siglip_blocks(w, mat, n_embd, n_ff, n_layer)
    if not llava:  # LLaVA takes the second-to-last block's output: its converters drop the post-norm
        w.add_tensor("v.post_ln.weight", _vec(n_embd, 1.0))
        w.add_tensor("v.post_ln.bias", _vec(n_embd))
    if llava:
        w.add_tensor("mm.0.weight", mat(text_embd, n_embd))
        w.add_tensor("mm.0.bias", _vec(text_embd))
        w.add_tensor("mm.2.weight", mat(text_embd, text_embd))
        w.add_tensor("mm.2.bias", _vec(text_embd))
    elif proj_type == "gemma3":
        w.add_tensor("mm.input_projection.weight", mat(n_embd, text_embd))
        w.add_tensor("mm.soft_emb_norm.weight", _vec(n_embd, 1.0))
    else:
        w.add_tensor("mm.model.fc.weight", mat(text_embd, n_embd * scale_factor * scale_factor))
    return _finish(w, path)


def _write_qwen(path: Path, proj_type: str, text_embd: int, n_embd: int, n_ff: int, n_head: int, n_layer: int,
                image_size: int, patch_size: int, window: int, seed: int) -> Path:  # fmt: skip
    rng = np.random.default_rng(seed)
    qwen2 = proj_type != "qwen2.5vl_merger"  # LayerNorms with biases, a plain FFN; 2.5: RMS norms, gated
    qwen3 = proj_type == "qwen3vl_merger"
    deep = (1, 2, 3)[: max(0, n_layer - 2)] if qwen3 else ()

    mat = _matrices(rng)

    w = _clip_writer(path, proj_type, text_embd, n_embd, n_ff, n_head, n_layer, image_size, patch_size)
    if window:
        w.add_uint32("clip.vision.n_wa_pattern", window)
    if qwen3:
        w.add_array("clip.vision.is_deepstack_layers", [il in deep for il in range(n_layer)])
    w.add_file_type(gguf.LlamaFileType.MOSTLY_F16)
    for suffix in ("", ".1"):  # the two frames' convolutions (a still image feeds both)
        w.add_tensor(f"v.patch_embd.weight{suffix}",
                     (rng.standard_normal((n_embd, 3, patch_size, patch_size)) * 0.02).astype(np.float16))  # fmt: skip
    if qwen3:
        w.add_tensor("v.patch_embd.bias", _vec(n_embd))
        w.add_tensor("v.position_embd.weight", (rng.standard_normal((48 * 48, n_embd)) * 0.02).astype(np.float32))
    for il in range(n_layer):
        p = f"v.blk.{il}"
        if qwen3:
            w.add_tensor(f"{p}.attn_qkv.weight", mat(3 * n_embd, n_embd))
            w.add_tensor(f"{p}.attn_qkv.bias", _vec(3 * n_embd))
            w.add_tensor(f"{p}.attn_out.weight", mat(n_embd, n_embd))
            w.add_tensor(f"{p}.attn_out.bias", _vec(n_embd))
        else:
            _attention(w, p, mat, n_embd)
        if il in deep:  # its own merger of the 2 x 2 merged patches, to the text width
            d = f"v.deepstack.{il}"
            w.add_tensor(f"{d}.norm.weight", _vec(4 * n_embd, 1.0))
            w.add_tensor(f"{d}.norm.bias", _vec(4 * n_embd))
            w.add_tensor(f"{d}.fc1.weight", mat(4 * n_embd, 4 * n_embd))
            w.add_tensor(f"{d}.fc1.bias", _vec(4 * n_embd))
            w.add_tensor(f"{d}.fc2.weight", mat(text_embd, 4 * n_embd))
            w.add_tensor(f"{d}.fc2.bias", _vec(text_embd))
        for t in ("ln1", "ln2"):
            w.add_tensor(f"{p}.{t}.weight", _vec(n_embd, 1.0))
            if qwen2:
                w.add_tensor(f"{p}.{t}.bias", _vec(n_embd))
        for t in ("ffn_up",) if qwen2 else ("ffn_up", "ffn_gate"):
            w.add_tensor(f"{p}.{t}.weight", mat(n_ff, n_embd))
            w.add_tensor(f"{p}.{t}.bias", _vec(n_ff))
        w.add_tensor(f"{p}.ffn_down.weight", mat(n_embd, n_ff))
        w.add_tensor(f"{p}.ffn_down.bias", _vec(n_embd))
    w.add_tensor("v.post_ln.weight", _vec(n_embd, 1.0))
    if qwen2:
        w.add_tensor("v.post_ln.bias", _vec(n_embd))
    w.add_tensor("mm.0.weight", mat(n_embd * 4, n_embd * 4))  # over the 2 x 2 merged patches
    w.add_tensor("mm.0.bias", _vec(n_embd * 4))
    w.add_tensor("mm.2.weight", mat(text_embd, n_embd * 4))
    w.add_tensor("mm.2.bias", _vec(text_embd))
    return _finish(w, path)


def _write_pixtral(path: Path, text_embd: int, n_embd: int, n_ff: int, n_head: int, n_layer: int, image_size: int,
                   patch_size: int, merge: int, seed: int) -> Path:  # fmt: skip
    """Pixtral-12B's encoder as llama.cpp's converter writes it (clip.cpp, PROJECTOR_TYPE_PIXTRAL); merge > 1
    adds Mistral Small 3.1's patch merger (mm.input_norm, mm.patch_merger over merge x merge patches)."""
    rng = np.random.default_rng(seed)
    mat = _matrices(rng)
    w = _clip_writer(path, "pixtral", text_embd, n_embd, n_ff, n_head, n_layer, image_size, patch_size, ffn="silu")
    if merge > 1:
        w.add_uint32("clip.vision.spatial_merge_size", merge)
    w.add_file_type(gguf.LlamaFileType.MOSTLY_F16)
    w.add_tensor("v.patch_embd.weight", (rng.standard_normal((n_embd, 3, patch_size, patch_size)) * 0.02).astype(np.float16))
    w.add_tensor("v.pre_ln.weight", _vec(n_embd, 1.0))
    for il in range(n_layer):
        p = f"v.blk.{il}"
        for t in ("attn_q", "attn_k", "attn_v", "attn_out"):
            w.add_tensor(f"{p}.{t}.weight", mat(n_embd, n_embd))
        for t in ("ln1", "ln2"):
            w.add_tensor(f"{p}.{t}.weight", _vec(n_embd, 1.0))
        for t in ("ffn_gate", "ffn_up"):
            w.add_tensor(f"{p}.{t}.weight", mat(n_ff, n_embd))
        w.add_tensor(f"{p}.ffn_down.weight", mat(n_embd, n_ff))
    if merge > 1:
        w.add_tensor("mm.input_norm.weight", _vec(n_embd, 1.0))
        w.add_tensor("mm.patch_merger.weight", mat(n_embd, n_embd * merge * merge))
    w.add_tensor("mm.1.weight", mat(text_embd, n_embd))
    w.add_tensor("mm.1.bias", _vec(text_embd))
    w.add_tensor("mm.2.weight", mat(text_embd, text_embd))
    w.add_tensor("mm.2.bias", _vec(text_embd))
    w.add_tensor("v.token_embd.img_break", (rng.standard_normal(text_embd) * 0.02).astype(np.float32))
    return _finish(w, path)


def _write_resampler(path: Path, text_embd: int, n_embd: int, n_ff: int, n_head: int, n_layer: int,
                     image_size: int, patch_size: int, queries: int, seed: int) -> Path:  # fmt: skip
    """MiniCPM-V 2.6's projector as llama.cpp's converter writes it (minicpmv-convert-image-encoder-to-gguf.py,
    type "resampler", version 3): a SigLIP encoder whose learned positions are a 70 x 70 table read by
    bucket, a post-norm, then a resampler: `queries` learned queries cross-attending (heads of 128) to
    the patches, a LayerNorm and a square projection to the text width (a multiple of 128)."""
    rng = np.random.default_rng(seed)
    mat = _matrices(rng)
    w = _clip_writer(path, "resampler", 0, n_embd, n_ff, n_head, n_layer, image_size, patch_size)
    w.add_int32("clip.minicpmv_version", 3)
    w.add_uint32("clip.minicpmv_query_num", queries)
    w.add_file_type(gguf.LlamaFileType.MOSTLY_F16)
    w.add_tensor("v.patch_embd.weight", (rng.standard_normal((n_embd, 3, patch_size, patch_size)) * 0.02).astype(np.float16))
    w.add_tensor("v.patch_embd.bias", _vec(n_embd))
    w.add_tensor("v.position_embd.weight", (rng.standard_normal((70 * 70, n_embd)) * 0.02).astype(np.float32))
    _siglip_blocks(w, mat, n_embd, n_ff, n_layer)
    w.add_tensor("v.post_ln.weight", _vec(n_embd, 1.0))
    w.add_tensor("v.post_ln.bias", _vec(n_embd))
    w.add_tensor("resampler.pos_embed_k", (rng.standard_normal((70 * 70, text_embd)) * 0.02).astype(np.float32))
    w.add_tensor("resampler.query", (rng.standard_normal((queries, text_embd)) * 0.02).astype(np.float32))
    w.add_tensor("resampler.kv.weight", mat(text_embd, n_embd))
    for t in ("q", "k", "v", "out"):
        w.add_tensor(f"resampler.attn.{t}.weight", mat(text_embd, text_embd))
        w.add_tensor(f"resampler.attn.{t}.bias", _vec(text_embd))
    for t in ("q", "kv", "post"):
        w.add_tensor(f"resampler.ln_{t}.weight", _vec(text_embd, 1.0))
        w.add_tensor(f"resampler.ln_{t}.bias", _vec(text_embd))
    w.add_tensor("resampler.proj.weight", mat(text_embd, text_embd))
    return _finish(w, path)


def _write_shuffled(path: Path, proj_type: str, text_embd: int, n_embd: int, n_ff: int, n_head: int, n_layer: int,
                    image_size: int, patch_size: int, merge: int, seed: int) -> Path:  # fmt: skip
    """A class token, learned positions, LayerNorm blocks, then a pixel shuffle of merge x merge patches
    into an MLP: InternVL's (layer scales; mm.model.mlp.0 LayerNorm, .1, GELU, .3) or Llama 4's (a
    linear patch unfold, RoPE-2D; mm.model.mlp.1, .2 and mm.model.fc, no biases)."""
    rng = np.random.default_rng(seed)
    mat = _matrices(rng)
    internvl = proj_type == "internvl"
    n_pos = (image_size // patch_size) ** 2 + 1
    w = _clip_writer(path, proj_type, text_embd, n_embd, n_ff, n_head, n_layer, image_size, patch_size)
    w.add_uint32("clip.vision.projector.scale_factor", merge)
    w.add_file_type(gguf.LlamaFileType.MOSTLY_F16)
    if internvl:
        w.add_tensor("v.patch_embd.weight", (rng.standard_normal((n_embd, 3, patch_size, patch_size)) * 0.02).astype(np.float16))
        w.add_tensor("v.patch_embd.bias", _vec(n_embd))
    else:  # Llama4UnfoldConvolution: a linear layer over the unrolled patch
        w.add_tensor("v.patch_embd.weight", mat(n_embd, 3 * patch_size * patch_size))
    w.add_tensor("v.class_embd", (rng.standard_normal(n_embd) * 0.02).astype(np.float32))
    w.add_tensor("v.position_embd.weight", (rng.standard_normal((n_pos, n_embd)) * 0.02).astype(np.float32))
    for il in range(n_layer):
        p = f"v.blk.{il}"
        _attention_and_norms(w, p, mat, n_embd)
        if internvl:
            w.add_tensor(f"{p}.ls1.weight", _vec(n_embd, 0.1))
            w.add_tensor(f"{p}.ls2.weight", _vec(n_embd, 0.1))
        w.add_tensor(f"{p}.ffn_up.weight", mat(n_ff, n_embd))
        w.add_tensor(f"{p}.ffn_up.bias", _vec(n_ff))
        w.add_tensor(f"{p}.ffn_down.weight", mat(n_embd, n_ff))
        w.add_tensor(f"{p}.ffn_down.bias", _vec(n_embd))
    shuffled = n_embd * merge * merge
    if internvl:
        w.add_tensor("mm.model.mlp.0.weight", _vec(shuffled, 1.0))
        w.add_tensor("mm.model.mlp.0.bias", _vec(shuffled))
        w.add_tensor("mm.model.mlp.1.weight", mat(text_embd, shuffled))
        w.add_tensor("mm.model.mlp.1.bias", _vec(text_embd))
        w.add_tensor("mm.model.mlp.3.weight", mat(text_embd, text_embd))
        w.add_tensor("mm.model.mlp.3.bias", _vec(text_embd))
    else:  # Llama4VisionMLP2 (the shuffled width to n_ff, then to text_embd), then the projector
        w.add_tensor("mm.model.mlp.1.weight", mat(n_ff, shuffled))
        w.add_tensor("mm.model.mlp.2.weight", mat(text_embd, n_ff))
        w.add_tensor("mm.model.fc.weight", mat(text_embd, text_embd))
    return _finish(w, path)


# The vocabulary pieces mtmd looks up for an idefics3 image (tools/mtmd/mtmd.cpp): a text model
# paired with an idefics3 projector needs them (tinymodels.write_llama(special=...)).
IDEFICS3_TOKENS = ("\n", "\n\n", "<fake_token_around_image>", "<global-img>")
MINICPMV_TOKENS = ("<image>", "</image>", "<slice>", "</slice>", "\n")
