"""The images a chat request carries, measured before it is forwarded (pure).

llama.cpp scales an image to its projector's budget keeping the aspect ratio, but keeps at least one
patch across: a long enough strip gets more patches than any budget, and a projector buffer past
its lane's plan (docs/vision.md). The planner says per lane the longest image its plan holds
(LaneSpec.image_max_aspect); a request with a longer one is refused here, before a lane pays for it.
Only images sent inline (data: URLs) are measured: Pillow reads the size from the first 192 KiB of
each, no pixel is decoded, so a request's images cost the event loop well under a millisecond each.
"""

from __future__ import annotations

import base64
import binascii
import io

from PIL import Image, UnidentifiedImageError

HEAD_CHARS = 256 * 1024  # base64 characters decoded for the header: 192 KiB


def image_sizes(payload: object) -> list[tuple[int, int]]:
    """(width, height) of every inline image in a chat request's messages whose size its head gives."""
    sizes = []
    for url in _image_urls(payload):
        head, _, data = url.partition(",")
        if not head.startswith("data:") or not head.endswith(";base64"):
            continue  # a remote URL, or not base64: not measured here
        try:  # the head only: a size sits in the first bytes (a JPEG's after its EXIF and ICC blocks)
            head_bytes = base64.b64decode(data[:HEAD_CHARS], validate=False)
            with Image.open(io.BytesIO(head_bytes)) as image:
                sizes.append(image.size)
        except (binascii.Error, UnidentifiedImageError, OSError, ValueError, Image.DecompressionBombError):
            continue  # llama-server answers what it cannot read
    return sizes


def aspect_refusal(payload: object, max_aspect: int) -> str | None:
    """The 400's message for an image longer than max_aspect:1 (long side over short), or None."""
    for width, height in image_sizes(payload):
        short, long = sorted((width, height))
        if short <= 0 or long > max_aspect * short:
            return (f"an image of {width} x {height} pixels is longer than {max_aspect}:1, the longest this model's "
                    f"lanes are planned for (llama.cpp would give it more tokens than its projector's memory holds); "
                    "crop or pad it")  # fmt: skip
    return None


def _image_urls(payload: object) -> list[str]:
    messages = payload.get("messages") if isinstance(payload, dict) else None
    urls = []
    for message in messages if isinstance(messages, list) else ():
        content = message.get("content") if isinstance(message, dict) else None
        for part in content if isinstance(content, list) else ():
            image = part.get("image_url") if isinstance(part, dict) else None
            url = image.get("url") if isinstance(image, dict) else image
            if isinstance(url, str):
                urls.append(url)
    return urls
