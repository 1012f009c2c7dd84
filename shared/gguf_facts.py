"""Model facts read from a GGUF file's header (the edge that reads files).

shared.gguf_scan reads the metadata and tensor infos without building the vocabulary,
so the real Gemma 3 270M file (262k tokens) reads in well under 0.1 s. The tensors grouped per
layer come from shared.gguf_weights, a model's projector from shared.gguf_projector.
"""

from __future__ import annotations

import hashlib
import os
import re
from pathlib import Path

import msgspec

from shared.gguf_projector import is_projector_name, pair, projector_facts
from shared.gguf_scan import ArrayLength, GGUFFormatError, GGUFHeader, read_header
from shared.gguf_weights import expert_weights, layer_weights
from shared.messages.hosts import ModelFacts

# llama.cpp's default sliding-window pattern per architecture when the GGUF has none
# (llama_model_*::load_arch_hparams: gemma2 2, gemma3 6, cohere2 4, gpt-oss 2: even layers slide).
_DEFAULT_SWA_PATTERN = {"gemma2": 2, "gemma3": 6, "cohere2": 4, "gpt-oss": 2}
_MLA_ARCHS = {"deepseek2", "deepseek3", "kimi_k2", "glm4_moe_lite"}


class ModelError(ValueError):
    """A file that is not a GGUF model lanes can plan for."""


class AdapterFile(ModelError):
    """A LoRA adapter (general.type = adapter): shared.adapters reads it, the model scan skips it."""


def model_name(path: str | os.PathLike[str]) -> str:
    stem = Path(path).name
    stem = stem[:-5] if stem.endswith(".gguf") else stem
    name = re.sub(r"[^A-Za-z0-9_.-]", "_", stem).lstrip("._-") or "model"
    return name[:128]


def _value(header: GGUFHeader, key: str):
    return header.fields.get(key)


def swa_layer_pattern(n_layer: int, n_pattern: int, dense_first: bool = False) -> tuple[bool, ...]:
    """llama_hparams::set_swa_pattern: which layers use the sliding window."""
    if dense_first:
        return tuple(n_pattern == 0 or il % n_pattern != 0 for il in range(n_layer))
    return tuple(n_pattern == 0 or il % n_pattern < n_pattern - 1 for il in range(n_layer))


def read_model_facts(path: str | os.PathLike[str]) -> ModelFacts:
    path = Path(path)
    if not path.is_file():
        raise ModelError(f"{path}: no such file")
    try:
        reader = read_header(path)
    except (GGUFFormatError, OSError, ValueError) as exc:
        raise ModelError(f"{path}: not a GGUF file ({exc})") from None
    if _value(reader, "general.type") == "adapter":
        raise AdapterFile(f"{path}: a LoRA adapter, not a model")
    arch = _value(reader, "general.architecture")
    if not isinstance(arch, str):
        raise ModelError(f"{path}: GGUF has no general.architecture")

    def key(suffix: str, default=None):
        value = _value(reader, f"{arch}.{suffix}")
        return default if value is None else value

    n_layer = int(key("block_count", 0))
    n_embd = int(key("embedding_length", 0))
    n_head_raw = key("attention.head_count", 0)
    if n_layer <= 0 or n_embd <= 0:
        raise ModelError(f"{path}: GGUF lacks {arch}.block_count or {arch}.embedding_length")
    n_head_list = _per_layer(n_head_raw, n_layer)
    n_head = max(n_head_list) if n_head_list else 0
    n_head_kv = _per_layer(key("attention.head_count_kv", n_head_raw), n_layer)
    head_dim_default = n_embd // n_head if n_head else 0
    head_dim_k = int(key("attention.key_length", head_dim_default))
    head_dim_v = int(key("attention.value_length", head_dim_default))

    is_mla = arch in _MLA_ARCHS and key("attention.kv_lora_rank") is not None
    n_swa = int(key("attention.sliding_window", 0) or 0)
    swa_layers: tuple[bool, ...] = ()
    if n_swa > 0:
        pattern = key("attention.sliding_window_pattern")
        if isinstance(pattern, list):
            swa_layers = tuple(bool(x) for x in pattern[:n_layer])
        elif pattern is not None or arch in _DEFAULT_SWA_PATTERN:
            n_pattern = int(pattern) if pattern is not None else _DEFAULT_SWA_PATTERN[arch]
            swa_layers = swa_layer_pattern(n_layer, n_pattern)
        if not any(swa_layers):
            n_swa, swa_layers = 0, ()
    elif arch == "gemma2":
        n_swa, swa_layers = 4096, swa_layer_pattern(n_layer, 2)

    recurrent_layers, recurrent_bytes = _recurrent(arch, key, n_layer, n_head_kv)

    tokens = _value(reader, "tokenizer.ggml.tokens")
    if isinstance(tokens, ArrayLength):
        n_vocab = tokens.length
    else:
        n_vocab = len(tokens) if isinstance(tokens, list) else int(key("vocab_size", 0) or 0)
    weight_bytes = sum(int(t.n_bytes) for t in reader.tensors)
    layers, tied, tied_cuda = layer_weights(reader, n_layer)
    experts = expert_weights(reader, n_layer)
    st = path.stat()
    return ModelFacts(
        path=os.path.abspath(path),  # as the folder holds it: symlinks (HF snapshots/) stay links
        name=model_name(path),
        architecture=arch,
        n_layer=n_layer,
        n_embd=n_embd,
        n_head=n_head,
        n_head_kv=n_head_kv,
        head_dim_k=head_dim_k,
        head_dim_v=head_dim_v,
        n_ctx_train=int(key("context_length", 0)),
        n_vocab=n_vocab,
        n_ff=int(max(_per_layer(key("feed_forward_length", 0), n_layer) or (0,))),
        n_swa=n_swa,
        swa_layers=swa_layers,
        is_mla=is_mla,
        recurrent_layers=recurrent_layers,
        recurrent_bytes_per_seq=recurrent_bytes,
        weight_bytes=weight_bytes,
        file_bytes=st.st_size,
        layer_weights=layers,
        tied_output_bytes=tied,
        tied_output_cuda_bytes=tied_cuda,
        file_mtime_ns=st.st_mtime_ns,
        n_expert=int(key("expert_count", 0) or 0),
        n_expert_used=int(key("expert_used_count", 0) or 0),
        n_ff_exp=int(key("expert_feed_forward_length", 0) or 0),
        n_ff_shexp=int(key("expert_shared_feed_forward_length", 0) or 0),
        expert_weights=experts,
        has_chat_template=isinstance(_value(reader, "tokenizer.chat_template"), str),
        pooling=_POOLING.get(int(key("pooling_type", 0) or 0), ""),
        vocab_id=vocab_id(reader),
    )


def vocab_id(header: GGUFHeader) -> str:
    """The vocabulary's identity: tokenizer model, pre-tokenizer and the token list's bytes (a short
    list is hashed from its items). Two models draft for each other only when theirs are equal."""
    tokens = _value(header, "tokenizer.ggml.tokens")
    if isinstance(tokens, ArrayLength):
        listed = tokens.digest
    elif isinstance(tokens, list):
        listed = hashlib.blake2b("\0".join(tokens).encode(), digest_size=8).hexdigest()
    else:
        return ""
    return f"{_value(header, 'tokenizer.ggml.model') or ''}/{_value(header, 'tokenizer.ggml.pre') or ''}/{listed}"


# llama.cpp's enum llama_pooling_type as GGUFs store it (0: none, -1: unspecified).
_POOLING = {1: "mean", 2: "cls", 3: "last", 4: "rank"}


def _per_layer(value, n_layer: int) -> tuple[int, ...]:
    if isinstance(value, list):
        values = [int(v) for v in value[:n_layer]]
        return tuple(values + [values[-1] if values else 0] * (n_layer - len(values)))
    return (int(value or 0),) * n_layer


def _recurrent(arch: str, key, n_layer: int, n_head_kv: tuple[int, ...]) -> tuple[tuple[bool, ...], int]:
    """Recurrent state per sequence, f32, for Mamba-style layers (llama_hparams::n_embd_r/s).

    Hybrid models mark attention layers with head_count_kv > 0; pure SSM models have none.
    """
    d_inner = key("ssm.inner_size")
    if d_inner is None:
        return (), 0
    d_conv = int(key("ssm.conv_kernel", 0))
    d_state = int(key("ssm.state_size", 0))
    n_group = int(key("ssm.group_count", 0))
    d_inner = int(d_inner)
    n_embd_r = max(d_conv - 1, 0) * (d_inner + 2 * n_group * d_state)
    n_embd_s = d_state * d_inner
    layers = tuple(kv == 0 for kv in n_head_kv)
    return layers, sum(layers) * (n_embd_r + n_embd_s) * 4


class FactsCache(dict):
    """Facts by (path, size, mtime), kept in a JSON file so a restarted agent reads no GGUF again."""

    def __init__(self, file: str | os.PathLike[str] | None = None) -> None:
        super().__init__()
        self.file = Path(file) if file else None
        self._saved: set = set()
        if self.file and self.file.is_file():
            try:
                entries = msgspec.json.decode(self.file.read_bytes(), type=list[tuple[str, int, int, ModelFacts]])
            except (msgspec.DecodeError, msgspec.ValidationError, OSError):
                entries = []  # a damaged cache is rebuilt, never trusted
            for path, size, mtime, facts in entries:
                self[(path, size, mtime)] = facts
            self._saved = set(self)

    def save(self) -> None:
        if self.file is None or set(self) == self._saved:
            return
        self.file.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.file.with_suffix(".tmp")
        tmp.write_bytes(msgspec.json.encode([(*k, v) for k, v in sorted(self.items(), key=lambda kv: kv[0])]))
        tmp.replace(self.file)
        self._saved = set(self)


def scan_models(
    folders: list[str | os.PathLike[str]], cache: dict[tuple[str, int, int], ModelFacts] | None = None
) -> tuple[list[ModelFacts], list[str]]:
    """Facts for every *.gguf under the folders, and one line per file that could not be read.
    A projector (*mmproj*.gguf) is not a model: it goes into the facts of the model it pairs with.

    With a cache (keyed by path, size and mtime), an unchanged file is not read again.
    """
    found: list[ModelFacts] = []
    projectors = {}
    problems: list[str] = []
    seen: set[tuple[str, int, int]] = set()
    for folder in folders:
        for path in sorted(Path(folder).rglob("*.gguf")):
            if is_projector_name(path):  # a header read, never cached: a few milliseconds
                try:
                    proj = projector_facts(path)
                    projectors[proj.path] = proj
                except (GGUFFormatError, OSError, ValueError) as exc:
                    problems.append(f"{path}: not a projector lanes can read ({exc})")
                continue
            try:
                st = path.stat()
                key = (str(path), st.st_size, st.st_mtime_ns)
                seen.add(key)
                facts = cache.get(key) if cache is not None else None
                if facts is None:
                    facts = read_model_facts(path)
                    if cache is not None:
                        cache[key] = facts
                found.append(facts)
            except AdapterFile:
                continue  # reported as an adapter (shared.adapters.scan_adapters)
            except (ModelError, OSError) as exc:
                problems.append(str(exc))
    pairs = pair([f.path for f in found], list(projectors))
    found = [msgspec.structs.replace(f, mmproj=projectors[pairs[f.path]]) if f.path in pairs else f for f in found]
    for path in sorted(set(projectors) - set(pairs.values())):
        problems.append(f"{path}: a projector with no model beside it (name it after its model)")
    if isinstance(cache, FactsCache):
        for key in [k for k in cache if k not in seen]:  # gone, or changed since (a new key)
            del cache[key]
        cache.save()
    return found, problems
