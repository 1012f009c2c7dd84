"""Small random-weight audio projector files (mmproj GGUF) on Whisper's encoder that the real llama-server loads.

Every type shares the encoder as llama.cpp's converters write it (conversion/ultravox.py WhisperEncoderModel and
its subclasses; clip.cpp load_hparams / load_tensors, b11434): `clip.has_audio_encoder`, `clip.projector_type`,
`clip.audio.*` keys (embedding_length, feed_forward_length, block_count, projection_dim, attention.head_count,
attention.layer_norm_epsilon, num_mel_bins, and projector.stack_factor where the type reads it), and `a.*`
tensors: two 1-D convolutions (a.conv1d.{1,2}, f16 kernels [3, in, n_embd], biases [1, n_embd] f32), 1,500 learned
positions, LayerNorm blocks whose K has no bias (whisper-enc.cpp asserts it), a post-norm. The heads (`mm.a.*`):

- qwen2a (Qwen2-Audio): mm.a.fc (+ bias) to the text width;
- ultravox (Ultravox 0.5): mm.a.norm_pre (RMS, n_embd * stack), mm.a.mlp.1 (to `hidden`, no bias), a swapped
  SwiGLU to hidden / 2, mm.a.norm_mid, mm.a.mlp.2 to the text width (no bias);
- voxtral (Voxtral): mm.a.mlp.1 (n_embd * stack to `hidden`), erf GELU, mm.a.mlp.2 (no biases; stack 4);
- musicflamingo (Audio Flamingo 3 / Music Flamingo): mm.a.mlp.1, .2 with biases over n_embd (no stack);
- meralion (MERaLiON 2): mm.a.norm_pre (LayerNorm, n_embd * stack), mm.a.mlp.0 (to `hidden`) .. .3, biases;
- glma (GLM-ASR): mm.a.norm_pre (LayerNorm, n_embd), mm.a.mlp.1 (n_embd * stack to `hidden`), .2, biases, and
  the begin / end of audio embeddings v.boi, v.eoi (text width).

The projector's output width must be the text model's n_embd (mtmd refuses a mismatch); mtmd looks up no
vocabulary pieces for these types at start (its audio markers, Qwen2-Audio's <|audio_bos|> or Voxtral's
[BEGIN_AUDIO], are only tokenized into a prompt), so tinymodels.write_llama(path, n_embd=text_embd) pairs them.
"""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np

AUDIO_TYPES = ("qwen2a", "ultravox", "voxtral", "musicflamingo", "meralion", "glma")
STACKED = ("ultravox", "voxtral", "meralion", "glma")  # clip.audio.projector.stack_factor required
WHISPER_POSITIONS = 1500
# the stack factor and head width each type's real model has (Ultravox 0.5: 8 and 4,096; Voxtral: 4 and the text
# width; MERaLiON 2: 15 and 6,400; GLM-ASR-Nano: 4 and 4,096)
DEFAULT_STACK = {"ultravox": 8, "voxtral": 4, "meralion": 15, "glma": 4}


def default_hidden(proj_type: str, text_embd: int) -> int:
    return {"ultravox": 2 * text_embd, "meralion": 2 * text_embd, "glma": 2 * text_embd}.get(proj_type, text_embd)


def write_audio_projector(
    path: str | Path,
    *,
    proj_type: str = "qwen2a",
    text_embd: int = 256,
    n_embd: int = 128,
    n_ff: int = 256,
    n_head: int = 4,
    n_layer: int = 2,
    n_mel: int = 128,
    stack_factor: int | None = None,
    hidden: int | None = None,
    seed: int = 0,
) -> Path:
    """A projector of proj_type; stack_factor and hidden (the head's first matrix's rows) default to
    DEFAULT_STACK and default_hidden."""
    if proj_type not in AUDIO_TYPES:
        raise ValueError(f"audio projector type {proj_type!r}: one of {AUDIO_TYPES}")
    path = Path(path)
    stack = DEFAULT_STACK.get(proj_type, 0) if stack_factor is None else stack_factor
    hidden = default_hidden(proj_type, text_embd) if hidden is None else hidden
    rng = np.random.default_rng(seed)

    def mat(rows: int, cols: int) -> np.ndarray:  # ggml shape [cols, rows], f16 like real projectors
        return (rng.standard_normal((rows, cols), dtype=np.float32) * 0.02).astype(np.float16)

    def vec(n: int, value: float = 0.0) -> np.ndarray:
        return np.full(n, value, dtype=np.float32)

    w = gguf.GGUFWriter(str(path), "clip")
    w.add_name(path.stem)
    w.add_bool("clip.has_audio_encoder", True)
    w.add_string("clip.projector_type", proj_type)
    for key, value in (("embedding_length", n_embd), ("feed_forward_length", n_ff), ("block_count", n_layer),
                       ("projection_dim", text_embd), ("attention.head_count", n_head), ("num_mel_bins", n_mel)):  # fmt: skip
        w.add_uint32(f"clip.audio.{key}", value)
    w.add_float32("clip.audio.attention.layer_norm_epsilon", 1e-5)
    if proj_type in STACKED:
        w.add_uint32("clip.audio.projector.stack_factor", stack)
    w.add_file_type(gguf.LlamaFileType.MOSTLY_F16)

    # the encoder (Whisper's)
    w.add_tensor("a.conv1d.1.weight", (rng.standard_normal((n_embd, n_mel, 3), dtype=np.float32) * 0.02).astype(np.float16))
    w.add_tensor("a.conv1d.1.bias", np.zeros((n_embd, 1), dtype=np.float32))
    w.add_tensor("a.conv1d.2.weight", (rng.standard_normal((n_embd, n_embd, 3), dtype=np.float32) * 0.02).astype(np.float16))
    w.add_tensor("a.conv1d.2.bias", np.zeros((n_embd, 1), dtype=np.float32))
    w.add_tensor("a.position_embd.weight",
                 (rng.standard_normal((WHISPER_POSITIONS, n_embd), dtype=np.float32) * 0.02))  # fmt: skip
    for il in range(n_layer):
        p = f"a.blk.{il}"
        for t in ("attn_q", "attn_k", "attn_v", "attn_out"):
            w.add_tensor(f"{p}.{t}.weight", mat(n_embd, n_embd))
            if t != "attn_k":
                w.add_tensor(f"{p}.{t}.bias", vec(n_embd))
        for t in ("ln1", "ln2"):
            w.add_tensor(f"{p}.{t}.weight", vec(n_embd, 1.0))
            w.add_tensor(f"{p}.{t}.bias", vec(n_embd))
        w.add_tensor(f"{p}.ffn_up.weight", mat(n_ff, n_embd))
        w.add_tensor(f"{p}.ffn_up.bias", vec(n_ff))
        w.add_tensor(f"{p}.ffn_down.weight", mat(n_embd, n_ff))
        w.add_tensor(f"{p}.ffn_down.bias", vec(n_embd))
    w.add_tensor("a.post_ln.weight", vec(n_embd, 1.0))
    w.add_tensor("a.post_ln.bias", vec(n_embd))

    # the head
    stacked = n_embd * stack
    if proj_type == "qwen2a":
        w.add_tensor("mm.a.fc.weight", mat(text_embd, n_embd))
        w.add_tensor("mm.a.fc.bias", vec(text_embd))
    elif proj_type == "ultravox":  # UltravoxProjector: RMS norms, a SwiGLU whose second half is the gate
        if hidden % 2:
            raise ValueError(f"ultravox: the SwiGLU's width {hidden} must be even")
        w.add_tensor("mm.a.norm_pre.weight", vec(stacked, 1.0))
        w.add_tensor("mm.a.mlp.1.weight", mat(hidden, stacked))
        w.add_tensor("mm.a.norm_mid.weight", vec(hidden // 2, 1.0))
        w.add_tensor("mm.a.mlp.2.weight", mat(text_embd, hidden // 2))
    elif proj_type in ("voxtral", "musicflamingo"):
        width = stacked if proj_type == "voxtral" else n_embd
        w.add_tensor("mm.a.mlp.1.weight", mat(hidden, width))
        w.add_tensor("mm.a.mlp.2.weight", mat(text_embd, hidden))
        if proj_type == "musicflamingo":
            w.add_tensor("mm.a.mlp.1.bias", vec(hidden))
            w.add_tensor("mm.a.mlp.2.bias", vec(text_embd))
    elif proj_type == "meralion":
        w.add_tensor("mm.a.norm_pre.weight", vec(stacked, 1.0))
        w.add_tensor("mm.a.norm_pre.bias", vec(stacked))
        for i, (rows, cols) in enumerate(((hidden, stacked), (hidden, hidden), (hidden, hidden), (text_embd, hidden))):
            w.add_tensor(f"mm.a.mlp.{i}.weight", mat(rows, cols))
            w.add_tensor(f"mm.a.mlp.{i}.bias", vec(rows))
    else:  # glma
        w.add_tensor("mm.a.norm_pre.weight", vec(n_embd, 1.0))
        w.add_tensor("mm.a.norm_pre.bias", vec(n_embd))
        w.add_tensor("mm.a.mlp.1.weight", mat(hidden, stacked))
        w.add_tensor("mm.a.mlp.1.bias", vec(hidden))
        w.add_tensor("mm.a.mlp.2.weight", mat(text_embd, hidden))
        w.add_tensor("mm.a.mlp.2.bias", vec(text_embd))
        w.add_tensor("v.boi", (rng.standard_normal(text_embd, dtype=np.float32) * 0.02))
        w.add_tensor("v.eoi", (rng.standard_normal(text_embd, dtype=np.float32) * 0.02))

    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def audio_pair(folder: Path, proj_type: str, *, text_embd: int, **kw) -> tuple[Path, Path]:
    """A text model of the projector's output width and the projector: (model, mmproj)."""
    from tinymodels import write_llama

    folder = Path(folder)
    model = folder / f"text-{text_embd}.gguf"
    if not model.exists():
        write_llama(model, n_embd=text_embd)
    tag = "-".join(f"{k}{v}" for k, v in sorted(kw.items()))
    mmproj = write_audio_projector(folder / f"mmproj-{proj_type}-{text_embd}-{tag}.gguf", proj_type=proj_type,
                                   text_embd=text_embd, **kw)  # fmt: skip
    return model, mmproj
