"""The gateway measures inline images before forwarding (gateway/edge/images.py): their sizes from
the head of each data: URL, and the refusal of one longer than its lanes' plans hold."""

from __future__ import annotations

import base64
import io

import pytest
from PIL import Image
from test_vision_real import tiny_png

from gateway.edge.images import HEAD_CHARS, aspect_refusal, image_sizes


def _url(data: bytes, mime: str = "image/png") -> str:
    return f"data:{mime};base64," + base64.b64encode(data).decode()


def _encoded(width: int, height: int, fmt: str, **save) -> bytes:
    out = io.BytesIO()
    Image.new("RGB", (width, height), (90, 120, 30)).save(out, fmt, **save)
    return out.getvalue()


def _chat(*urls: str, bare: bool = False) -> dict:
    parts = [{"type": "image_url", "image_url": url if bare else {"url": url}} for url in urls]
    return {"model": "m", "messages": [{"role": "system", "content": "be brief"},
                                       {"role": "user", "content": [{"type": "text", "text": "hi"}, *parts]}]}  # fmt: skip


@pytest.mark.parametrize("fmt", ["PNG", "JPEG", "GIF", "WEBP", "BMP"])
def test_every_common_format_is_measured_from_its_head(fmt):
    assert image_sizes(_chat(_url(_encoded(49, 4095, fmt)), _url(tiny_png(300, 200)))) == [(49, 4095), (300, 200)]


def test_a_jpegs_size_after_a_large_metadata_block_is_read_within_the_head():
    """A JPEG's size follows its EXIF and ICC blocks: one of 64 KiB of metadata is still measured."""
    data = _encoded(1000, 30, "JPEG", exif=b"Exif\x00\x00" + b"\x00" * 60_000)
    assert len(base64.b64encode(data)) > 80_000 and image_sizes(_chat(_url(data, "image/jpeg"))) == [(1000, 30)]
    assert HEAD_CHARS >= 256 * 1024


def test_what_it_cannot_measure_passes_to_the_lane():
    """Remote URLs, garbage, a truncated header: not measured (llama-server answers for them)."""
    payload = _chat("https://example.org/a.png", "data:image/png;base64,@@@@", _url(b"\x89PNG\r\n"),
                    _url(tiny_png(8, 8)), bare=True)  # fmt: skip
    assert image_sizes(payload) == [(8, 8)]
    assert image_sizes({"messages": "text"}) == image_sizes([]) == image_sizes({"messages": [{"content": 3}]}) == []


def test_an_image_longer_than_the_cap_is_refused_and_one_at_it_is_not():
    at = _chat(_url(tiny_png(10, 200)), _url(tiny_png(200, 10)))
    longer = _chat(_url(tiny_png(10, 201)))
    assert aspect_refusal(at, 20) is None and aspect_refusal(_chat(), 20) is None
    assert aspect_refusal(longer, 20).startswith("an image of 10 x 201 pixels is longer than 20:1")
    assert aspect_refusal(longer, 1024) is None
