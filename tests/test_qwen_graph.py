"""Qwen2-VL's family of projectors (clip types `qwen2vl_merger`, `qwen2.5vl_merger`, `qwen3vl_merger`): the compute
buffer shared/memory/qwen_graph.py predicts by replaying ggml-alloc on clip's graph (shared/memory/graph_alloc.py),
against the real b11434 binaries: every qwen figure in tests/llama_figures.json (the warm-up's CPU buffer printed in
MiB to 2 decimals) and a table of device buffers measured to the byte (MEASURED), then which image a lane with
--image-max-tokens takes needs the largest buffer."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from shared.memory.graph_alloc import replay
from shared.memory.symbolic_sweep import Poly, Region, largest_by_regions
from shared.memory.qwen_graph import (
    _largest,
    build_graph,
    image_grid,
    largest_image,
    qwen_compute_bytes,
    qwen_planned_bytes,
    strip_tokens,
    warmup_grid,
)

MIB = 2**20
TABLE = {k: v for k, v in json.loads((Path(__file__).parent / "llama_figures.json").read_text()).items()
         if "type=qwen" in k and "type=qwen2a" not in k}  # fmt: skip

# Measured with tests/record_projector_figures.py measure_largest (the b11434 RPC server, --image-min-tokens and
# --image-max-tokens both `tokens`, one image; Qwen3-VL's text model n_embd times 1 + its deepstack mergers, which
# mtmd checks): type, n_embd, n_ff, n_head, n_layer, patch, flash attention, text_embd, tokens, the image (px), the
# patch grid it was encoded at (and its tokens, as the server decoded them), the device's buffer after the warm-up
# (the warm-up grid: 46 x 46 tokens, or isqrt(tokens)^2) and after the image (bytes): the warm-up's when no larger.
MEASURED = [
    ("qwen2vl_merger", 64, 128, 2, 2, 14, True, 256, 2116, (1288, 1288), (92, 92), 32163200, 32163200),
    ("qwen2vl_merger", 64, 128, 2, 2, 14, True, 256, 2000, (1120, 1400), (80, 100), 29427200, 30400000),
    ("qwen2vl_merger", 128, 512, 4, 3, 14, False, 1024, 2000, (28, 56000), (2, 4000), 981815296, 1047040000),
    ("qwen2vl_merger", 64, 128, 2, 2, 14, True, 256, 2116, (59524, 23), (4680, 2), 32163200, 35568000),
    ("qwen2.5vl_merger", 64, 128, 2, 4, 14, True, 256, 2000, (1120, 1400), (80, 100), 378170496, 402960000),
    ("qwen2.5vl_merger", 128, 512, 2, 4, 14, False, 256, 2000, (1400, 1120), (100, 80), 741952640, 791056000),
    ("qwen2.5vl_merger", 256, 1024, 4, 4, 14, True, 2048, 2116, (644, 2576), (46, 184), 467229760, 467229760),
    ("qwen2.5vl_merger", 64, 128, 2, 4, 14, True, 256, 2116, (23, 59524), (2, 4680), 449895488, 547840832),
    ("qwen2.5vl_merger", 96, 192, 2, 5, 14, False, 384, 1000, (700, 1120), (50, 80), 186426368, 201480000),
    ("qwen2.5vl_merger", 1280, 3420, 16, 4, 14, True, 3584, 2000, (1120, 1400), (80, 100), 642705536, 676240000),
    ("qwen3vl_merger", 64, 128, 2, 4, 16, True, 2048, 2000, (1280, 1600), (80, 100), 132825088, 137216000),
    ("qwen3vl_merger", 128, 512, 2, 5, 16, False, 4096, 2000, (64000, 32), (4000, 2), 511599616, 544896000),
    ("qwen3vl_merger", 64, 128, 2, 4, 16, True, 256, 576, (768, 768), (48, 48), 11243520, 11243520),
    ("qwen3vl_merger", 256, 1024, 4, 5, 16, True, 4096, 2116, (736, 2944), (46, 184), 312016896, 312016896),
]


def _args(key: str) -> dict:
    """A llama_figures.json key -> qwen_compute_bytes's arguments but grid (flash attention as clip settled it)."""
    parts = dict(p.split("=") for p in key.split("|")[1:])
    return dict(proj_type=parts["type"], n_embd=int(parts["n_embd"]), n_ff=int(parts["n_ff"]),
                n_head=int(parts["n_head"]), n_layer=int(parts["n_layer"]), patch_size=int(parts["patch"]),
                text_embd=int(parts["text_embd"]), flash_attn=TABLE[key]["clip_flash_attn"] == "enabled")  # fmt: skip


def _mib(n: int) -> float:
    return round(n / MIB, 2)


def _row_args(row) -> dict:
    proj_type, n_embd, n_ff, n_head, n_layer, patch, fa, text = row[:8]
    return dict(proj_type=proj_type, n_embd=n_embd, n_ff=n_ff, n_head=n_head, n_layer=n_layer, patch_size=patch,
                text_embd=text, flash_attn=fa)  # fmt: skip


def test_every_type_is_recorded():
    assert {_args(k)["proj_type"] for k in TABLE} == {"qwen2vl_merger", "qwen2.5vl_merger", "qwen3vl_merger"}
    assert len(TABLE) >= 20


@pytest.mark.parametrize("key", sorted(TABLE))
def test_warm_up_buffer_prints_as_recorded(key):
    """--no-mmproj-offload: the CPU buffer for the warm-up image, 46 x 46 merged tokens whatever the file's image size
    (clip.cpp set_warmup_n_tokens), with the file's defaults as tests/tinyprojectors.py writes them (Qwen2.5-VL's
    n_wa_pattern 4, Qwen3-VL's deepstack mergers at blocks 1..3 but the last two)."""
    args = _args(key)
    assert warmup_grid(args["patch_size"], 2116) == (92, 92)
    assert _mib(qwen_compute_bytes(grid=(92, 92), **args)) == TABLE[key]["compute_mib"]["CPU"]


@pytest.mark.parametrize("row", MEASURED, ids=lambda r: "-".join(map(str, r[:10])))
def test_measured_device_buffers_are_exact(row):
    """On an RPC device: the warm-up's buffer, then the largest of it and the image's, to the byte; the image's grid
    as mtmd resizes it."""
    tokens, (width, height), grid, warm_want, largest_want = row[8:]
    args = _row_args(row)
    assert image_grid(width, height, args["patch_size"], image_max_tokens=tokens, image_min_tokens=tokens) == grid
    warm = qwen_compute_bytes(grid=warmup_grid(args["patch_size"], tokens), offload=True, **args)
    image = qwen_compute_bytes(grid=grid, offload=True, **args)
    assert warm == warm_want
    assert max(warm, image) == largest_want


@pytest.mark.parametrize("key", sorted(TABLE))
def test_the_shape_and_the_buffer_do_not_matter(key):
    """Only the merged tokens enter the sizes: every grid of 2,116 tokens needs the warm-up's buffer, and the CPU's
    graph (inputs as leafs) and the device's (the scheduler's copies of the host inputs first) need the same."""
    args = _args(key)
    sizes = {qwen_compute_bytes(grid=g, offload=dev, **args)
             for g in [(92, 92), (46, 184), (184, 46), (2, 4232), (4232, 2), (8, 1058)] for dev in (False, True)}  # fmt: skip
    assert len(sizes) == 1


@pytest.mark.parametrize("key", sorted(TABLE))
def test_no_image_within_the_limit_needs_more_than_the_warm_up(key):
    """--image-max-tokens 2116: over every token count up to the limit the largest buffer is the warm-up's (46 x 46,
    the limit itself), though not monotone on the way (with window attention). Strips escape it: an image more than
    2,116 times longer than wide keeps one token across and up to 2,340 along at 14-pixel patches (measured:
    59,524 x 23 px), a buffer beyond the warm-up's; at 16-pixel patches strips stop at 2,048."""
    args = _args(key)
    warm = qwen_compute_bytes(grid=(92, 92), **args)
    assert largest_image(strips=False, **args) == ((92, 92), warm)
    grid, planned = largest_image(**args)
    if args["patch_size"] == 14:
        assert strip_tokens(14) == 2340 and grid == (2, 4680) and planned > warm
    else:
        assert strip_tokens(16) == 2048 and (grid, planned) == ((92, 92), warm)
    assert qwen_planned_bytes(**args) == planned


def test_more_tokens_can_need_less():
    """Window attention and flash attention: the f16 mask copies (quadratic in the tokens) overtake the merger's
    activations at some counts, and the freed blocks move: 127 tokens need 437,088 bytes more than 128, 767 12 MB
    more than 768."""
    args = dict(proj_type="qwen2.5vl_merger", n_embd=256, n_ff=1024, n_head=4, n_layer=4, patch_size=14,
                text_embd=2048, flash_attn=True)  # fmt: skip
    assert qwen_compute_bytes(grid=(2, 254), **args) - qwen_compute_bytes(grid=(2, 256), **args) == 437088
    assert qwen_compute_bytes(grid=(2, 1534), **args) - qwen_compute_bytes(grid=(2, 1536), **args) == 12401504


@pytest.mark.parametrize("args", [
    dict(proj_type="qwen2.5vl_merger", n_embd=256, n_ff=1024, n_head=4, n_layer=4, patch_size=14, text_embd=2048,
         flash_attn=True),
    dict(proj_type="qwen2.5vl_merger", n_embd=128, n_ff=512, n_head=2, n_layer=4, patch_size=14, text_embd=256,
         flash_attn=False),
    dict(proj_type="qwen2vl_merger", n_embd=64, n_ff=128, n_head=2, n_layer=2, patch_size=14, text_embd=256,
         flash_attn=False),
    dict(proj_type="qwen3vl_merger", n_embd=64, n_ff=128, n_head=2, n_layer=4, patch_size=16, text_embd=256,
         flash_attn=False),
], ids=["2.5-fa", "2.5", "2", "3"])  # fmt: skip
def test_regions_find_the_largest_of_every_count(args):
    """The interval walk (one symbolic replay per interval of token counts where the allocator decides alike)
    gives the same largest buffer as replaying every count."""
    full = dict(args, n_wa_pattern=4 if args["proj_type"] == "qwen2.5vl_merger" else 0,
                deepstack=(1, 2) if args["proj_type"] == "qwen3vl_merger" else ())  # fmt: skip
    for limit in (57, 300):
        got = largest_by_regions(lambda n: build_graph(grid=(2, 2 * n), **full), lambda g: replay(g).size, limit)
        brute = max((qwen_compute_bytes(grid=(2, 2 * n), **args), n) for n in range(1, limit + 1))
        assert got == (brute[1], brute[0])


def test_a_symbolic_replay_holds_over_its_interval():
    """Sizes as polynomials in k (tokens n = 8 k + r): the buffer's polynomial is the replayed buffer at every k of
    the interval the comparisons allowed."""
    args = dict(proj_type="qwen2.5vl_merger", n_embd=64, n_ff=128, n_head=2, n_layer=4, patch_size=14, text_embd=256,
                flash_attn=True, n_wa_pattern=4)  # fmt: skip
    region = Region(200, 0, 264)
    size = replay(build_graph(grid=(2, 2 * Poly(3, 8, 0, region)), **args)).size
    assert region.lo < 200 <= region.hi
    for k in (region.lo, (region.lo + region.hi) // 2, region.hi):
        want = replay(build_graph(grid=(2, 2 * (8 * k + 3)), **args)).size
        assert size.a + k * (size.b + k * size.c) == want


def test_images_resize_as_mtmd_does():
    """mtmd-image.cpp calc_size_preserved_ratio with --image-max-tokens 2116 alone (a lane's): sides rounded to
    28 px, scaled down into 2,116 tokens, up to 8; a strip beyond 2,116:1 escapes the limit, one over 65,536 px
    is refused (measured: 4 x 20,000 px with --image-min-tokens 2116 too)."""
    assert image_grid(1288, 1288, 14, image_max_tokens=2116) == (92, 92)
    assert image_grid(4000, 3000, 14, image_max_tokens=2116) == (106, 78)  # 53 x 39 = 2,067 tokens
    assert image_grid(64, 64, 14, image_max_tokens=2116) == (6, 6)  # 9 tokens, above the 8
    assert image_grid(10, 10, 14, image_max_tokens=2116) == (6, 6)  # up to 8 tokens: 3 x 3
    assert image_grid(59524, 23, 14, image_max_tokens=2116) == (4680, 2)  # 2,340 tokens
    assert image_grid(65536, 16, 16, image_max_tokens=2116) == (4096, 2)  # 2,048 at 16 px, the most
    for px, patch, tokens in [((4, 20000), 14, 2116), ((70000, 20), 16, 0)]:
        with pytest.raises(ValueError, match="out of range"):
            image_grid(*px, patch, image_max_tokens=tokens or 2116, image_min_tokens=tokens)
    assert warmup_grid(14, 2000) == (88, 88) and warmup_grid(16, 576) == (48, 48) and warmup_grid(14, 0) == (92, 92)


def test_qwen3_at_its_position_tables_grid_skips_the_resize():
    """48 x 48 patches (576 tokens): the learned positions are read as they are (no ggml_interpolate), measured as
    the same buffer as any other 576-token image at these widths."""
    args = dict(proj_type="qwen3vl_merger", n_embd=64, n_ff=128, n_head=2, n_layer=4, patch_size=16, text_embd=256,
                flash_attn=True)  # fmt: skip
    a = build_graph(grid=(48, 48), deepstack=(1, 2), **args)
    b = build_graph(grid=(24, 96), deepstack=(1, 2), **args)
    assert "UPSCALE" not in {t.op for t in a.nodes} and "UPSCALE" in {t.op for t in b.nodes}
    assert qwen_compute_bytes(grid=(48, 48), **args) == qwen_compute_bytes(grid=(24, 96), **args) == 11243520


def test_file_facts_change_the_buffer():
    """What the file says beyond the widths: the window pattern (n_wa_pattern: which blocks read the mask; Qwen2-VL's
    graph reads it too, Qwen3-VL's not) and 3-VL's deepstack blocks (their outputs stay live until the end)."""
    base = dict(n_embd=64, n_ff=128, n_head=2, n_layer=4, patch_size=14, text_embd=256, flash_attn=True,
                grid=(92, 92))  # fmt: skip
    w4 = qwen_compute_bytes(proj_type="qwen2.5vl_merger", n_wa_pattern=4, **base)
    w1 = qwen_compute_bytes(proj_type="qwen2.5vl_merger", n_wa_pattern=1, **base)  # every block full: no mask read
    none = qwen_compute_bytes(proj_type="qwen2.5vl_merger", n_wa_pattern=0, **base)
    assert w4 == qwen_compute_bytes(proj_type="qwen2.5vl_merger", **base) and none < w1 < w4
    assert qwen_compute_bytes(proj_type="qwen2vl_merger", n_wa_pattern=4, **base) > qwen_compute_bytes(
        proj_type="qwen2vl_merger", **base)
    q3 = dict(base, patch_size=16, text_embd=2048)
    assert qwen_compute_bytes(proj_type="qwen3vl_merger", n_wa_pattern=4, **q3) == qwen_compute_bytes(
        proj_type="qwen3vl_merger", **q3)
    ds = [qwen_compute_bytes(proj_type="qwen3vl_merger", deepstack=d, **q3) for d in ((), (1,), (1, 2), (0, 1, 2))]
    assert ds == sorted(ds) and len(set(ds)) == 4
    with pytest.raises(ValueError):
        qwen_compute_bytes(proj_type="qwen2vl_merger", **{**base, "grid": (91, 92)})
    with pytest.raises(ValueError):
        qwen_compute_bytes(proj_type="qwen2vl_merger", **{**base, "n_head": 3})
    with pytest.raises(ValueError):
        qwen_compute_bytes(proj_type="mlp", **base)


def test_a_call_is_fast_and_cached():
    """Qwen2.5-VL-7B's widths (full attention every 8th block; 8 of its 32 blocks, which need the same buffer): the
    warm-up graph in milliseconds; the plan (every count to 2,340 tokens) in about a second once (32 blocks: about
    5 s on 2 cores), then cached. Strips of 2,340 tokens need 17% more than the warm-up."""
    args = dict(proj_type="qwen2.5vl_merger", n_embd=1280, n_ff=3420, n_head=16, n_layer=8, patch_size=14,
                text_embd=3584, flash_attn=True, n_wa_pattern=8)  # fmt: skip
    start = time.perf_counter()
    warm = qwen_compute_bytes(grid=(92, 92), **args)
    assert time.perf_counter() - start < 0.5
    _largest.cache_clear()
    start = time.perf_counter()
    grid, planned = largest_image(**args)
    first = time.perf_counter() - start
    start = time.perf_counter()
    assert largest_image(**args) == (grid, planned)
    assert time.perf_counter() - start < 0.01 and first < 15
    assert warm == qwen_compute_bytes(grid=(92, 92), **{**args, "n_layer": 32}) == 739025728
    assert (grid, planned) == ((2, 4680), 867578432)


@pytest.mark.slow
def test_real_binary_matches_a_new_shape(tmp_path, rpc_bin):
    """A shape in neither table (odd widths, 5 blocks with the 4th full, no flash attention) through the real
    llama-server on an RPC device: the warm-up at 31 x 31 tokens, then a 25 x 40 token image."""
    from record_projector_figures import measure_largest, projector_for

    shape = ("qwen2.5vl_merger", 96, 192, 2, 5, 560, 14, 2, "off", 384)
    model, mmproj = projector_for(tmp_path, shape)
    fig = measure_largest(rpc_bin, model, mmproj, "off", 1000, (700, 1120))
    assert "error" not in fig, fig
    args = dict(proj_type="qwen2.5vl_merger", n_embd=96, n_ff=192, n_head=2, n_layer=5, patch_size=14, text_embd=384,
                flash_attn=False, offload=True)  # fmt: skip
    grid = image_grid(700, 1120, 14, image_max_tokens=1000, image_min_tokens=1000)
    assert grid == (50, 80) and fig["image_batch_tokens"] == 1000
    warm = qwen_compute_bytes(grid=warmup_grid(14, 1000), **args)
    assert fig["warmup_bytes"] == warm and _mib(warm) == fig["warmup_compute_mib"]["RPC0"]
    assert fig["largest_bytes"] == max(warm, qwen_compute_bytes(grid=grid, **args))
