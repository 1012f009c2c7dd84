"""Model facts read from generated GGUF files."""

from __future__ import annotations

import os
from pathlib import Path

import gguf
import numpy as np
import pytest

from shared.gguf_facts import (
    ModelError,
    model_name,
    read_model_facts,
    scan_models,
    swa_layer_pattern,
)


def _tensor_bytes(path: Path) -> int:
    """Sum of tensor data sizes, computed from shapes and types (not from the code under test)."""
    total = 0
    for t in gguf.GGUFReader(path).tensors:
        block, type_size = gguf.GGML_QUANT_SIZES[t.tensor_type]
        total += int(np.prod([int(d) for d in t.shape])) // block * type_size
    return total


def test_llama_gqa(tiny_models):
    facts = read_model_facts(tiny_models["llama_gqa"])
    assert facts.architecture == "llama"
    assert facts.name == "llama_gqa"
    assert facts.path == str(Path(tiny_models["llama_gqa"]).resolve())
    assert facts.n_layer == 2
    assert facts.n_embd == 256
    assert facts.n_head == 4
    assert facts.n_head_kv == (2, 2)
    assert facts.head_dim_k == 64
    assert facts.head_dim_v == 64
    assert facts.n_ctx_train == 4096
    assert facts.n_vocab == 259
    assert facts.n_ff == 512
    assert not facts.is_mla
    assert facts.n_swa == 0 and facts.swa_layers == ()
    assert facts.recurrent_layers == () and facts.recurrent_bytes_per_seq == 0


def test_llama8(tiny_models):
    facts = read_model_facts(tiny_models["llama8"])
    assert facts.n_layer == 8
    assert facts.n_head_kv == (8,) * 8
    assert (facts.head_dim_k, facts.head_dim_v) == (64, 64)
    assert facts.n_ctx_train == 32768


@pytest.mark.parametrize("which", ["llama8", "llama_gqa", "gemma3", "mla"])
def test_weight_bytes_is_sum_of_tensors(tiny_models, which):
    path = Path(tiny_models[which])
    facts = read_model_facts(path)
    assert facts.weight_bytes == _tensor_bytes(path)
    assert 0 < facts.weight_bytes < facts.file_bytes
    assert facts.file_bytes == os.path.getsize(path)


def test_llama8_weight_bytes_by_hand(tiny_models):
    # All matrices f16, norms f32 (tinymodels.write_llama with n_embd 512, n_ff 512, 8 heads x 64).
    n_vocab, d, ff, layers = 259, 512, 512, 8
    per_layer = 2 * (d * d + d * d + d * d + d * d + 3 * ff * d) + 4 * (2 * d)
    expected = 2 * n_vocab * d * 2 + 4 * d + layers * per_layer
    assert read_model_facts(tiny_models["llama8"]).weight_bytes == expected


def test_gemma3_swa_pattern(tiny_models):
    facts = read_model_facts(tiny_models["gemma3"])
    assert facts.architecture == "gemma3"
    assert facts.n_swa == 512
    assert facts.swa_layers == (True, True, True, True, True, False)


def test_swa_layer_pattern():
    assert swa_layer_pattern(12, 6) == (True,) * 5 + (False,) + (True,) * 5 + (False,)
    assert swa_layer_pattern(4, 2) == (True, False, True, False)
    assert swa_layer_pattern(4, 2, dense_first=True) == (False, True, False, True)
    assert swa_layer_pattern(3, 0) == (True, True, True)


def test_deepseek2_mla(tiny_models):
    facts = read_model_facts(tiny_models["mla"])
    assert facts.architecture == "deepseek2"
    assert facts.is_mla is True
    assert facts.head_dim_k == 576
    assert facts.head_dim_v == 512
    assert facts.n_head_kv == (1, 1, 1, 1)
    assert facts.n_ctx_train == 163840


def _write_meta_only(path: Path, arch: str, setup) -> Path:
    w = gguf.GGUFWriter(str(path), arch)
    setup(w)
    w.add_tensor("token_embd.weight", np.zeros((4, 64), dtype=np.float16))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def test_per_layer_head_count_kv_array(tmp_path):
    def setup(w: gguf.GGUFWriter) -> None:
        w.add_context_length(8192)
        w.add_embedding_length(1024)
        w.add_block_count(6)
        w.add_head_count(16)
        w.add_head_count_kv([8, 8, 4, 4, 0, 2])  # GGUFWriter stores a list as an array
        w.add_key_length(64)
        w.add_value_length(64)

    path = _write_meta_only(tmp_path / "perlayer.gguf", "llama", setup)
    raw = gguf.GGUFReader(path).fields["llama.attention.head_count_kv"]
    assert raw.types[0] == gguf.GGUFValueType.ARRAY  # really an array on disk
    facts = read_model_facts(path)
    assert facts.n_head_kv == (8, 8, 4, 4, 0, 2)
    assert facts.n_head == 16
    assert facts.weight_bytes == 4 * 64 * 2


def test_head_count_kv_defaults_to_head_count_and_head_dim_to_embd_over_heads(tmp_path):
    def setup(w: gguf.GGUFWriter) -> None:
        w.add_context_length(2048)
        w.add_embedding_length(1024)
        w.add_block_count(3)
        w.add_head_count(8)

    facts = read_model_facts(_write_meta_only(tmp_path / "defaults.gguf", "llama", setup))
    assert facts.n_head_kv == (8, 8, 8)
    assert (facts.head_dim_k, facts.head_dim_v) == (128, 128)


def test_missing_file(tmp_path):
    with pytest.raises(ModelError, match="no such file"):
        read_model_facts(tmp_path / "absent.gguf")


def test_directory_is_not_a_model(tmp_path):
    with pytest.raises(ModelError):
        read_model_facts(tmp_path)


@pytest.mark.parametrize(
    "content",
    [
        b"",
        b"this is not a gguf file at all\n" * 100,
        b"GGUF\x03\x00\x00\x00" + b"\x00" * 3,
        b"GGUF\x03\x00\x00\x00garbage-after-the-magic",
    ],
    ids=["empty", "text", "truncated", "garbage"],
)
def test_not_a_gguf(tmp_path, content):
    path = tmp_path / "junk.gguf"
    path.write_bytes(content)
    with pytest.raises(ModelError, match="junk.gguf"):
        read_model_facts(path)


def test_gguf_without_architecture(tmp_path):
    path = tmp_path / "noarch.gguf"
    w = gguf.GGUFWriter(str(path), "llama")
    # GGUFWriter always writes general.architecture; drop it from the KV table before writing.
    for kv in w.kv_data:
        kv.pop("general.architecture", None)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(ModelError, match="architecture"):
        read_model_facts(path)


def test_model_name():
    assert model_name("/x/Qwen3-8B-Q4_K_M.gguf") == "Qwen3-8B-Q4_K_M"
    assert model_name("/x/my model (v2).gguf") == "my_model__v2_"
    assert model_name("/x/.hidden.gguf") == "hidden"


def test_scan_models_one_good_one_junk(tmp_path, tiny_models):
    folder = tmp_path / "models"
    (folder / "sub").mkdir(parents=True)
    (folder / "sub" / "good.gguf").write_bytes(Path(tiny_models["llama_gqa"]).read_bytes())
    (folder / "junk.gguf").write_bytes(b"not a model")
    (folder / "readme.txt").write_text("ignored")
    found, problems = scan_models([folder])
    assert [m.name for m in found] == ["good"]
    assert len(problems) == 1
    assert "junk.gguf" in problems[0]
    assert "\n" not in problems[0]
