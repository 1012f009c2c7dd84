"""Audio projectors on Whisper's encoder (clip.projector_type `qwen2a`, `ultravox`, `voxtral`, `musicflamingo`,
`meralion`, `glma`): the compute buffer clip allocates for one 30 s chunk, to the byte. Pure.

The graph (b11434: tools/mtmd/models/whisper-enc.cpp clip_graph_whisper_enc::build, with clip.cpp's build_inp_raw,
build_vit, build_norm, build_ffn, build_attn: shared/memory/clip_graph.py, and build_stack) takes the chunk's mel
spectrogram (inp_raw, 3,000 frames x n_mel f32: clip-model.h warmup_audio_size, the warm-up's and every chunk's
size: mtmd-audio.cpp cuts longer audio into 30 s chunks) through two 1-D convolutions (ggml_conv_1d_ph: an f16
im2col and a mul_mat each, the second of stride 2, so 1,500 positions), each with a bias and an erf GELU, a
transposed copy, learned positions (a view of a.position_embd), LayerNorm blocks (K without a bias, an erf-GELU FFN
with biases), then per type:

- qwen2a, voxtral, musicflamingo: an average pool of 2 (clip-model.h audio_has_avgpool: a transposed copy, pool_1d,
  a transposed copy back) before the post-norm, so 750 positions;
- ultravox, voxtral, meralion: the frames stacked by `stack_factor` (build_stack: a zero pad to a whole row when
  the positions are not a multiple, then a view of rows of n_embd * stack_factor);
- the head: qwen2a mm.a.fc (+ bias); ultravox RMS norm (mm.a.norm_pre), mm.a.mlp.1, a swapped SwiGLU (half the
  width), RMS norm (mm.a.norm_mid), mm.a.mlp.2; voxtral mm.a.mlp.1, erf GELU, mm.a.mlp.2 (no biases);
  musicflamingo the same with biases; meralion LayerNorm (mm.a.norm_pre), mm.a.mlp.0 + bias and SiLU, a gate
  (mm.a.mlp.1 + bias, SiLU) times a pool (mm.a.mlp.2 + bias), mm.a.mlp.3 + bias; glma LayerNorm (mm.a.norm_pre)
  at n_embd, then the stack, mm.a.mlp.1 + bias, erf GELU, mm.a.mlp.2 + bias, and v.boi / v.eoi concatenated
  before and after.

The facts each type needs beyond the encoder's (clip.audio.embedding_length, feed_forward_length,
attention.head_count, block_count, num_mel_bins) and the text width (the head's output rows: mm.a.fc.weight,
mm.a.mlp.2.weight, mm.a.mlp.3.weight ne[1]; clip.audio.projection_dim in converted files):

- stack_factor: clip.audio.projector.stack_factor (ultravox 8 in Ultravox 0.5, voxtral 4, meralion 15 by
  default, glma the config's merge_factor; clip.cpp requires it for those four and ignores it for the others);
- proj_hidden: the head's first matrix's output rows, mm.a.mlp.1.weight ne[1] (ultravox: the SwiGLU's input,
  4,096 in Ultravox 0.5, the mid-norm is half; voxtral the text width in Voxtral's files; musicflamingo, glma), or
  mm.a.mlp.0.weight ne[1] for meralion (whose mm.a.mlp.1 and .2 are square at that width, as MERaLiON 2's).

Attention is ggml_flash_attn_ext over f16 copies of K and V with flash attention on, else mul_mat + soft_max over
the f32 scores (1,500 x 1,500 x n_head) and a contiguous copy of V transposed. The module builds clip's tensors in
ggml's order (build_attn's ggml_build_forward_order of Q, K and V first) and replays ggml-alloc on them
(shared/memory/graph_alloc.py). With --no-mmproj-offload the buffer is the CPU's (inp_raw a leaf); on a device
the scheduler copies inp_raw in as the split's first node: the same size (offload_inputs replays that graph).

Measured: tests/audio_figures.json (the b11434 CPU build's printed MiB and the RPC server's exact bytes) and the
qwen2a figures of tests/llama_figures.json, checked in tests/test_whisper_graph.py.
"""

from __future__ import annotations

from functools import lru_cache

from shared.memory.clip_graph import ClipBuilder, Layer
from shared.memory.graph_alloc import F16, F32, Graph, Tensor, dup, leaf, mul_mat, new, replay, reshape, transpose, view

WHISPER_FRAMES = 3000  # clip-model.h warmup_audio_size: a 30 s chunk of 10 ms frames
WHISPER_POSITIONS = 1500  # a.position_embd: Whisper's table (the encoder's 1,500 positions)
AVGPOOL_TYPES = frozenset({"qwen2a", "voxtral", "musicflamingo"})  # clip-model.h audio_has_avgpool
STACKED_TYPES = frozenset({"ultravox", "voxtral", "meralion"})  # clip-model.h audio_has_stack_frames
NEEDS_STACK = STACKED_TYPES | {"glma"}  # clip.cpp load_hparams: clip.audio.projector.stack_factor required
NEEDS_HIDDEN = frozenset({"ultravox", "voxtral", "musicflamingo", "meralion", "glma"})
AUDIO_TYPES = frozenset({"qwen2a"}) | NEEDS_HIDDEN


def whisper_compute_bytes(*, proj_type: str, n_embd: int, n_ff: int, n_head: int, n_layer: int, n_mel: int,
                          text_embd: int, flash_attn: bool, stack_factor: int = 0, proj_hidden: int = 0,
                          n_frames: int = WHISPER_FRAMES) -> int:  # fmt: skip
    """The compute buffer (bytes) clip allocates for one chunk of n_frames mel frames (the CPU's with
    --no-mmproj-offload, the device's when offloaded: the same). stack_factor and proj_hidden: see the module
    (ignored by the types that do not read them). Raises ValueError on a type or widths clip cannot build."""
    if proj_type not in AUDIO_TYPES:
        raise ValueError(f"{proj_type!r}: not a Whisper-encoder audio projector ({sorted(AUDIO_TYPES)})")
    if n_head <= 0 or n_embd % n_head or n_layer < 1 or n_mel <= 0 or text_embd <= 0:
        raise ValueError(f"whisper widths: n_embd {n_embd} over {n_head} heads, {n_layer} layers, {n_mel} mel bins")
    if proj_type in NEEDS_STACK and stack_factor <= 0:
        raise ValueError(f"{proj_type}: needs clip.audio.projector.stack_factor")
    if proj_type in NEEDS_HIDDEN and (proj_hidden <= 0 or (proj_type == "ultravox" and proj_hidden % 2)):
        raise ValueError(f"{proj_type}: needs the head's hidden width (an even one for ultravox's SwiGLU)")
    if n_frames // 2 > WHISPER_POSITIONS:
        raise ValueError(f"{n_frames} frames: more than Whisper's {WHISPER_POSITIONS} positions")
    if proj_type not in NEEDS_STACK:
        stack_factor = 0
    if proj_type not in NEEDS_HIDDEN:
        proj_hidden = 0
    return _bytes(proj_type, n_embd, n_ff, n_head, n_layer, n_mel, text_embd, bool(flash_attn), stack_factor,
                  proj_hidden, n_frames)  # fmt: skip


@lru_cache(maxsize=4096)
def _bytes(proj_type, n_embd, n_ff, n_head, n_layer, n_mel, text_embd, flash_attn, stack_factor, proj_hidden,
           n_frames) -> int:  # fmt: skip
    graph = build_graph(proj_type=proj_type, n_embd=n_embd, n_ff=n_ff, n_head=n_head, n_layer=n_layer, n_mel=n_mel,
                        text_embd=text_embd, flash_attn=flash_attn, stack_factor=stack_factor,
                        proj_hidden=proj_hidden, n_frames=n_frames)  # fmt: skip
    return replay(graph).size


def build_graph(*, proj_type: str, n_embd: int, n_ff: int, n_head: int, n_layer: int, n_mel: int, text_embd: int,
                flash_attn: bool, stack_factor: int = 0, proj_hidden: int = 0,
                n_frames: int = WHISPER_FRAMES) -> Graph:  # fmt: skip
    """clip_graph_whisper_enc::build for one chunk of n_frames mel frames."""
    return _Builder(proj_type, n_embd, n_ff, n_head, n_layer, n_mel, text_embd, flash_attn, stack_factor,
                    proj_hidden).build(n_frames)  # fmt: skip


def ggml_pad(x: int, n: int) -> int:
    """ggml.h GGML_PAD: (x + n - 1) & ~(n - 1), a bit mask that rounds up to a multiple of n only when n is a power
    of 2. build_stack pads with it, so for other strides (n_embd * stack_factor: 10,240 at Ultravox's 1280 x 8)
    the padded length is whatever the mask leaves: a pad where none is needed, or fewer rows than the frames fill."""
    return (x + n - 1) & ~(n - 1)


def _view_2d(a: Tensor, ne0: int, ne1: int) -> Tensor:
    """ggml_view_2d at offset 0 with rows of ne0 elements (contiguous)."""
    return view(a, "VIEW", (ne0, ne1))


class _Builder(ClipBuilder):
    """clip_graph_whisper_enc: ClipBuilder's helpers (blocks whose K has no bias) and the audio pieces."""

    def __init__(self, proj_type, n_embd, n_ff, n_head, n_layer, n_mel, text, fa, stack, hidden):
        super().__init__(n_embd, n_ff, n_head, fa, Layer(k_bias=False))
        self.type, self.n_layer, self.n_mel, self.text, self.stack, self.hidden = (
            proj_type, n_layer, n_mel, text, stack, hidden)  # fmt: skip

    def conv_1d_ph(self, inp: Tensor, c_in: int, c_out: int, stride: int) -> Tensor:
        """ggml_conv_1d_ph (kernel 3, padding 1): an f16 im2col, a mul_mat, [frames, c_out]."""
        kernel = self.w((3, c_in, c_out), F16)
        out_len = (inp.ne[0] + 2 - 2 - 1) // stride + 1
        im2col = new((3 * c_in, out_len, 1, 1), "IM2COL", (kernel, inp), F16)
        cur = mul_mat(reshape(im2col, 3 * c_in, out_len), reshape(kernel, 3 * c_in, c_out))
        return reshape(cur, out_len, c_out, 1)

    def stack_frames(self, cur: Tensor, factor: int) -> Tensor:  # build_stack
        if factor <= 1:
            return cur
        total = cur.ne[0] * cur.ne[1] * cur.ne[2] * cur.ne[3]
        stride = self.n_embd * factor
        padded = ggml_pad(total, stride)
        if padded > total:
            cur = view(cur, "VIEW", (total,))
            cur = new((padded,), "PAD", (cur,), cur.type)
        return _view_2d(cur, stride, padded // stride)

    def build(self, n_frames: int) -> Graph:
        e = self.n_embd
        inp = leaf((n_frames, self.n_mel, 1, 1), F32, "inp_raw", input=True)

        cur = self.conv_1d_ph(inp, self.n_mel, e, 1)
        cur = dup(cur, "ADD", self.w((1, e)))  # a.conv1d.1.bias
        cur = dup(cur, "UNARY")  # gelu_erf
        cur = self.conv_1d_ph(cur, e, e, 2)
        cur = dup(cur, "ADD", self.w((1, e)))
        cur = dup(cur, "UNARY")
        n_pos = cur.ne[0]
        inp = dup(transpose(cur), "CONT")  # [n_embd, n_pos]

        # build_vit: learned positions (a view of Whisper's table), erf-GELU blocks, the pool, a.post_ln
        pos_table = self.w((e, WHISPER_POSITIONS), F32, "a.position_embd.weight")
        cur = self.vit(inp, n_pos, self.n_layer, learned_pos=_view_2d(pos_table, e, n_pos), post_ln=True,
                       avgpool=self.type in AVGPOOL_TYPES)  # fmt: skip

        if self.type in STACKED_TYPES:
            cur = self.stack_frames(cur, self.stack)
        width, h, t = cur.ne[0], self.hidden, self.text
        if self.type == "ultravox":
            cur = self.norm(cur, width, rms=True, bias=False)  # mm.a.norm_pre
            cur = self.linear(cur, width, h, bias=False)  # mm.a.mlp.1
            cur = new((h // 2, *cur.ne[1:]), "GLU", (cur,))  # ggml_swiglu_swapped
            cur = self.norm(cur, h // 2, rms=True, bias=False)  # mm.a.norm_mid
            cur = self.linear(cur, h // 2, t, bias=False)  # mm.a.mlp.2
        elif self.type == "qwen2a":
            cur = self.linear(cur, width, t)  # mm.a.fc
        elif self.type in ("voxtral", "musicflamingo"):  # build_ffn: mm.a.mlp.1, erf GELU, mm.a.mlp.2
            cur = self.ffn(cur, width, h, t, bias=self.type == "musicflamingo")
        elif self.type == "meralion":
            cur = self.norm(cur, width)  # mm.a.norm_pre
            cur = dup(self.linear(cur, width, h), "UNARY")  # mm.a.mlp.0, SiLU
            gate = dup(self.linear(cur, h, h), "UNARY")  # mm.a.mlp.1, SiLU
            pool = self.linear(cur, h, h)  # mm.a.mlp.2
            cur = self.linear(dup(gate, "MUL", pool), h, t)  # mm.a.mlp.3
        else:  # glma
            cur = self.norm(cur, e)  # mm.a.norm_pre
            cur = self.stack_frames(cur, self.stack)
            cur = self.ffn(cur, cur.ne[0], h, t)  # mm.a.mlp.1 + bias, erf GELU, mm.a.mlp.2 + bias
            boi, eoi = self.vec(t, "v.boi"), self.vec(t, "v.eoi")
            cur = new((t, cur.ne[1] + 1), "CONCAT", (boi, cur))
            cur = new((t, cur.ne[1] + 1), "CONCAT", (cur, eoi))
        return self.gf.expand(cur)
