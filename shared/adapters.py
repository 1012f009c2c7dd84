"""LoRA adapter files: found beside the models they fit, and what they allocate (the edge that reads files).

llama.cpp (llama_adapter_lora_init_impl) loads an adapter only onto a model of the same
architecture whose tensors exist for every lora_a/lora_b pair with matching shapes, and puts
each pair in the buffer type of the base tensor it modifies (a repacked CPU tensor's pair in
the plain CPU buffer). So an adapter is paired with every model on the host it fits, the ones
in its own folder first, and its tensors are grouped by their base tensor's layer.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from pathlib import Path

import msgspec

from shared.gguf_facts import model_name
from shared.gguf_scan import GGUFFormatError, GGUFHeader, TensorInfo, read_header
from shared.gguf_weights import group_weights
from shared.messages.hosts import OUTPUT_LAYER, AdapterFacts, ModelFacts

_OUTPUT = ("output.",)


def is_adapter(header: GGUFHeader) -> bool:
    return header.fields.get("general.type") == "adapter"


def _pairs(header: GGUFHeader) -> dict[str, tuple[TensorInfo | None, TensorInfo | None]]:
    """{base tensor name: (lora_a, lora_b)}; norm vectors are skipped as llama.cpp skips them."""
    out: dict[str, list] = {}
    for t in header.tensors:
        for suffix, i in ((".lora_a", 0), (".lora_b", 1)):
            if t.name.endswith(suffix):
                out.setdefault(t.name[: -len(suffix)], [None, None])[i] = t
    return {k: (v[0], v[1]) for k, v in out.items()}


def _layer(name: str) -> int:
    if name.startswith("blk."):
        try:
            return int(name.split(".", 2)[1])
        except ValueError:
            return -1
    return OUTPUT_LAYER if name.startswith(_OUTPUT) else -1


def read_adapter(path: str | os.PathLike[str], header: GGUFHeader | None = None) -> AdapterFacts:
    """An adapter's facts, bases not yet paired (scan_adapters pairs them)."""
    path = Path(path)
    header = header or read_header(path)
    if not is_adapter(header):
        raise GGUFFormatError(f"{path}: general.type is not adapter")
    groups: dict[int, list[TensorInfo]] = {}
    rank = 0
    for base, (a, b) in _pairs(header).items():
        for t in (a, b):
            if t is not None:
                groups.setdefault(_layer(base), []).append(t)
        if a is not None and b is not None:
            rank = max(rank, b.shape[0] if base.endswith("token_embd.weight") else a.shape[1])
    alpha = header.fields.get("adapter.lora.alpha", 0.0)
    return AdapterFacts(
        path=os.path.abspath(path),
        name=model_name(path),
        architecture=str(header.fields.get("general.architecture", "")),
        file_bytes=path.stat().st_size,
        alpha=float(alpha) if isinstance(alpha, (int, float)) else 0.0,
        rank=rank,
        layer_weights=tuple(group_weights(layer, groups[layer], header.data_offset) for layer in sorted(groups)),
    )


def fits(adapter: GGUFHeader, model: GGUFHeader) -> bool:
    """llama.cpp's checks: same architecture, and each pair's base tensor exists with matching shape."""
    if adapter.fields.get("general.architecture") != model.fields.get("general.architecture"):
        return False
    shapes = {t.name: t.shape for t in model.tensors}
    pairs = _pairs(adapter)
    for base, (a, b) in pairs.items():
        shape = shapes.get(base)
        if a is None or b is None or shape is None or len(shape) < 2 or len(a.shape) < 2 or len(b.shape) < 2:
            return False
        if base.endswith("token_embd.weight"):  # B not transposed, A and B flipped (llm_build_inp_embd)
            if shape[0] != b.shape[1] or shape[1] != a.shape[1]:
                return False
        elif shape[0] != a.shape[0] or shape[1] != b.shape[1] or a.shape[1] != b.shape[0]:
            return False
    return bool(pairs)


# Headers by (path, size, mtime): the agent scans every report, and a file read once is not read
# again until it changes (a model's header walks its vocabulary). Bounded: cleared when full.
_HEADERS: dict[tuple[str, int, int], GGUFHeader | None] = {}
_HEADERS_MAX = 4096


def _header(path: str | os.PathLike[str]) -> GGUFHeader | None:
    """The file's header, or None when it is no GGUF this reader takes."""
    st = os.stat(path)
    key = (str(path), st.st_size, st.st_mtime_ns)
    if key not in _HEADERS:
        if len(_HEADERS) >= _HEADERS_MAX:
            _HEADERS.clear()
        try:
            _HEADERS[key] = read_header(path)
        except GGUFFormatError:
            _HEADERS[key] = None
    return _HEADERS[key]


def scan_adapters(folders: Iterable[str | os.PathLike[str]], models: Iterable[ModelFacts]) -> tuple[list[AdapterFacts], list[str]]:
    """Every adapter under the folders, paired with the models it fits; one line per file that could not be read."""
    models = list(models)
    known = {m.path for m in models}  # models are no adapters: their headers are read only to pair

    def model_header(m: ModelFacts) -> GGUFHeader | None:
        try:
            return _header(m.path)
        except OSError:
            return None

    found, problems = [], []
    for folder in folders:
        for path in sorted(Path(folder).rglob("*.gguf")):
            if os.path.abspath(path) in known:
                continue
            try:
                header = _header(path)
                if header is None or not is_adapter(header):
                    continue
                facts = read_adapter(path, header)
            except (GGUFFormatError, OSError, ValueError) as exc:
                problems.append(f"{path}: {exc}")
                continue
            here = str(path.parent)
            candidates = sorted(
                (m for m in models if m.architecture == facts.architecture),
                key=lambda m: (os.path.dirname(m.path) != here, m.name),
            )
            bases = tuple(dict.fromkeys(m.name for m in candidates if (h := model_header(m)) and fits(header, h)))
            if not bases:
                problems.append(f"{path}: a LoRA adapter for {facts.architecture or 'no architecture'} that fits no model here")
            found.append(msgspec.structs.replace(facts, bases=bases[:64]))
    return found, problems
