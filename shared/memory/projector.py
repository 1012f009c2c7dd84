"""The multimodal projector's memory (--mmproj), on the device where llama-server puts it. Pure.

tools/mtmd/clip.cpp (b11434): the projector's tensors go into one buffer of its backend
(each padded to the buffer's alignment, as the model's are). Its compute buffer is ggml-alloc's
high-water mark over clip's graph: reserved for a warm-up image, and grown by the scheduler when a
larger image needs more. Each type's graph is rebuilt and the allocator replayed over it
(shared/memory/graph_alloc.py and one module per family), for the warm-up image where the type
resizes every image to it, and for the largest image the lane accepts where images keep their
size (Qwen2-VL's family, Pixtral, MiniCPM-V). The backend is the lane's first device with
--mmproj-offload (common/arg.cpp: -mmdev defaults to the first --device), host RAM with
--no-mmproj-offload. A projector on a device also reserves a host compute buffer for the
graph's input, the image (f32 RGB) or the audio's mel frames: measured with RPC devices.
"""

from __future__ import annotations

import math

from shared.memory.llama4_graph import llama4_compute_bytes
from shared.memory.llava_graph import llava_compute_bytes
from shared.memory.pixtral_graph import pixtral_planned_bytes
from shared.memory.placement import CPU, Placement
from shared.memory.qwen_graph import POS_TABLE_SIDE, qwen_planned_bytes
from shared.memory.resampler_graph import resampler_compute_bytes
from shared.memory.siglip_graph import SIGLIP_TYPES, siglip_compute_bytes
from shared.memory.whisper_graph import AUDIO_TYPES, WHISPER_FRAMES, whisper_compute_bytes
from shared.messages.hosts import ProjectorFacts

PINNED = frozenset({"cuda", "rocm"})
F32 = 4


def projector_device(placement: Placement, offload: bool, device: int = 0) -> int:
    """CPU (-1), or the GPU-type device -mmdev names (the lane's first by default)."""
    return min(device, placement.n_devices - 1) if offload and placement.n_devices > 0 else CPU


def projector_compute_bytes(proj: ProjectorFacts, flash_attn: bool, image_max_tokens: int = 0) -> int:
    """The compute buffer clip reserves for its warm-up image, or grows to at the largest image the lane
    takes. ggml-alloc packs each graph best-fit among freed blocks, so no closed form follows it: every
    type's graph is rebuilt from clip.cpp at the file's widths and the allocator replayed over it
    (shared/memory/*_graph.py over graph_alloc.py), exact to the byte against the real binary; Gemma
    3n's from the file's own tensors, by the agent (ProjectorFacts.graph_compute_bytes). A type no
    module rebuilds is planned as a SigLIP encoder with Gemma 3's head at the file's image size (not
    measured). image_max_tokens: the lane's --image-max-tokens (0: the one image_tokens_cap renders)."""
    kind = proj.projector_type
    if kind in GRAPH_TYPES:
        return graph_bytes(proj, flash_attn)
    if kind in QWEN_TYPES:
        return qwen_bytes(proj, flash_attn)
    if kind in DYNAMIC_MAX_TOKENS:
        return pixtral_bytes(proj, flash_attn, largest_image_tokens(proj, image_max_tokens) or 0)
    if kind in WHISPER_TYPES:
        return whisper_bytes(proj, flash_attn)
    if kind in RESAMPLER_TYPES:
        return resampler_buffer(proj, flash_attn)
    if kind in GRAPH_REPLAYED:  # every image resized to the warm-up's: its buffer is every one's
        return proj.graph_compute_bytes
    return siglip_bytes(proj, flash_attn)


def siglip_bytes(proj: ProjectorFacts, flash_attn: bool) -> int:
    """Gemma 3's, SmolVLM's (idefics3) and InternVL's warm-up buffer, their graphs replayed (shared/memory/
    siglip_graph.py); any other type as Gemma 3's. 0 for widths clip's graph cannot build."""
    kind = proj.projector_type if proj.projector_type in SIGLIP_TYPES else "gemma3"
    try:
        return siglip_compute_bytes(
            proj_type=kind, n_embd=proj.n_embd, n_ff=proj.n_ff, n_head=proj.n_head, n_layer=proj.n_layer,
            image_size=proj.image_size, patch_size=proj.patch_size, merge=proj.n_merge or _DEFAULT_MERGE[kind],
            text_embd=proj.n_mmproj_embd, flash_attn=flash_attn,
        )  # fmt: skip
    except ValueError:
        return 0


_DEFAULT_MERGE = {"gemma3": 4, "idefics3": 1, "internvl": 1}  # clip.cpp load_hparams without scale_factor


QWEN_TYPES = frozenset({"qwen2vl_merger", "qwen2.5vl_merger", "qwen3vl_merger"})
QWEN_WARMUP_TOKENS = 46  # clip.cpp: set_warmup_n_tokens(46*46), whatever the file's image size


# Projectors that take images of any size up to a number of tokens, and warm up on a smaller one (clip.cpp
# load_hparams: set_limit_image_tokens(8, 1024), set_warmup_n_tokens(256)): the buffer grows at the first
# larger image, so the plan holds the largest, and the lane renders that limit.
DYNAMIC_MAX_TOKENS = {"pixtral": 1024}


def image_tokens_cap(proj: ProjectorFacts) -> int | None:
    """The --image-max-tokens a lane renders: Qwen2-VL's family at its warm-up image (a larger one would
    grow its buffer past the plan), Pixtral at the largest its build takes (the plan holds that one);
    None where the warm-up is already the largest."""
    if proj.projector_type in QWEN_TYPES:
        return QWEN_WARMUP_TOKENS**2
    return DYNAMIC_MAX_TOKENS.get(proj.projector_type)


def image_aspect_cap(proj: ProjectorFacts, image_max_tokens: int = 0) -> int | None:
    """The longest image, long side over short, that the plan holds where llama.cpp bounds none and a
    longer one grows the buffer past it (the gateway refuses longer ones): MiniCPM-V's slices up to
    RESAMPLER_MAX_ASPECT; Pixtral's one token wide at its largest image (a strip of N tokens is N:1,
    and llama.cpp keeps one patch across whatever the strip's length); Qwen2-VL's family likewise at its
    --image-max-tokens. None: any."""
    if proj.projector_type in RESAMPLER_TYPES:
        return RESAMPLER_MAX_ASPECT
    if proj.projector_type in QWEN_TYPES:  # one token across past image_max_tokens:1, more tokens than the cap
        return image_max_tokens or QWEN_WARMUP_TOKENS**2
    return largest_image_tokens(proj, image_max_tokens)


def largest_image_tokens(proj: ProjectorFacts, image_max_tokens: int = 0) -> int | None:
    """The tokens of the largest image a dynamic-size projector takes: --image-max-tokens where given,
    else its build's own limit."""
    default = DYNAMIC_MAX_TOKENS.get(proj.projector_type)
    return (image_max_tokens or default) if default else None


def qwen_warmup_side(proj: ProjectorFacts) -> int:
    """The warm-up image's side in pixels: 46 x 46 merged tokens of 2 x 2 patches each."""
    return QWEN_WARMUP_TOKENS * proj.patch_size * (proj.n_merge or 2)


def qwen_bytes(proj: ProjectorFacts, flash_attn: bool) -> int:
    """Qwen2-VL's family, its graph replayed (shared/memory/qwen_graph.py): the largest buffer over every
    image the lane takes at --image-max-tokens 2116 (the buffer follows an image's merged tokens alone,
    not monotone in them; on every shape measured the largest is the warm-up's 46 x 46). Images more
    than 2,116 times longer than wide would escape the limit (llama.cpp keeps one token across): the
    gateway refuses those (image_aspect_cap), so the plan leaves them out. 0 for widths clip's graph
    cannot build."""
    try:
        return qwen_planned_bytes(
            proj_type=proj.projector_type, n_embd=proj.n_embd, n_ff=proj.n_ff, n_head=proj.n_head,
            n_layer=proj.n_layer, patch_size=proj.patch_size, text_embd=proj.n_mmproj_embd, flash_attn=flash_attn,
            image_max_tokens=QWEN_WARMUP_TOKENS**2, strips=False, n_wa_pattern=proj.n_wa_pattern or None,
            deepstack=(proj.deepstack or None) if proj.projector_type == "qwen3vl_merger" else None,
            pos_side=proj.pos_side or POS_TABLE_SIDE, kernel_bf16=proj.kernel_bf16,
        )  # fmt: skip
    except ValueError:
        return 0


def pixtral_bytes(proj: ProjectorFacts, flash_attn: bool, max_tokens: int) -> int:
    """Pixtral's buffer once its lane has taken the largest image it accepts at --image-max-tokens N, its
    graph replayed (shared/memory/pixtral_graph.py): the image one token wide and N tall, whose [IMG_BREAK]
    rows are most, or the few grids ggml-alloc's packing makes need slightly more; 0 for widths clip's
    graph cannot build."""
    try:
        return pixtral_planned_bytes(
            n_embd=proj.n_embd, n_ff=proj.n_ff, n_head=proj.n_head, n_layer=proj.n_layer, patch_size=proj.patch_size,
            merge=proj.n_merge or 1, text_embd=proj.n_mmproj_embd, flash_attn=flash_attn, max_tokens=max_tokens,
        )  # fmt: skip
    except ValueError:
        return 0


# Audio projectors on Whisper's encoder (tools/mtmd/models/whisper-enc.cpp), each with its own head
WHISPER_TYPES = AUDIO_TYPES


def whisper_bytes(proj: ProjectorFacts, flash_attn: bool) -> int:
    """One 30 s chunk through Whisper's encoder and the type's head (a frame stack, an MLP), the graph
    replayed (shared/memory/whisper_graph.py: exact on 42 shapes of six types and Qwen2-Audio's printed
    figures); 0 where a fact the head needs is missing (an older agent's facts) or clip cannot build it."""
    try:
        return whisper_compute_bytes(
            proj_type=proj.projector_type, n_embd=proj.n_embd, n_ff=proj.n_ff, n_head=proj.n_head,
            n_layer=proj.n_layer, n_mel=proj.n_mel_bins, text_embd=proj.n_mmproj_embd, flash_attn=flash_attn,
            stack_factor=proj.stack_factor, proj_hidden=proj.proj_hidden,
        )  # fmt: skip
    except ValueError:
        return 0


# Types whose buffer the planner replays from clip.cpp's graph at the file's widths (ggml-alloc over the
# graph's tensors, shared/memory/graph_alloc.py): LLaVA's (llava_graph.py) and Llama 4's (llama4_graph.py),
# one image of the file's image size a side, which every image is resized or tiled to
GRAPH_TYPES = frozenset({"mlp", "llama4"})


def graph_bytes(proj: ProjectorFacts, flash_attn: bool) -> int:
    """The replayed warm-up buffer of a GRAPH_TYPES projector; 0 for widths clip's graph cannot build
    (llama.cpp fails to start such a lane)."""
    widths = dict(n_embd=proj.n_embd, n_ff=proj.n_ff, n_head=proj.n_head, n_layer=proj.n_layer,
                  image_size=proj.image_size, patch_size=proj.patch_size, text_embd=proj.n_mmproj_embd,
                  flash_attn=flash_attn, post_ln=proj.post_ln)  # fmt: skip
    try:
        if proj.projector_type == "llama4":
            return llama4_compute_bytes(**widths, merge=proj.n_merge or 2, pre_ln=proj.pre_ln)
        return llava_compute_bytes(**widths)
    except ValueError:
        return 0


# Types whose buffer the agent replays from the file's own graph when it reads the file (ggml-alloc over
# clip.cpp's graph, shared/memory/mobilenet.py): ProjectorFacts.graph_compute_bytes
GRAPH_REPLAYED = frozenset({"gemma3nv"})
# MiniCPM-V (clip.projector_type "resampler"; tools/mtmd/models/minicpmv.cpp): llava-uhd slices
RESAMPLER_TYPES = frozenset({"resampler"})
# The image aspect the plan holds, long side over short. mtmd-image.cpp's llava-uhd slicing scales the
# overview and each of up to 9 slices to about image_size^2 pixels at the piece's own aspect, each side
# rounded to the patch (get_best_resize, ensure_divide): the rounding adds up to half a patch row and
# column, more the longer the piece. Nothing in llama.cpp bounds the aspect: docs/known-limits.md.
RESAMPLER_MAX_ASPECT = 20
RESAMPLER_MAX_QUERIES = 96  # clip.minicpmv_query_num: 64 from MiniCPM-V 2.6 on, 96 before (an old agent's 0)
RESAMPLER_WINDOW = 32


def resampler_largest_patches(proj: ProjectorFacts) -> int:
    """The patches of the largest piece (overview or slice) of an image of at most RESAMPLER_MAX_ASPECT:
    side^2 patches at the piece's aspect a, each side rounded up to half a patch, so at most
    side^2 + side / 2 (sqrt(a) + 1 / sqrt(a)) + 1/4 (1,100 at 448 pixels and 14-pixel patches; the warm-up's
    448 x 448 is 1,024; an image of 105 x 1,911 pixels gives a slice of 1,096)."""
    side = proj.image_size // proj.patch_size if proj.patch_size else 0
    root = RESAMPLER_MAX_ASPECT**0.5
    return math.ceil(side * side + side / 2 * (root + 1 / root) + 0.25)


def resampler_piece_bytes(proj: ProjectorFacts, flash_attn: bool, n_pos: int) -> int:
    """The buffer for one piece of n_pos patches, replayed from MiniCPM-V's graph (exact: shared/memory/
    resampler_graph.py); 0 for widths llama.cpp's graph cannot build (it fails to start the lane)."""
    try:
        return resampler_compute_bytes(
            n_embd=proj.n_embd, n_ff=proj.n_ff, n_head=proj.n_head, n_layer=proj.n_layer, n_pos=n_pos,
            patch_size=proj.patch_size, text_embd=proj.n_mmproj_embd, queries=proj.n_queries or RESAMPLER_MAX_QUERIES,
            flash_attn=flash_attn,
        )  # fmt: skip
    except ValueError:
        return 0


def resampler_buffer(proj: ProjectorFacts, flash_attn: bool) -> int:
    """The buffer after the largest piece the plan holds (or the warm-up's, if larger: the buffer only
    grows). ggml-alloc's packing makes it not quite monotone
    in the patches (a few hundred KiB down for a few more patches, then up again), so the largest over
    the last RESAMPLER_WINDOW piece sizes up to the largest: on every shape tried the largest of all
    smaller pieces lies there (tests/test_projector_memory.py)."""
    largest, warmup = resampler_largest_patches(proj), (proj.image_size // max(proj.patch_size, 1)) ** 2
    pieces = (warmup, *range(max(largest - RESAMPLER_WINDOW, 1), largest + 1))
    return max(resampler_piece_bytes(proj, flash_attn, n) for n in pieces)


def mel_bytes(proj: ProjectorFacts) -> int:
    """An audio chunk's mel spectrogram (f32), the encoder's input."""
    return proj.n_mel_bins * WHISPER_FRAMES * F32


def projector_bytes(
    proj: ProjectorFacts | None, placement: Placement, offload: bool, flash_attn: bool, image_max_tokens: int = 0,
    device: int = 0,
) -> list[int]:
    """Weights and compute per device (host RAM at index 0, as the other buffers); image_max_tokens: the
    lane's --image-max-tokens, 0 for the one image_tokens_cap renders; device: -mmdev's GPU-type device."""
    out = [0] * (1 + placement.n_devices)
    if proj is None:
        return out
    dev = projector_device(placement, offload, device)
    pinned = dev != CPU and placement.backend(dev) in PINNED
    compute = projector_compute_bytes(proj, flash_attn, image_max_tokens)
    out[1 + dev] += (proj.weight_cuda_bytes if pinned else proj.weight_bytes) + compute
    if dev != CPU:  # the graph's inputs stay in host memory
        out[0] += host_inputs(proj, image_max_tokens)
    return out


def host_inputs(proj: ProjectorFacts, image_max_tokens: int = 0) -> int:
    """The warm-up graph's inputs, in host memory when the projector is on a device: the image
    (f32 RGB), for LLaVA its positions and the patch rows it keeps (i32 each), for Qwen's family
    the warm-up image and its positions, for Pixtral the largest image and its positions."""
    if proj.projector_type in WHISPER_TYPES:
        return mel_bytes(proj)
    if (tokens := largest_image_tokens(proj, image_max_tokens)) is not None:
        n_pos = tokens * (proj.n_merge or 1) ** 2
        return n_pos * (proj.patch_size**2 * 3 * F32 + 2 * 4)
    if proj.projector_type in RESAMPLER_TYPES:  # the largest piece and its three position inputs
        n_pos = resampler_largest_patches(proj)
        return n_pos * (proj.patch_size**2 * 3 * F32 + 3 * 4)
    if proj.projector_type in QWEN_TYPES:  # and its M-RoPE positions, 4 x i32 a patch
        side = qwen_warmup_side(proj)
        return side * side * 3 * F32 + (side // proj.patch_size) ** 2 * 4 * 4
    image = proj.image_size * proj.image_size * 3 * F32
    if proj.projector_type != "mlp" or not proj.patch_size:
        return image
    patches = (proj.image_size // proj.patch_size) ** 2
    return image + (2 * patches + 1) * 4
