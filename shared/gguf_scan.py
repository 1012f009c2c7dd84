"""A fast reader of a GGUF file's header: metadata and tensor infos, never the vocabulary.

gguf.GGUFReader builds numpy views of every array, which for a 262k-token vocabulary
takes seconds. Here a string array is walked by its length prefixes only and large
arrays keep just their length, so the real Gemma 3 270M file reads in milliseconds.
Type sizes come from the gguf package (GGML_QUANT_SIZES), not from a table of ours.
"""

from __future__ import annotations

import hashlib
import mmap
import os
import struct
from dataclasses import dataclass

from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFValueType

MAGIC = b"GGUF"
DEFAULT_ALIGNMENT = 32
SMALL_ARRAY = 4096  # arrays up to this length are kept whole (per-layer values); longer ones as a length

_SCALAR = {
    GGUFValueType.UINT8: "<B",
    GGUFValueType.INT8: "<b",
    GGUFValueType.UINT16: "<H",
    GGUFValueType.INT16: "<h",
    GGUFValueType.UINT32: "<I",
    GGUFValueType.INT32: "<i",
    GGUFValueType.FLOAT32: "<f",
    GGUFValueType.BOOL: "<?",
    GGUFValueType.UINT64: "<Q",
    GGUFValueType.INT64: "<q",
    GGUFValueType.FLOAT64: "<d",
}


class GGUFFormatError(ValueError):
    pass


@dataclass(frozen=True)
class ArrayLength:
    """A long array (a vocabulary, its scores): only its length is read."""

    length: int
    digest: str = ""  # of a string array: a hash of its bytes (a vocabulary's identity)


@dataclass(frozen=True)
class TensorInfo:
    name: str
    type: int  # ggml type id
    shape: tuple[int, ...]  # ggml order: ne[0] first
    offset: int  # from the start of the data section
    n_bytes: int

    @property
    def type_name(self) -> str:
        try:
            return GGMLQuantizationType(self.type).name
        except ValueError:
            return str(self.type)


@dataclass(frozen=True)
class GGUFHeader:
    version: int
    fields: dict[str, object]
    tensors: tuple[TensorInfo, ...]
    data_offset: int  # file offset of the tensor data section
    alignment: int


def tensor_bytes(ggml_type: int, shape: tuple[int, ...]) -> int:
    try:
        block, size = GGML_QUANT_SIZES[GGMLQuantizationType(ggml_type)]
    except (KeyError, ValueError):
        raise GGUFFormatError(f"unknown ggml tensor type {ggml_type}") from None
    n = 1
    for d in shape:
        n *= d
    if shape and shape[0] % block:
        raise GGUFFormatError(f"row of {shape[0]} values is not a whole number of {block}-value blocks")
    return n // block * size


def read_header(path: str | os.PathLike[str]) -> GGUFHeader:
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        if size < 24:
            raise GGUFFormatError("file too short for a GGUF header")
        with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
            return _parse(buf, size)


def _parse(buf, size: int) -> GGUFHeader:
    if buf[:4] != MAGIC:
        raise GGUFFormatError("no GGUF magic")
    unpack = struct.unpack_from
    (version,) = unpack("<I", buf, 4)
    if version not in (2, 3):
        raise GGUFFormatError(f"unsupported GGUF version {version}")
    n_tensors, n_kv = unpack("<QQ", buf, 8)
    pos = 24

    def need(n: int) -> None:
        if pos + n > size:
            raise GGUFFormatError("truncated header")

    def string() -> str:
        nonlocal pos
        need(8)
        (n,) = unpack("<Q", buf, pos)
        need(8 + n)
        text = bytes(buf[pos + 8 : pos + 8 + n]).decode("utf-8", errors="replace")
        pos += 8 + n
        return text

    def scalar(vtype: int):
        nonlocal pos
        fmt = _SCALAR[vtype]
        n = struct.calcsize(fmt)
        need(n)
        (value,) = unpack(fmt, buf, pos)
        pos += n
        return value

    def value(vtype: int):
        nonlocal pos
        if vtype == GGUFValueType.STRING:
            return string()
        if vtype in _SCALAR:
            return scalar(vtype)
        if vtype != GGUFValueType.ARRAY:
            raise GGUFFormatError(f"unknown value type {vtype}")
        need(12)
        item_type, length = unpack("<IQ", buf, pos)
        pos += 12
        if item_type == GGUFValueType.STRING:
            if length <= SMALL_ARRAY:
                return [string() for _ in range(length)]
            start = pos
            for _ in range(length):  # walk the length prefixes only
                need(8)
                (n,) = unpack("<Q", buf, pos)
                pos += 8 + n
            need(0)
            return ArrayLength(length, hashlib.blake2b(buf[start:pos], digest_size=8).hexdigest())
        if item_type not in _SCALAR:
            raise GGUFFormatError(f"unsupported array item type {item_type}")
        fmt = _SCALAR[item_type]
        width = struct.calcsize(fmt)
        need(width * length)
        if length <= SMALL_ARRAY:
            items = list(struct.unpack_from(f"<{length}{fmt[1]}", buf, pos))
            pos += width * length
            return items
        pos += width * length
        return ArrayLength(length)

    fields: dict[str, object] = {}
    for _ in range(n_kv):
        key = string()
        need(4)
        (vtype,) = unpack("<I", buf, pos)
        pos += 4
        try:
            fields[key] = value(GGUFValueType(vtype))
        except ValueError:
            raise GGUFFormatError(f"unknown value type {vtype} for {key}") from None

    tensors = []
    for _ in range(n_tensors):
        name = string()
        need(4)
        (n_dims,) = unpack("<I", buf, pos)
        pos += 4
        need(8 * n_dims + 12)
        shape = unpack(f"<{n_dims}Q", buf, pos)
        pos += 8 * n_dims
        ggml_type, offset = unpack("<IQ", buf, pos)
        pos += 12
        tensors.append(TensorInfo(name, ggml_type, tuple(shape), offset, tensor_bytes(ggml_type, shape)))

    alignment = fields.get("general.alignment", DEFAULT_ALIGNMENT)
    if not isinstance(alignment, int) or alignment <= 0:
        alignment = DEFAULT_ALIGNMENT
    data_offset = -(-pos // alignment) * alignment
    end = max((data_offset + t.offset + t.n_bytes for t in tensors), default=data_offset)
    if end > size:
        raise GGUFFormatError(f"tensor data runs past the end of the file ({end} > {size} bytes)")
    return GGUFHeader(version, fields, tuple(tensors), data_offset, alignment)
