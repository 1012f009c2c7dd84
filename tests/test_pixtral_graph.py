"""Pixtral's projector (clip type `pixtral`): the device compute buffer shared/memory/pixtral_graph.py predicts by
replaying ggml-alloc on clip's graph (shared/memory/graph_alloc.py), against the real b11434 binaries: every pixtral
figure in tests/llama_figures.json (the RPC device's exact bytes after one image scaled to N tokens, and the
warm-up's printed MiB), and a table of more device figures measured the same way (MEASURED)."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from shared.memory.graph_alloc import replay
from shared.memory.pixtral_graph import (
    _bytes,
    _planned,
    build_graph,
    pixtral_compute_bytes,
    pixtral_grid,
    pixtral_largest_bytes,
    pixtral_planned_bytes,
    pixtral_planned_grids,
    pixtral_warmup_grid,
)

MIB = 2**20
FIGURES = json.loads((Path(__file__).parent / "llama_figures.json").read_text())
TABLE = sorted(k for k in FIGURES if k.startswith("mmproj|type=pixtral|"))
PIXTRAL_12B = dict(n_embd=1024, n_ff=4096, n_head=16, n_layer=24, patch_size=16, merge=1, text_embd=5120)
MISTRAL_SMALL_3 = dict(n_embd=1024, n_ff=4096, n_head=16, n_layer=24, patch_size=14, merge=2, text_embd=5120)

# Measured with tests/record_projector_figures.py measure_largest (the b11434 RPC server, one image): the shape as in
# PIXTRAL_SHAPES (type, n_embd, n_ff, n_head, n_layer, image, patch, merge, flash attention, text n_embd), the
# llama-server flags (--image-min-tokens N --image-max-tokens N, or as given), the image (px), the tokens the binary
# decoded (the grid's, plus one [IMG_BREAK] a row but the last), the warm-up's printed RPC0 MiB, and the device's
# compute buffer after the image (bytes).
N = "--image-min-tokens {n} --image-max-tokens {n}"
MEASURED = [
    # no flash attention, d_head 80: 80 patches make the f32 scores [80, 80, 4] as large as a 320-wide activation,
    # and the packing needs more at 80 tokens than at 81 .. 106 (100 measured)
    (("pixtral", 320, 128, 4, 1, 1024, 14, 1, "off", 1000), N.format(n=80), (1, 80), 159, 0.57, 1702400),
    (("pixtral", 320, 128, 4, 1, 1024, 14, 1, "off", 1000), N.format(n=100), (1, 100), 199, 0.9, 1600000),
    # a grid neither square nor one token wide: 200 x 60 px at 300 tokens is 32 x 10
    (("pixtral", 96, 384, 4, 2, 1540, 14, 2, "on", 768), N.format(n=300), (200, 60), 329, 5.35, 6983680),
    # an image thinner than 1:N gets more than N tokens: 1 x 2048 px at --image-max-tokens 64 is 1 x 362
    (("pixtral", 128, 256, 4, 2, 1024, 16, 1, "on", 256), "--image-max-tokens 64", (1, 2048), 723, 0.29, 2041728),
    # the 32-byte padding of a 24-wide encoder: 1,023 tokens need more than 1,024
    (("pixtral", 24, 2048, 1, 3, 1024, 14, 1, "on", 4096), N.format(n=1023), (1, 1023), 2045, 12.52, 84049696),
    (("pixtral", 24, 2048, 1, 3, 1024, 14, 1, "on", 4096), N.format(n=1024), (1, 1024), 2047, 12.52, 83984384),
    # Pixtral-12B's and Mistral Small 3's widths, more blocks (the freed blocks repeat every 3 blocks: 4 as 1)
    (("pixtral", 1024, 4096, 16, 4, 1024, 16, 1, "on", 5120), N.format(n=256), (1, 256), 511, 16.56, 27262976),
    (("pixtral", 1024, 4096, 16, 3, 1540, 14, 2, "on", 5120), N.format(n=400), (1, 400), 799, 64.62, 113548800),
    # Pixtral-12B and Mistral Small 3.x whole (24 blocks) at their largest image, 1 x 1,024 tokens
    (("pixtral", 1024, 4096, 16, 24, 1024, 16, 1, "on", 5120), N.format(n=1024), (1, 1024), 2047, 16.56, 115343360),
    (("pixtral", 1024, 4096, 16, 24, 1024, 16, 1, "off", 5120), N.format(n=1024), (1, 1024), 2047, 16.06, 113246208),
    (("pixtral", 1024, 4096, 16, 24, 1540, 14, 2, "on", 5120), N.format(n=1024), (1, 1024), 2047, 64.62, 290684928),
]


def _shape_args(shape: tuple) -> dict:
    _, n_embd, n_ff, n_head, n_layer, _, patch, merge, fa, text = shape
    return dict(n_embd=n_embd, n_ff=n_ff, n_head=n_head, n_layer=n_layer, patch_size=patch, merge=merge,
                text_embd=text, flash_attn=fa == "on")  # fmt: skip


def _key(key: str) -> tuple[dict, str, tuple[int, int], dict]:
    """A llama_figures.json key -> (the arguments but the grid, the flags, the image px, the figure)."""
    d = dict(p.split("=", 1) for p in key.split("|")[1:])
    shape = ("pixtral", *(int(d[k]) for k in ("n_embd", "n_ff", "n_head", "n_layer", "image", "patch", "merge")),
             d["flash_attn"], int(d["text_embd"]))  # fmt: skip
    px = tuple(map(int, d.get("image_px", "64x64").split("x")))
    return _shape_args(shape), N.format(n=d["max_tokens"]), px, FIGURES[key]


def _tokens(flags: str) -> tuple[int, int]:
    f = flags.split()
    opt = {f[i]: int(f[i + 1]) for i in range(0, len(f), 2)}
    return opt.get("--image-min-tokens", 8), opt.get("--image-max-tokens", 1024)


def _check(args: dict, flags: str, px: tuple[int, int], batch: int, warm_mib: float, largest: int) -> None:
    lo, hi = _tokens(flags)
    grid = pixtral_grid(*px, patch_size=args["patch_size"], merge=args["merge"], min_tokens=lo, max_tokens=hi)
    assert grid[0] * grid[1] + grid[1] - 1 == batch  # the grid the binary encoded
    warm = pixtral_compute_bytes(grid=pixtral_warmup_grid(hi), **args)
    assert round(warm / MIB, 2) == warm_mib
    assert max(warm, pixtral_compute_bytes(grid=grid, **args)) == largest


def test_every_recorded_kind_is_there():
    assert len(TABLE) >= 30 and all("error" not in FIGURES[k] for k in TABLE)
    assert {_key(k)[0]["merge"] for k in TABLE} == {1, 2} and {_key(k)[0]["flash_attn"] for k in TABLE} == {True, False}


@pytest.mark.parametrize("key", TABLE)
def test_recorded_device_buffer_is_exact(key):
    """The RPC device's buffer after one image (the warm-up's, or grown to the image's), to the byte; the warm-up's
    as printed; the image's grid as the binary counted its tokens."""
    args, flags, px, fig = _key(key)
    _check(args, flags, px, fig["image_batch_tokens"], fig["warmup_compute_mib"]["RPC0"], fig["largest_bytes"])
    lo, hi = _tokens(flags)
    grid = pixtral_grid(*px, patch_size=args["patch_size"], merge=args["merge"], min_tokens=lo, max_tokens=hi)
    warm = pixtral_compute_bytes(grid=pixtral_warmup_grid(hi), **args)
    assert fig["grew"] == (pixtral_compute_bytes(grid=grid, **args) > warm)


@pytest.mark.parametrize("row", MEASURED, ids=lambda r: "-".join(map(str, r[0][1:] + r[2])) + "-" + r[1].split()[-1])
def test_measured_device_buffer_is_exact(row):
    shape, flags, px, batch, warm_mib, largest = row
    _check(_shape_args(shape), flags, px, batch, warm_mib, largest)


def test_the_grid_is_llama_cpps():
    """mtmd's dyn-size preprocessing: a 64 x 64 picture at N tokens is ceil(sqrt(N)) a side, 1 x N px one token
    wide; the default limits (8 .. 1,024) keep big images under 1,024 tokens, and thin ones get more."""
    g = dict(patch_size=16, merge=1)
    assert pixtral_grid(64, 64, min_tokens=300, max_tokens=300, **g) == (18, 18)
    assert pixtral_grid(1, 1024, min_tokens=1024, max_tokens=1024, patch_size=14, merge=2) == (1, 1024)
    assert pixtral_grid(4000, 3000, **g) == (36, 27)
    assert pixtral_grid(1, 2048, max_tokens=64, **g) == (1, 362)
    assert pixtral_grid(1, 1024, min_tokens=79, max_tokens=79, **g) == (1, 285)
    assert pixtral_warmup_grid() == pixtral_warmup_grid(1024) == (16, 16) and pixtral_warmup_grid(80) == (8, 8)


# --- the plan: the largest buffer over every image of at most N tokens ---

SMALL = [
    dict(n_embd=128, n_ff=256, n_head=4, n_layer=2, patch_size=16, merge=1, text_embd=256, flash_attn=True),
    dict(n_embd=128, n_ff=256, n_head=4, n_layer=2, patch_size=16, merge=1, text_embd=256, flash_attn=False),
    dict(n_embd=64, n_ff=128, n_head=2, n_layer=2, patch_size=14, merge=2, text_embd=256, flash_attn=True),
    dict(n_embd=320, n_ff=128, n_head=4, n_layer=1, patch_size=14, merge=1, text_embd=1000, flash_attn=False),
]


@pytest.mark.parametrize("args", SMALL, ids=lambda a: "-".join(str(v) for v in a.values()))
@pytest.mark.parametrize("n", [30, 100])
def test_the_plan_is_the_largest_over_every_grid(args, n):
    """Every grid of at most N tokens replayed: the planned grids hold the largest."""
    assert pixtral_planned_bytes(max_tokens=n, **args) == pixtral_largest_bytes(max_tokens=n, **args)[0]


def test_more_tokens_can_need_less():
    """Measured (MEASURED): without flash attention, 80 tokens of d_head 80 need 1,702,400 bytes, 100 tokens
    1,600,000: a lane at --image-max-tokens 100 is planned at the 80-token image."""
    args = _shape_args(MEASURED[0][0])
    assert pixtral_compute_bytes(grid=(1, 80), **args) - pixtral_compute_bytes(grid=(1, 100), **args) == 102400
    assert pixtral_planned_bytes(max_tokens=100, **args) == 1702400
    assert pixtral_largest_bytes(max_tokens=100, **args) == (1702400, (1, 80))
    args = _shape_args(MEASURED[4][0])  # the 32-byte padding: 1,023 tokens need more than 1,024
    assert pixtral_planned_bytes(max_tokens=1024, **args) == 84049696


@pytest.mark.parametrize("fa", [True, False])
@pytest.mark.parametrize("model", [PIXTRAL_12B, MISTRAL_SMALL_3], ids=["pixtral-12b", "mistral-small-3"])
def test_real_models_are_planned_at_the_image_one_token_wide(model, fa):
    """At 1,024 tokens the largest image is 1 x 1,024 (every grid replayed offline: the largest of all 7,000-odd;
    three of the four measured whole: MEASURED)."""
    want = {(1, True): 115343360, (1, False): 113246208, (2, True): 290684928, (2, False): 1188265984}
    got = pixtral_planned_bytes(flash_attn=fa, max_tokens=1024, **model)
    assert got == pixtral_compute_bytes(grid=(1, 1024), flash_attn=fa, **model) == want[model["merge"], fa]
    assert got > pixtral_compute_bytes(grid=(32, 32), flash_attn=fa, **model)


def test_blocks_repeat_every_three():
    """The freed blocks a block leaves repeat every third block at Pixtral-12B's widths: 24 blocks need what 3 do,
    4 what 1 does (measured: MEASURED)."""
    sizes = {n: pixtral_compute_bytes(grid=(1, 256), flash_attn=True, **{**PIXTRAL_12B, "n_layer": n})
             for n in (1, 2, 3, 4, 24)}  # fmt: skip
    assert sizes[1] == sizes[4] == 27262976 and sizes[3] == sizes[24] != sizes[2]


def test_the_device_and_the_cpu_differ_only_by_the_inputs():
    """On the CPU (--no-mmproj-offload) the inputs are leafs in the buffer; on the device they are the host's, copied
    in at the split's start: the same graph either way."""
    args = dict(SMALL[0], grid=(3, 7))
    g = build_graph(**args)
    assert replay(g, offload_inputs=True).size == pixtral_compute_bytes(**args)
    assert [t.label() for t in g.nodes[-4:]] == ["SCALE", "ADD", "CONCAT", "VIEW"]


def test_bad_widths_and_empty_images():
    args = dict(SMALL[0])
    assert pixtral_compute_bytes(grid=(0, 5), **args) == 0
    with pytest.raises(ValueError):
        pixtral_compute_bytes(grid=(2, 2), **{**args, "n_head": 3})
    with pytest.raises(ValueError):
        pixtral_planned_bytes(max_tokens=64, **{**args, "n_embd": 4, "n_head": 4})  # odd heads: no 2-D RoPE
    assert pixtral_planned_grids(n_embd=1024, n_head=16, merge=1, flash_attn=True, max_tokens=1024) == [
        (16, 16), (1, 1023), (1, 1024)]


def test_a_plan_is_fast_and_cached():
    """The planner's call: a few grids replayed (3 with flash attention, 9 without) at 24 blocks, then cached."""
    for fa in (True, False):
        _bytes.cache_clear()
        _planned.cache_clear()
        start = time.perf_counter()
        first = pixtral_planned_bytes(flash_attn=fa, max_tokens=1024, **PIXTRAL_12B)
        built = time.perf_counter() - start
        start = time.perf_counter()
        assert pixtral_planned_bytes(flash_attn=fa, max_tokens=1024, **PIXTRAL_12B) == first
        assert time.perf_counter() - start < 0.001 and built < 0.5


@pytest.mark.slow
def test_real_binary_matches_a_new_shape(tmp_path, rpc_bin):
    """A shape in neither table (5 heads of 32, 3 blocks, merge 2, no flash attention, a 300 x 100 px image at 150
    tokens) through the real llama-server on an RPC device."""
    from record_projector_figures import measure_largest, projector_for

    shape = ("pixtral", 160, 640, 5, 3, 1540, 14, 2, "off", 640)
    model, mmproj = projector_for(tmp_path, shape)
    fig = measure_largest(rpc_bin, model, mmproj, "off", 150, (300, 100))
    assert "error" not in fig, fig
    _check(_shape_args(shape), N.format(n=150), (300, 100), fig["image_batch_tokens"],
           fig["warmup_compute_mib"]["RPC0"], fig["largest_bytes"])  # fmt: skip
    assert fig["grew"]
